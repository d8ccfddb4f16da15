"""An in-process simulated N-worker channel for unit tests.

Each simulated rank runs in its own thread with its own compressor; ``SimulatedWorld.run``
starts them and joins them. Collectives rendezvous on a barrier, check that every rank
issued the same name, and compute the result the way a real allreduce/allgather would.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class CollectiveMismatch(RuntimeError):
    pass


class SimulatedWorld:
    def __init__(self, size: int, timeout: float = 30.0) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size

    def channel(self, rank: int) -> "SimulatedChannel":
        return SimulatedChannel(self, rank)

    def _exchange(self, rank: int, name: str, payload: Any) -> list[Any]:
        """Rendezvous: every rank deposits (name, payload); all see everyone's payloads."""
        self._slots[rank] = (name, payload)
        self._barrier.wait()
        entries = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        names = {n for n, _ in entries}
        if len(names) != 1:
            raise CollectiveMismatch(f"ranks issued different collectives: {sorted(names)}")
        return [p for _, p in entries]

    def run(self, fn: Callable[[int, "SimulatedChannel"], Any]) -> list[Any]:
        """Run ``fn(rank, channel)`` on every simulated rank; return the results by rank."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def worker(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.channel(rank))
            except BaseException as exc:  # surface the first failure, unblock the others
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class SimulatedChannel:
    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    # The simulation is synchronous: "async" records the call, wait() performs it, which keeps
    # the call order that the real channel has (issue, ..., wait).
    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        return ("allreduce", [t.clone() for t in tensors], name)

    def allgather_async(self, tensor: torch.Tensor, name: str):
        return ("allgather", tensor.clone(), name)

    def wait(self, handle):
        kind, payload, name = handle
        everyone = self.world._exchange(self.rank, f"{kind}:{name}", payload)
        if kind == "allgather":
            return torch.cat(everyone)
        # Sum in rank order, then divide: the same on every rank.
        return [torch.stack([ts[i] for ts in everyone]).sum(0) / self.size for i in range(len(payload))]
