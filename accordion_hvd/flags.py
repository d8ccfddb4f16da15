"""Device-side fault flags: whether a gradient is finite, as a 0-d bool tensor that the host
never reads inside a step, and how codecs, exchanges and the step's fault handling combine
and act on them (on a GPU, reading a flag on the host would wait for the device)."""

from __future__ import annotations

import torch


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether every entry of ``t`` is finite, as a 0-d bool tensor on ``t``'s device: the host
    never reads it inside a step (on a GPU that would wait for the device); the codecs and
    exchanges mask with it instead. From one float32 sum (non-finite entries make it NaN or
    Inf; one pass, no boolean tensor, cheaper than ``isfinite().all()``; measured:
    docs/design.md, "Measured reasons"). A finite tensor whose sum overflows float32 counts as
    not finite: it would overflow the norms downstream anyway."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    total = t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)
    return (total - total) == 0  # NaN for Inf or NaN; one op fewer than isfinite, per layer per step


def nan_unless(finite: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` where ``finite`` (0-d bool) is True, else NaN everywhere: what a rank sends for a
    layer whose gradient is not finite, so that every rank sees the fault in the exchanged
    data. A new tensor; ``t`` is not changed."""
    return torch.where(finite, t, float("nan"))


def either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The device-side OR of two optional 0-d bool flags (None: no flag yet)."""
    return b if a is None else a if b is None else a | b
