"""An in-process simulated N-worker channel for unit tests.

Each simulated rank runs in its own thread with its own compressor; ``SimulatedWorld.run``
starts them and joins them. Collectives rendezvous on a barrier, check that every rank
issued the same name, and compute the result the way a real allreduce/allgather would.
Like the Horovod channel, a wait that another rank never joins raises the channel's
``TimeoutError`` naming the collective (after 30 s by default: it is a unit-test tool).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch

from .channel import Channel, collective_timeout, collective_timeout_error


class CollectiveMismatch(RuntimeError):
    pass


class SimulatedWorld:
    def __init__(self, size: int, timeout: float = 30.0) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size
        self.timeout = collective_timeout(timeout)
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size
        self._failed = threading.Event()  # a rank raised: the others stop waiting for it

    def channel(self, rank: int) -> "SimulatedChannel":
        return SimulatedChannel(self, rank)

    def exchange(self, rank: int, kind: str, name: str, payload: Any) -> list[Any]:
        """Rendezvous: every rank deposits (kind:name, payload); all see everyone's payloads, in
        rank order. Any collective can be simulated on top of it (the channel's allreduce and
        allgather, the control plane's reductions); ranks that name different collectives in
        the same round all raise ``CollectiveMismatch``."""
        self._slots[rank] = (f"{kind}:{name}", payload)
        self._rendezvous(rank, name)
        entries = list(self._slots)
        self._rendezvous(rank, name)  # nobody overwrites a slot before everyone has read it
        if len({n for n, _ in entries}) != 1:
            issued = ", ".join(f"rank {r} {n!r}" for r, (n, _) in enumerate(entries))
            raise CollectiveMismatch(f"ranks issued different collectives: {issued}")
        return [p for _, p in entries]

    def _rendezvous(self, rank: int, name: str) -> None:
        try:
            self._barrier.wait(None if math.isinf(self.timeout) else self.timeout)
        except threading.BrokenBarrierError:
            if self._failed.is_set():  # run() reports that rank's own error
                raise RuntimeError(f"rank {rank}: another rank failed during {name!r}") from None
            raise collective_timeout_error(name, rank, self.size, self.timeout) from None

    def run(self, fn: Callable[[int, "SimulatedChannel"], Any]) -> list[Any]:
        """Run ``fn(rank, channel)`` on every simulated rank; return the results by rank."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def worker(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.channel(rank))
            except BaseException as exc:  # surface the first failure, unblock the others
                errors.append(exc)
                if not isinstance(exc, TimeoutError):  # a timeout breaks the barrier already
                    self._failed.set()
                self._barrier.abort()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class SimulatedChannel(Channel):
    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    @property
    def timeout(self) -> float:
        return self.world.timeout

    def control_plane(self):
        """This rank's control plane in the same simulated world (the compressor asks its
        channel for one before falling back to MPI/Horovod)."""
        from .control import SimulatedControlPlane
        return SimulatedControlPlane(self.world, self.rank)

    # The simulation is synchronous: "async" records the call, wait() performs it, which keeps
    # the call order that the real channel has (issue, ..., wait).
    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        return ("allreduce", [t.clone() for t in tensors], name)

    def allgather_async(self, tensor: torch.Tensor, name: str):
        return ("allgather", tensor.clone(), name)

    def wait(self, handle):
        kind, payload, name = handle
        everyone = self.world.exchange(self.rank, kind, name, payload)
        if kind == "allgather":
            return torch.cat(everyone)
        # Sum in rank order, then divide: the same on every rank.
        return [torch.stack([ts[i] for ts in everyone]).sum(0) / self.size for i in range(len(payload))]
