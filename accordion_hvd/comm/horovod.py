"""The real data plane: Horovod's named asynchronous collectives (Gloo, MPI or NCCL).

Also the fix for a cost of Horovod itself: ``hvd.synchronize`` (Horovod 0.28.1, PyTorch)
busy-waits, burning a whole core for as long as the collective takes (measured: 0.50 s of
CPU in a 0.51 s wait for a late rank). ``DistributedOptimizer.synchronize()`` waits on every
gradient's handle that way. On a machine whose cores are shared (several workers per node,
data-loader processes, the emulated cluster) a rank that waits steals the CPU that the
ranks it waits for need to finish their backward pass, so every step is slower.
``install_polite_wait()`` makes the optimizer poll with growing sleeps instead (``poll_until``:
at most 1 ms late); results and errors are Horovod's own.
"""

from __future__ import annotations

import logging
import os

import torch

from .channel import collective_timeout, poll_until, wait_for

WAIT_ENV = "ACCORDION_HOROVOD_WAIT"  # "poll" (default) or "spin" (leave Horovod as it is)

log = logging.getLogger("accordion_hvd.comm")


def polite_synchronize(handle):
    """``hvd.synchronize(handle)``, sleeping between polls instead of spinning."""
    import horovod.torch as hvd

    try:
        poll_until(lambda: hvd.poll(handle))
    except (RuntimeError, ValueError):  # not a live handle: Horovod's synchronize says what it is
        pass
    return hvd.synchronize(handle)


def install_polite_wait() -> bool:
    """Make ``hvd.DistributedOptimizer`` wait on its collectives with ``polite_synchronize``
    (idempotent). Skipped when $ACCORDION_HOROVOD_WAIT is "spin". Returns whether it is on."""
    mode = os.environ.get(WAIT_ENV, "poll").strip().lower() or "poll"
    if mode not in ("poll", "spin"):
        raise ValueError(f"{WAIT_ENV} must be 'poll' or 'spin', got {mode!r}")
    import horovod.torch.optimizer as hvd_optimizer

    if mode == "spin":
        return False
    if hvd_optimizer.synchronize is not polite_synchronize:
        hvd_optimizer.synchronize = polite_synchronize
        log.info("Horovod's DistributedOptimizer now sleeps between polls while it waits for a collective "
                 "instead of spinning (set %s=spin to keep Horovod's busy wait)", WAIT_ENV)
    return True


class HorovodChannel:
    """Horovod's collectives, with a timeout on every wait.

    Args:
        timeout: seconds a collective may take before ``wait`` raises ``TimeoutError``;
            default $ACCORDION_COLLECTIVE_TIMEOUT, else 300. ``hvd.synchronize`` would block
            forever on a collective that another rank never submits.
    """

    def __init__(self, timeout: float | None = None) -> None:
        import horovod.torch as hvd  # imported here: the math and the tests need no Horovod

        self._hvd = hvd
        install_polite_wait()
        self.timeout = collective_timeout(timeout)
        self._names: dict[int, str] = {}  # handle -> collective name, until waited on

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def size(self) -> int:
        return self._hvd.size()

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        # One grouped collective: Horovod negotiates and fuses the group as a unit.
        handle = self._hvd.grouped_allreduce_async(tensors, op=self._hvd.Average, name=name)
        self._names[handle] = name
        return handle

    def allgather_async(self, tensor: torch.Tensor, name: str):
        handle = self._hvd.allgather_async(tensor, name=name)
        self._names[handle] = name
        return handle

    def forget_handles(self) -> None:
        """Horovod Elastic re-formed the world: handles in flight will never complete."""
        self._names.clear()

    def wait(self, handle):
        name = self._names.pop(handle, "<unnamed>")
        wait_for(lambda: self._hvd.poll(handle), name, self.rank, self.size, self.timeout)
        return self._hvd.synchronize(handle)
