"""What both codecs share: argument checks, levels, the residual's dtype."""

from __future__ import annotations

import math
import numbers

import torch

NORMAL, CRITICAL = "normal", "critical"
LEVELS = (NORMAL, CRITICAL)


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    return level


def residual_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """Error feedback of 16-bit gradients is kept in float32, where small errors survive."""
    if not grad_dtype.is_floating_point:
        raise TypeError(f"gradients must be floating point, got {grad_dtype}")
    return torch.float32 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype


def positive_number(name: str, value, *, integer: bool = False, upper: float | None = None):
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__}")
    if not value > 0 or (upper is not None and value > upper) or value != value:
        bound = f"in (0, {upper}]" if upper is not None else "positive"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry is finite, from one float32 sum (non-finite entries make it NaN or
    Inf; about 10x cheaper than ``isfinite().all()``). A finite tensor whose sum overflows
    float32 counts as not finite: it would overflow the norms downstream anyway."""
    if t.numel() == 0:
        return True
    total = t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)
    return math.isfinite(total.item())
