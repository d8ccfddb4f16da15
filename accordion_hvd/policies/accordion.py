"""The Accordion rule (Agarwal et al., MLSys 2021): gentle compression in critical regimes.

At the end of every detection window, each layer's gradient norm over the window is compared
with its norm over the previous window; the layer is in a critical regime (and gets the
codec's gentle "critical" level for the next window) when

    |prev - new| / prev >= eta

and in a normal regime (aggressive level) otherwise. A layer's first window is critical, and
so is the window after it (there is nothing to compare with yet; prev == 0 counts as
critical too). When the learning rate goes down, every layer is critical until the next
detection point, as in the paper.

``low_rate`` (off by default, as in the paper): while the learning rate is at or below
``low_rate`` times the highest it has been, every layer stays critical. The hypothesis: after
a decay the updates are small and what the aggressive level leaves out of each gradient is
what is left to learn. It gave the same validation curve as the paper's rule, at longer steps
(measured: docs/design.md, "Measured reasons"), so the library's default does not use it. The
fraction is the controller's (``WindowReport.lr_fraction``), the same on every rank.

A window whose norms are not all finite (a NaN or Inf gradient on some rank) is skipped with
a warning: levels and the reference norms stay as they were, so one bad step can neither
flip every layer nor poison the next comparison. Every rank sees the same reduced norms, so
every rank skips alike.
"""

from __future__ import annotations

import logging
import math

from ..levels import CRITICAL, NORMAL, Level, positive_number
from .base import Policy, WindowReport

log = logging.getLogger("accordion_hvd.policies")


class Accordion(Policy):
    """Args:
        eta: threshold on the relative change of a layer's window norm (paper: 0.5).
        low_rate: every layer is critical while the learning rate is at or below this
            fraction of its peak so far (None: the paper's rule alone).
    """

    name = "accordion"
    needs_two_levels = True

    def __init__(self, eta: float = 0.5, low_rate: float | None = None) -> None:
        self.eta = float(positive_number("eta", eta))
        if low_rate is not None and not (isinstance(low_rate, (int, float)) and not isinstance(low_rate, bool)
                                         and 0 < low_rate < 1):
            raise ValueError(f"low_rate must be None or a number in (0, 1) (a fraction of the peak learning "
                             f"rate), got {low_rate!r}")
        self.low_rate = None if low_rate is None else float(low_rate)
        self._prev: dict[str, float] = {}    # each layer's norm over the last window
        self._levels: dict[str, Level] = {}    # each layer's level from the last decision

    def __repr__(self) -> str:
        return f"Accordion(eta={self.eta})" if self.low_rate is None else \
            f"Accordion(eta={self.eta}, low_rate={self.low_rate})"

    def config(self) -> dict:
        return {"policy": self.name, "eta": self.eta, **({} if self.low_rate is None else {"low_rate": self.low_rate})}

    def initial_level(self, layer: str) -> Level:
        return CRITICAL

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        bad = sorted(layer for layer, norm in report.norms.items() if not math.isfinite(norm))
        if bad:
            log.warning("Accordion: window of %d steps skipped, non-finite gradient norm in %s; levels unchanged",
                        report.steps, ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
            return {layer: self._levels.get(layer, CRITICAL) for layer in report.norms}
        low = (self.low_rate is not None and report.lr_fraction is not None
               and report.lr_fraction <= self.low_rate * (1 + 1e-9))  # x0.1 of the peak is "at" 0.1
        for layer, new in report.norms.items():
            prev = self._prev.get(layer)
            critical = low or prev is None or prev == 0 or abs(prev - new) / prev >= self.eta
            self._levels[layer] = CRITICAL if critical else NORMAL
            self._prev[layer] = new
        return {layer: self._levels[layer] for layer in report.norms}

    def lr_decreased(self, layers: list[str]) -> dict[str, Level]:
        return {layer: CRITICAL for layer in layers}

    def state_dict(self) -> dict:
        return {"prev": dict(self._prev), "levels": {k: v.to_state() for k, v in self._levels.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._prev = {str(k): float(v) for k, v in state["prev"].items()}
        self._levels = {str(k): Level.from_state(v) for k, v in state["levels"].items()}
