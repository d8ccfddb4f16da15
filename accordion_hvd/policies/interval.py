"""How often to synchronise: Accordion's rule applied to DiLoCo's interval (``sync_every="auto"``).

Accordion (Agarwal et al., MLSys 2021) spends communication in the critical regimes of
training, where what a step leaves out is not recovered later, and saves it elsewhere. Per-step
compression chooses *how much* to send; local training with periodic synchronisation chooses
*how often*. This policy chooses the interval (inner steps per round) from a ladder, once per
window of ``window`` inner steps (the ladder's largest rung, which every rung divides, so a
window always ends on a round of any rung):

- **critical** (the first window, and the one after it, which has no earlier norm to compare
  with; a window in which the learning rate went down; a window
  whose model gradient norm moved by ``eta`` or more relative to the previous window's: the
  paper's test, on the whole model): the next window synchronises at the ladder's first rung;
- **normal** otherwise: one rung up the ladder, so the interval grows by the ladder's steps
  while training stays calm (as a congestion window does), and falls to the first rung at
  once when a regime starts.

With the default ladder (1, 4, 16, 64) the first rung is 1: in a critical window every inner
step is followed by a round, which averages the ranks' models every step (DiLoCo's round then
averages plainly, no outer momentum: accordion_hvd/diloco.py), the per-step path. The
compression level of each round is the compressor's own policy's, on its own windows of
rounds (docs/diloco.md says why: a round's pseudo-gradient is a layer like any gradient).

The report is the controller's ``WindowReport`` with one entry in ``norms`` (the model's
gradient norm over the window, the mean over ranks of each rank's squared norm, reduced by
the front end): the same numbers on every rank, hence the same interval.
"""

from __future__ import annotations

import logging
import math
import numbers

from ..levels import positive_number
from .base import WindowReport

log = logging.getLogger("accordion_hvd.policies")

LADDER = (1, 4, 16, 64)


class SyncInterval:
    """Args:
        ladder: the intervals it chooses from, increasing positive integers, each dividing
            the last (the window).
        eta: the threshold on the relative change of the window's gradient norm (paper: 0.5).
    """

    name = "accordion-interval"

    def __init__(self, ladder: tuple[int, ...] = LADDER, eta: float = 0.5) -> None:
        ladder = tuple(ladder) if isinstance(ladder, (tuple, list)) else ladder
        if (not isinstance(ladder, tuple) or not ladder
                or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1 for r in ladder)
                or list(ladder) != sorted(set(ladder)) or any(ladder[-1] % r for r in ladder)):
            raise ValueError(f"ladder must be increasing positive integers that each divide the last, "
                             f"such as {LADDER}; got {ladder!r}")
        self.ladder = tuple(int(r) for r in ladder)
        self.eta = float(positive_number("eta", eta))
        self.window = self.ladder[-1]  # inner steps per decision
        self.interval = self.ladder[0]  # the start is critical
        self.windows = 0
        self._prev: float | None = None

    def __repr__(self) -> str:
        return f"SyncInterval(ladder={self.ladder}, eta={self.eta})"

    def config(self) -> dict:
        return {"interval_policy": self.name, "ladder": list(self.ladder), "interval_eta": self.eta}

    def end_window(self, report: WindowReport) -> int:
        """The interval of the next window (see module doc)."""
        (norm,) = report.norms.values()
        self.windows += 1
        if not math.isfinite(norm):
            log.warning("SyncInterval: window of %d steps had a non-finite gradient norm; the first rung next",
                        report.steps)
            self.interval = self.ladder[0]
            return self.interval
        prev, self._prev = self._prev, norm
        critical = report.lr_decreased or prev is None or prev == 0 or abs(prev - norm) / prev >= self.eta
        if critical:
            self.interval = self.ladder[0]
        else:
            self.interval = self.ladder[min(self.ladder.index(self.interval) + 1, len(self.ladder) - 1)]
        return self.interval

    def state_dict(self) -> dict:
        return {"interval": self.interval, "windows": self.windows, "prev": self._prev}

    def load_state_dict(self, state: dict) -> None:
        if state["interval"] not in self.ladder:
            raise ValueError(f"SyncInterval: the saved interval {state['interval']} is not on this ladder "
                             f"{self.ladder}; resume with the ladder it was saved with")
        self.interval, self.windows = int(state["interval"]), int(state["windows"])
        self._prev = None if state["prev"] is None else float(state["prev"])
