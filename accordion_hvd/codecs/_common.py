"""What both codecs share: the residual's dtype, how a layer sent whole is settled. (The
device-side fault flags every layer uses are in accordion_hvd/flags.py.)"""

from __future__ import annotations

import math

import torch

from .. import ops
from ..levels import DENSE16, Level


def residual_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """Error feedback of 16-bit gradients is kept in float32, where small errors survive."""
    if not grad_dtype.is_floating_point:
        raise TypeError(f"gradients must be floating point, got {grad_dtype}")
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


def wire_dtype(level: Level, grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer sent whole travels in: float16 at ``DENSE16`` (unless the gradient is
    16-bit already), else the gradient's own."""
    if level == DENSE16 and torch.finfo(grad_dtype).bits > 16:
        return torch.float16
    return grad_dtype


def _fused(e: torch.Tensor) -> bool:
    """Whether the one-pass kernels serve this error feedback: float32 (that of every 16-bit
    and float32 gradient), contiguous, on a device with kernels; float64 takes torch's ops."""
    return e.dtype == torch.float32 and e.is_contiguous() and ops.has_kernel(e)


def flush_whole(e: torch.Tensor, grad: torch.Tensor, level: Level, finite: torch.Tensor) -> torch.Tensor:
    """A layer sent whole this step (a dense level): g = grad + e, kept in ``e`` until
    ``settle_sent`` (so that a skipped step can keep it; not added if ``finite`` is False),
    returned in the level's wire dtype as a new tensor (the front end averages it in place),
    NaN if not finite, shaped like ``grad``."""
    dtype = wire_dtype(level, grad.dtype)
    if _fused(e):  # one pass (accordion::flush_whole)
        return ops.flush_whole(grad.reshape(e.shape), e, dtype, finite).view(grad.shape)
    return flush_whole_in_torch(e, grad.reshape(e.shape), dtype, finite).view(grad.shape)


def flush_whole_in_torch(e: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, finite: torch.Tensor) -> torch.Tensor:
    """``flush_whole`` in torch's ops (three passes), for error feedback the kernel does not
    take (float64); ``grad`` shaped like ``e``."""
    ops.ef_add_(grad, e, finite)
    out = e.to(dtype, copy=True)
    ops.fill_if_([out], ~finite, float("nan"))
    return out


def settle_sent(e: torch.Tensor, sent_dtype: torch.dtype, done: torch.Tensor) -> None:
    """After a step that sent ``e`` (which held all of ``g = grad + e``) whole in
    ``sent_dtype``: if it went through (``done``, 0-d bool), ``e`` keeps only what that dtype
    rounded away; if it was skipped, all of it. Decided on the device."""
    if _fused(e):  # one pass (accordion::settle_sent_)
        ops.settle_sent_(e, sent_dtype, done)
    else:
        settle_sent_in_torch(e, sent_dtype, done)


def settle_sent_in_torch(e: torch.Tensor, sent_dtype: torch.dtype, done: torch.Tensor) -> None:
    """``settle_sent`` in torch's ops, for error feedback the kernel does not take (float64)."""
    if sent_dtype == e.dtype:
        ops.fill_if_([e], done)
    else:
        sent = e.to(sent_dtype).to(e.dtype)
        ops.fill_if_([sent], ~done)  # a skipped step sent nothing
        e.sub_(sent)


def rounding_error(g: torch.Tensor, dtype: torch.dtype) -> float:
    """``||g - round(g)||^2`` for ``g`` sent in ``dtype`` (0 when it is ``g``'s own), in float64;
    infinite when ``g`` does not fit in ``dtype`` (float16 ends at 65504): the level cannot
    carry the layer."""
    if dtype == g.dtype:
        return 0.0
    if g.numel() and float(g.abs().max()) > torch.finfo(dtype).max:
        return math.inf
    return float((g - g.to(dtype).to(g.dtype)).square().sum(dtype=torch.float64))


def whole_layer_work(numel: int, level: Level, itemsize: int) -> tuple[float, float]:
    """A layer sent whole, in ``kernel_work``'s units: g = grad + e (3 passes; at DENSE16 its
    float16 copy, half a pass more), then the average into the result and e settled (3)."""
    extra = 0.5 * numel * itemsize if level == DENSE16 else 0.0
    return 3.0 * numel * itemsize + extra, 3.0 * numel * itemsize + extra
