"""The real data plane: Horovod's named asynchronous collectives (Gloo, MPI or NCCL)."""

from __future__ import annotations

import torch


class HorovodChannel:
    def __init__(self) -> None:
        import horovod.torch as hvd  # imported here: the math and the tests need no Horovod

        self._hvd = hvd

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def size(self) -> int:
        return self._hvd.size()

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        # One grouped collective: Horovod negotiates and fuses the group as a unit.
        return self._hvd.grouped_allreduce_async(tensors, op=self._hvd.Average, name=name)

    def allgather_async(self, tensor: torch.Tensor, name: str):
        return self._hvd.allgather_async(tensor, name=name)

    def wait(self, handle):
        return self._hvd.synchronize(handle)
