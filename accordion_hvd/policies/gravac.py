"""GraVAC (Tyagi & Swany, IEEE CLOUD 2023, arXiv 2305.12201): the compression factor chosen
by the gain it keeps, searched while training runs. Followed from the paper, not its code.

The compression gain of a step is ||C(g_ef)||^2 / ||g_ef||^2, with g_ef the gradient plus
error feedback (for TopK both squared norms come out of the fused kernel), smoothed by an
exponentially weighted moving average. Every step two factors are tried: the candidate
factor c and the minimum factor c_min. The step sends C_c(g_ef) if c's gain is at least
epsilon, else C_cmin(g_ef) if that one's is, else g_ef dense, resetting the error feedback.
Every ``window`` steps the candidate's *compression throughput* (training throughput over
the window times its gain) is recorded and the candidate grows (exponentially: x2; or
geometrically: + c_min), capped at ``max_factor``; the search stops when the best two
compression throughputs seen are within ``omega`` of each other, and keeps the lower factor
of the two.

The gains are the whole model's, summed over every layer and every rank before the rule
runs, so all ranks choose alike. One model-wide factor, as in the paper.

GraVAC is a per-step policy (policies/base.py): each step it asks for the gains of
``Level.factor(candidate)`` and ``Level.factor(min_factor)`` (``step_levels``), and the
controller hands them back, reduced over ranks, in a ``StepReport`` (``choose_step``).
"""

from __future__ import annotations

import math

from ..levels import DENSE, Level, positive_number
from .base import Policy, StepReport

# What a step may choose (then mapped to a level: DENSE_CHOICE sends every layer at level DENSE).
CANDIDATE, MINIMUM, DENSE_CHOICE = "candidate", "minimum", "dense"


class GraVAC(Policy):
    """Args:
        min_factor, max_factor: compression factors searched (paper: 10x to 1000x).
        window: steps between candidate growths (paper: 500).
        epsilon: the gain a factor must keep to be used (paper: 0.7 or 0.9).
        omega: the search stops when the best two compression throughputs are this close.
        growth: "exponential" (x2 per window) or "geometric" (+ min_factor per window).
        smoothing: EWMA weight of the past in the gains (0: no smoothing).
    """

    name = "gravac"
    uses_norms = False
    reacts_to_lr = False
    per_step = True

    def __init__(self, min_factor: float = 10.0, max_factor: float = 1000.0, *, window: int = 500,
                 epsilon: float = 0.7, omega: float = 0.01, growth: str = "exponential",
                 smoothing: float = 0.9) -> None:
        self.min_factor = float(positive_number("min_factor", min_factor))
        self.max_factor = float(positive_number("max_factor", max_factor))
        if self.min_factor < 1 or self.max_factor < self.min_factor:
            raise ValueError(f"need 1 <= min_factor <= max_factor, got min_factor={min_factor}, "
                             f"max_factor={max_factor}")
        self.window = positive_number("window", window, integer=True)
        self.epsilon = float(positive_number("epsilon", epsilon, upper=1.0))
        self.omega = float(positive_number("omega", omega))
        if growth not in ("exponential", "geometric"):
            raise ValueError(f"growth must be 'exponential' or 'geometric', got {growth!r}")
        self.growth = growth
        if isinstance(smoothing, bool) or not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.candidate = self.min_factor
        self.searching = True
        self.gains = {CANDIDATE: None, MINIMUM: None}  # EWMA of each tried factor's gain
        self.history: list[tuple[float, float]] = []   # (factor, compression throughput) per window
        self._window_steps = 0
        self._window_seconds = 0.0

    def __repr__(self) -> str:
        return (f"GraVAC(min_factor={self.min_factor:g}, max_factor={self.max_factor:g}, window={self.window}, "
                f"epsilon={self.epsilon})")

    def config(self) -> dict:
        return {"policy": self.name, "min_factor": self.min_factor, "max_factor": self.max_factor,
                "window": self.window, "epsilon": self.epsilon, "omega": self.omega, "growth": self.growth,
                "smoothing": self.smoothing}

    def initial_level(self, layer: str) -> Level:
        return Level.factor(self.min_factor)

    def end_window(self, report) -> dict[str, Level]:
        return {}  # GraVAC decides every step (``choose_step``), not at detection windows

    def step_levels(self) -> tuple[Level, Level]:
        """The candidate factor and the minimum one, whose gains each step's choice needs."""
        return Level.factor(self.candidate), Level.factor(self.min_factor)

    def choose_step(self, report: StepReport) -> Level:
        """This step's level from the gains of ``step_levels()`` (then the step counts
        towards the candidate's window, with the step's time)."""
        candidate, minimum = report.levels
        choice = self.choose(*report.gains)
        self.end_step(report.seconds)
        return {CANDIDATE: candidate, MINIMUM: minimum, DENSE_CHOICE: DENSE}[choice]

    def factors(self) -> tuple[float, float]:
        """The (candidate, minimum) factors to try this step."""
        return self.candidate, self.min_factor

    def choose(self, gain_candidate: float, gain_minimum: float) -> str:
        """This step's choice from the two factors' gains (already summed over the model and
        all ranks): CANDIDATE, MINIMUM or DENSE_CHOICE. Non-finite gains send dense (and so reset
        the error feedback) without entering the averages."""
        if not (math.isfinite(gain_candidate) and math.isfinite(gain_minimum)):
            return DENSE_CHOICE
        for key, gain in ((CANDIDATE, gain_candidate), (MINIMUM, gain_minimum)):
            old = self.gains[key]
            self.gains[key] = gain if old is None else self.smoothing * old + (1 - self.smoothing) * gain
        if self.gains[CANDIDATE] >= self.epsilon:
            return CANDIDATE
        if self.gains[MINIMUM] >= self.epsilon:
            return MINIMUM
        return DENSE_CHOICE

    def end_step(self, seconds: float, samples: float = 1.0) -> None:
        """After each step with its wall time (the same number on every rank: the caller
        averages it over ranks): every ``window`` steps, score the candidate (throughput x
        gain) and grow it, until the stop rule holds."""
        self._window_steps += 1
        self._window_seconds += seconds
        if self._window_steps < self.window:
            return
        throughput = samples * self._window_steps / max(self._window_seconds, 1e-12)
        self._window_steps, self._window_seconds = 0, 0.0
        if not self.searching:
            return
        self.history.append((self.candidate, throughput * (self.gains[CANDIDATE] or 0.0)))
        best = sorted(self.history, key=lambda h: h[1], reverse=True)[:2]
        if len(best) == 2 and abs(best[0][1] - best[1][1]) <= self.omega * max(best[0][1], 1e-300):
            self.candidate = min(best[0][0], best[1][0])
            self.searching = False
            return
        grown = self.candidate * 2 if self.growth == "exponential" else self.candidate + self.min_factor
        if grown > self.max_factor:  # searched everything: keep the best seen
            self.candidate = best[0][0]
            self.searching = False
        else:
            self.candidate = grown
        self.gains[CANDIDATE] = None  # a new factor starts its own average

    def state_dict(self) -> dict:
        return {"candidate": self.candidate, "searching": self.searching, "gains": dict(self.gains),
                "history": list(self.history), "window_steps": self._window_steps,
                "window_seconds": self._window_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.candidate = float(state["candidate"])
        self.searching = bool(state["searching"])
        self.gains = dict(state["gains"])
        self.history = [tuple(h) for h in state["history"]]
        self._window_steps = int(state["window_steps"])
        self._window_seconds = float(state["window_seconds"])
