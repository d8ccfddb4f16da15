"""One layer's PowerSGD state (powersgd.py), in a file of its own so that PowerSGD's parts
(powersgd_bucket.py, powersgd_cost.py) can name it without importing the codec."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..levels import Level


@dataclass
class PowerSGDState:
    """Everything one layer needs between steps (all of it goes into ``state_dict``)."""
    name: str
    shape: torch.Size
    level: Level
    rank: int                 # the rank in use, clamped to min(n, m)
    residual: torch.Tensor    # e, then M during a step; shape (n, m)
    q: torch.Tensor           # (m, rank), identical on all ranks; a view of contiguous Q^T
                              # (rank, m), the layout in which Q is computed and averaged
    p: torch.Tensor | None = None      # orthogonalized P, from ``middle`` to ``finish``
    factors: tuple[torch.Tensor, torch.Tensor] | None = None  # (P, Q^T) of M_hat, from ``finish`` to ``settle``
