"""The tensors a round of the periodic wing works on: this rank's part of a parameter (its
shard under FSDP2), a model swapped in while a block runs (``DiLoCo.synced``), and a norm."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def swapped_in(params: list[torch.Tensor], values: list[torch.Tensor]):
    """``values`` in the parameters while the block runs; the parameters' own after it."""
    own = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, value in zip(params, values):
            p.copy_(value.view_as(p))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, mine in zip(params, own):
                p.copy_(mine)


def norm_of(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of the tensors together (one host sync)."""
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if it is a DTensor (FSDP2), else itself.
    Writes into it land in the parameter."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
