"""Python entry points of the compiled ``accordion::`` torch ops.

The ops are registered by the extension (``csrc/``); this module gives them documented
Python signatures and the fake (meta) implementations that ``torch.compile`` and
``torch.library.opcheck`` need.
"""

from __future__ import annotations

import torch

from . import _extension

_extension.load()  # registers torch.ops.accordion.*


def _check_dense_pair(op: str, grad: torch.Tensor, residual: torch.Tensor) -> None:
    """Checks the dispatcher would turn into an unreadable "no kernel for backend" error.

    The kernels check everything else (shape, dtype, contiguity) with their own messages.
    """
    for name, t in (("grad", grad), ("residual", residual)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if grad.device != residual.device:
        raise ValueError(f"{op}: grad and residual must be on the same device, got {grad.device} and {residual.device}")


def ef_add(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Return ``grad + residual`` in the residual's dtype (see ``reference.ef_add``)."""
    _check_dense_pair("accordion::ef_add", grad, residual)
    return torch.ops.accordion.ef_add.default(grad, residual)


def ef_add_(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """In place: ``residual += grad``; returns ``residual``."""
    _check_dense_pair("accordion::ef_add_", grad, residual)
    torch.ops.accordion.ef_add_.default(grad, residual)
    return residual


@torch.library.register_fake("accordion::ef_add")
def _ef_add_fake(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    torch._check(grad.shape == residual.shape, lambda: "accordion::ef_add: shapes differ")
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("accordion::ef_add_")
def _ef_add_inplace_fake(grad: torch.Tensor, residual: torch.Tensor) -> None:
    torch._check(grad.shape == residual.shape, lambda: "accordion::ef_add_: shapes differ")
