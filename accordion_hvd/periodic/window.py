"""The statistics ``acc.SyncInterval`` decides on (``IntervalReport``), measured for it
(``WindowStatistic``, which the policy owns: ``SyncInterval.watch``) over one window of the
inner steps ``acc.DiLoCo`` reports, and reduced across ranks once per window, so that every
rank chooses the same interval."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class IntervalReport:
    """One window of inner steps, the same on every rank.

    norm: the model's gradient norm over the window (the square root of the mean over its
        steps and over ranks of each rank's squared gradient norm).
    steps: inner steps in the window.
    lr_decreased: whether the inner optimizer's learning rate went down in the window.
    step_s: an inner step's wall time, rounds excluded (median over the window, mean over
        ranks); None if not measured.
    round_s: a round's wall time (mean over the window's rounds and over ranks); None if no
        round was measured.
    """
    norm: float
    steps: int
    lr_decreased: bool = False
    step_s: float | None = None
    round_s: float | None = None


class WindowStatistic:
    """The interval policy's statistics over one window (module doc): this rank's squared
    gradient norm summed over the window's inner steps on the device, whether the inner
    optimizer's learning rate went down, and the wall time of each inner step (from the end
    of one ``step()`` call to the start of the next: the user's forward, backward and
    optimizer step) and of each round; reduced across ranks once per window."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.lr = self._lr()
        self.ended: float | None = None  # when the last step() returned
        self._reset()

    def _reset(self) -> None:
        self.sum_sq: torch.Tensor | float = 0.0
        self.steps = 0
        self.lr_decreased = False
        self.step_s: list[float] = []
        self.round_s: list[float] = []

    def _lr(self) -> float:
        return min(float(group["lr"]) for group in self.optimizer.param_groups)

    @torch.no_grad()
    def observe(self, now: float, grads: list[torch.Tensor]) -> None:
        """An inner step began its ``step()`` call at ``now``, with this rank's ``grads``."""
        if grads:
            self.sum_sq = self.sum_sq + torch.stack(torch._foreach_norm(grads)).float().square().sum()
        self.steps += 1
        lr = self._lr()
        self.lr_decreased |= lr < self.lr
        self.lr = lr
        if self.ended is not None:  # (an evaluation between two steps is an outlier the median ignores)
            self.step_s.append(now - self.ended)

    def round_took(self, seconds: float) -> None:
        self.round_s.append(seconds)

    def step_ended(self) -> None:
        self.ended = time.perf_counter()

    def report(self, control, size: int) -> IntervalReport:
        """The window's report, the same on every rank (one control collective); resets."""
        step_s = statistics.median(self.step_s) if self.step_s else 0.0
        round_s = statistics.fmean(self.round_s) if self.round_s else 0.0
        mine = np.array([float(self.sum_sq) / max(self.steps, 1), float(self.lr_decreased),
                         step_s, float(bool(self.step_s)), round_s, float(bool(self.round_s))])
        total = control.allreduce(mine, "acc.diloco.window", op="sum")
        norm = math.sqrt(total[0] / size) if math.isfinite(total[0]) else math.nan
        report = IntervalReport(norm=norm, steps=self.steps, lr_decreased=bool(total[1] > 0),
                                step_s=total[2] / size if total[3] == size else None,
                                round_s=total[4] / size if total[5] == size else None)
        self._reset()
        return report

    def state_dict(self) -> dict:
        return {"sum_sq": float(self.sum_sq), "steps": self.steps, "lr": self.lr, "lr_decreased": self.lr_decreased,
                "step_s": list(self.step_s), "round_s": list(self.round_s)}

    def load_state_dict(self, state: dict) -> None:
        self.sum_sq, self.steps = state["sum_sq"], state["steps"]
        self.lr, self.lr_decreased = state["lr"], state["lr_decreased"]
        self.step_s, self.round_s = list(state["step_s"]), list(state["round_s"])
