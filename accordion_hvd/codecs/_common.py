"""What both codecs share: the residual's dtype, the finiteness check."""

from __future__ import annotations

import math

import torch


def residual_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """Error feedback of 16-bit gradients is kept in float32, where small errors survive."""
    if not grad_dtype.is_floating_point:
        raise TypeError(f"gradients must be floating point, got {grad_dtype}")
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry is finite, from one float32 sum (non-finite entries make it NaN or
    Inf; about 10x cheaper than ``isfinite().all()``). A finite tensor whose sum overflows
    float32 counts as not finite: it would overflow the norms downstream anyway."""
    if t.numel() == 0:
        return True
    total = t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)
    return math.isfinite(total.item())
