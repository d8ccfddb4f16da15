"""Python entry points of the compiled ``accordion::`` torch ops.

The ops are registered by the extension (``csrc/``); this module gives them documented
Python signatures and the fake (meta) implementations that ``torch.compile`` and
``torch.library.opcheck`` need.
"""

from __future__ import annotations

import torch

from . import _extension

_extension.load()  # registers torch.ops.accordion.*


def ef_add(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Return ``grad + residual`` in the residual's dtype (see ``reference.ef_add``)."""
    return torch.ops.accordion.ef_add.default(grad, residual)


def ef_add_(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """In place: ``residual += grad``; returns ``residual``."""
    torch.ops.accordion.ef_add_.default(grad, residual)
    return residual


@torch.library.register_fake("accordion::ef_add")
def _ef_add_fake(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    torch._check(grad.shape == residual.shape, lambda: "accordion::ef_add: shapes differ")
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.register_fake("accordion::ef_add_")
def _ef_add_inplace_fake(grad: torch.Tensor, residual: torch.Tensor) -> None:
    torch._check(grad.shape == residual.shape, lambda: "accordion::ef_add_: shapes differ")
