"""The real data plane: Horovod's named asynchronous collectives (Gloo, MPI or NCCL)."""

from __future__ import annotations

import torch

from .channel import collective_timeout, wait_for


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
