"""LinkGate: send every layer whole in 16 bits where compression does not pay for itself,
and let the inner policy (Accordion) choose the codec's levels where it does.

Why: a user compresses to reach a model of the quality they need sooner. Compression costs
quality per step (error feedback recovers most of it, not all; measured: docs/design.md,
"Measured reasons"), so it pays only where it makes a step much shorter. On a fast link 16-bit
dense training is nearly as fast per step as any compressed method, and then compression can
only lose time to quality. This policy measures that on the job's own link and model, rather
than predicting it, the lesson of network_aware.py's verification (a prediction right about the
link can still be wrong about the machine):

1. **Window 1, compressed trial**: every layer at the codec's aggressive (normal) level, where
   Accordion keeps a layer most of the time. Its measured step (``NetworkReport.step_s``: the
   median time between steps' ends, mean over ranks) is the compressed step.
2. **Window 2, a short dense trial** (``trial_steps``, 8 by default, or the job's window if
   shorter): every layer at ``DENSE16`` (float16 through the front end's allreduce, its
   rounding kept in error feedback). Its measured step is the dense step. A few steps price
   it as well as a whole window (the median of their times) and cost a fraction of one where
   the link is slow, where a dense step is several compressed ones. Why measured, not priced
   from the link that the compressed window's collectives fit: a compressed message can fit
   in the sockets' buffers, its collective then completes once it is written there, and the
   fit reads the link many times faster than it is (docs/time-to-quality.md gives the run).
3. **The decision**, once, the same on every rank (the timings are reduced over ranks):
   compression pays when ``dense step > pays x compressed step``; then the inner policy
   decides every later window as it would alone. Otherwise every layer stays at
   ``DENSE16`` for the rest of training. A window without a measured step (some rank timed
   none) decides nothing: the trial is repeated at the next window.

``pays`` (default 1.25) is the time a compressed step must save to be worth its loss of
quality per step: with it, compression is kept only if it reaches the target in up to 1.25x
the dense run's steps and still arrives sooner. The inner policy sees every window's norms,
trial ones included, so its regime detection is current whenever it takes over.

Until 2026-12 the dense trial came first and lasted a whole window (the first window of
training is critical in Accordion's sense, and the gentlest level is what Accordion wants
there); evidence-v2 to -v4 scored that order. It made every slow-link job pay a window in 16
bits (issue 80's critical windows). A gate restored from such a state (phase "dense-trial",
no compressed step yet) finishes the old order.

The decision is not revisited (a network that changes during training is
network_aware.py's case). Rank 0 says it in one line with both timings, shown
by default like every level change (logger ``accordion_hvd.levels``: ``verdict()``,
engine/announce.py); ``stats()["gate"]`` holds it; it is kept in ``state_dict``, so a resumed
job does not run its trials again.
"""

from __future__ import annotations

import logging
import math

from ..levels import DENSE16, NORMAL, Level, positive_number
from .base import Policy, WindowReport

log = logging.getLogger("accordion_hvd.policies")

_DENSE_TRIAL, _COMPRESSED_TRIAL, _DENSE, _COMPRESSED = "dense-trial", "compressed-trial", "dense", "compressed"
_PHASES = (_DENSE_TRIAL, _COMPRESSED_TRIAL, _DENSE, _COMPRESSED)


class LinkGate(Policy):
    """Args:
        inner: the policy that chooses levels where compression pays (an ``Accordion`` or a
            ``Static``; not a per-step or network-aware one).
        pays: compression is kept only if the dense step is longer than this times the
            compressed step (1.25; above 1).
        trial_steps: steps of the dense trial (8; at least 3, for a median), or the job's
            window if it is shorter.
    """

    name = "link-gate"
    uses_network = True   # for the measured step of each window (NetworkReport.step_s)
    dense_level = DENSE16

    def __init__(self, inner: Policy, pays: float = 1.25, trial_steps: int = 8) -> None:
        if not isinstance(inner, Policy):
            raise TypeError(f"inner must be an accordion_hvd.policies.Policy, got {type(inner).__name__}")
        if inner.per_step or inner.uses_network:
            raise ValueError(f"inner must decide per window without the network (Accordion or Static), got {inner!r}")
        pays = float(positive_number("pays", pays))
        if pays <= 1.0:
            raise ValueError(f"pays must be a number > 1 (the factor a compressed step must be shorter by), got {pays}")
        trial_steps = positive_number("trial_steps", trial_steps, integer=True)
        if trial_steps < 3:
            raise ValueError(f"trial_steps must be an integer >= 3 (the dense step is their median), got {trial_steps}")
        self.inner, self.pays, self.trial_steps = inner, pays, trial_steps
        self.uses_norms = inner.uses_norms
        self.reacts_to_lr = inner.reacts_to_lr
        self.needs_two_levels = inner.needs_two_levels
        self.phase = _COMPRESSED_TRIAL
        self.dense_s: float | None = None
        self.compressed_s: float | None = None

    def __repr__(self) -> str:
        return f"LinkGate({self.inner!r}, pays={self.pays})"

    def config(self) -> dict:
        return {"policy": self.name, "pays": self.pays, "trial_steps": self.trial_steps, "inner": self.inner.config()}

    @property
    def compressing(self) -> bool:
        """Whether compression was found to pay: the layers follow the inner policy."""
        return self.phase == _COMPRESSED

    @property
    def settled_level(self) -> Level | None:
        """``DENSE16`` once compression was found not to pay: the decision is not revisited."""
        return DENSE16 if self.phase == _DENSE else None

    def _level(self, inner: Level) -> Level:
        return inner if self.compressing else NORMAL if self.phase == _COMPRESSED_TRIAL else DENSE16

    def initial_level(self, layer: str) -> Level:
        return self._level(self.inner.initial_level(layer))

    def window_steps(self, interval: int) -> int:
        return min(interval, self.trial_steps) if self.phase == _DENSE_TRIAL else interval

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        inner = self.inner.end_window(report)  # always: its regime detection stays current
        step = None if report.network is None else report.network.step_s
        measured = step is not None and math.isfinite(step) and step > 0
        if not measured and self.phase in (_DENSE_TRIAL, _COMPRESSED_TRIAL):
            log.info("link-gate: window of %d steps gave no measured step; its trial (%s) is repeated",
                     report.steps, self.phase)
        elif self.phase == _COMPRESSED_TRIAL:
            self.compressed_s = float(step)
            self._decide_or(_DENSE_TRIAL)
        elif self.phase == _DENSE_TRIAL:
            self.dense_s = float(step)
            self._decide_or(_COMPRESSED_TRIAL)  # a state saved when the dense trial came first
        return {layer: self._level(level) for layer, level in inner.items()}

    def _decide_or(self, trial: str) -> None:
        if self.dense_s is None or self.compressed_s is None:
            self.phase = trial
        else:
            self.phase = _COMPRESSED if self.dense_s > self.pays * self.compressed_s else _DENSE

    def verdict(self) -> dict:
        """``{"verdict", "dense_step_s", "compressed_step_s", "pays", "summary"}``: the
        verdict is "pending" during the trials, then "compress" or "dense16"; the summary is
        the one line rank 0 logs when it is taken."""
        verdict = {_COMPRESSED: "compress", _DENSE: "dense16"}.get(self.phase, "pending")
        if verdict == "pending":
            summary = f"link-gate: trials under way ({self.phase})"
        else:
            summary = (f"link-gate: a dense 16-bit step took {self.dense_s:.3f} s, a compressed one "
                       f"{self.compressed_s:.3f} s ({self.dense_s / self.compressed_s:.2f}x): " +
                       (f"compression pays (more than {self.pays}x), compressing from now on" if verdict == "compress"
                        else f"compression does not pay (at most {self.pays}x), every layer 16-bit dense from now on"))
        return {"verdict": verdict, "dense_step_s": self.dense_s, "compressed_step_s": self.compressed_s,
                "pays": self.pays, "summary": summary}

    def lr_decreased(self, layers: list[str]) -> dict[str, Level] | None:
        levels = self.inner.lr_decreased(layers)
        return levels if self.compressing else None

    def state_dict(self) -> dict:
        return {"phase": self.phase, "dense_s": self.dense_s, "compressed_s": self.compressed_s,
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("phase") not in _PHASES:
            raise ValueError(f"link-gate state: phase must be one of {_PHASES}, got {state.get('phase')!r}")
        self.phase = state["phase"]
        self.dense_s, self.compressed_s = state.get("dense_s"), state.get("compressed_s")
        self.inner.load_state_dict(state["inner"])
