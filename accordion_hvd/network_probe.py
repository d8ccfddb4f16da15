"""What the engine measures for a network-aware policy (``Policy.uses_network``).

The regime controller asks it, at each window's end, for two things the policy's report
needs beyond gradient norms (policies/base.py: ``WindowReport.errors``, ``NetworkReport``):

* **level errors**: each compressed layer's window-mean gradient plus its error feedback,
  compressed at each of the codec's levels (``codec.level_errors``), on this rank; the
  controller averages them over ranks in the window's own control collective;
* **a step's shape**: when each layer's gradient was ready, timed at ``compress`` as
  backward produces it (seconds after the step's first compressed gradient, less the
  compression math done in between, averaged over the window's steps, then over ranks in
  one control collective of ``layers + 4`` floats), the exchange's agreed buckets, what each
  layer costs on the wire at each level (``codec.wire``), and the link fitted to the
  window's own collectives (measured by the engine, ``measure_link``: two small control
  collectives; the engine hands the link and the buckets over with ``window`` before the
  window closes);
* **the math of each level**: the codec's work per layer and level (``codec.kernel_work``,
  a count of bytes and multiply-adds) at the rate this window's math ran (its measured
  compression seconds per step, mean over ranks, over the work of the levels it ran), so
  that the policy predicts a level's kernels as well as its transfers. The ready times
  leave the math out so that the model adds each candidate's own, not the current one's;
* **the step it got**: the median time between consecutive steps' ends over the window
  (mean over ranks, in the same collective as the ready times), which the policy compares
  between the windows of different levels (policies/network_aware.py, ``verify``).

Nothing here sends data-plane traffic. Every rank calls ``network`` at the same point (the
window's end), so the control collectives pair.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from .costmodel import Link
from .levels import DENSE, Level
from .policies.base import NetworkReport

log = logging.getLogger("accordion_hvd.policies")


class NetworkProbe:
    """Args:
        codec: the compressor's codec (``levels``, ``wire``, ``level_errors``).
        states: the engine's dict of layer name -> codec state (read, never changed; the
            engine changes it in place only, so this view stays current).
        dense_level: the level a layer sent whole is measured and priced at (the policy's
            ``dense_level``: DENSE, or DENSE16 for float16).
        seconds: the engine's seconds counters, read only: "compress" is its compression-math
            seconds so far (a running total); None: no math left out of the ready times, and
            none priced.

    The window's link and bucket layout are handed in by the engine (``window``) before the
    controller asks for the report: the probe calls nothing of the engine's.
    """

    def __init__(self, codec, states: dict[str, Any], dense_level: Level = DENSE,
                 seconds: dict[str, float] | None = None) -> None:
        self.codec, self.states = codec, states
        self._seconds = seconds
        self._link: Link | None = None           # this window's, from ``window``
        self._buckets: tuple = ()
        # the codec's levels, with its whole-layer one sent as the policy asks (DENSE or DENSE16)
        self.levels: tuple[Level, ...] = tuple(dense_level if lv == DENSE else lv for lv in codec.levels)
        self._marks: dict[str, float] = {}   # this step: seconds after its first compressed gradient
        self._first: float | None = None     # (less the math done since), and the clocks at it
        self._first_math = 0.0
        self._math, self._math_steps = 0.0, 0  # the window's math seconds (its steps' sum)
        self._math_mark: float | None = None  # the math clock at the previous step's end
        self._ready: dict[str, float] = {}   # sums over the window's steps
        self._counts: dict[str, int] = {}
        self._backward = 0.0
        self._steps = 0
        self._last_end: float | None = None  # when the previous step ended
        self._periods: list[float] = []      # this window: seconds from one step's end to the next

    # --- per step (called by the engine) --------------------------------------------------------
    def mark(self, name: str) -> None:
        """Layer ``name``'s gradient is ready now."""
        now, math_now = time.perf_counter(), self._math_now()
        if self._first is None:
            self._first, self._first_math = now, math_now
        self._marks[name] = (now - self._first) - (math_now - self._first_math)

    def end_step(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._periods.append(now - self._last_end)
        self._last_end = now
        math_now = self._math_now()
        if self._math_mark is not None and self._marks:
            self._math += math_now - self._math_mark
            self._math_steps += 1
        self._math_mark = math_now
        for name, seconds in self._marks.items():
            self._ready[name] = self._ready.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + 1
        if self._marks:
            self._backward += max(self._marks.values())
            self._steps += 1
        self._marks, self._first = {}, None

    def forget_step(self) -> None:
        """The step was abandoned (a world change): forget it, and time the next from its start."""
        self._marks, self._first, self._last_end, self._math_mark = {}, None, None, None

    def _math_now(self) -> float:
        return self._seconds["compress"] if self._seconds is not None else 0.0

    def window(self, link: Link | None, buckets) -> None:
        """The closing window's link (None if none was measured) and the exchange's agreed
        buckets (tuples of layer names; empty before they are agreed), the same on every rank."""
        self._link, self._buckets = link, tuple(tuple(b) for b in buckets)

    # --- per window (called by the controller) ---------------------------------------------------
    @torch.no_grad()
    def errors(self, layer: str, mean_grad: torch.Tensor | None) -> list[float]:
        """This rank's squared error of ``layer`` at each of ``levels`` (see module doc);
        ``mean_grad``: its window-mean gradient (flat), or None (no gradient this window)."""
        state = self.states[layer]
        grad = torch.zeros(state.shape, dtype=state.residual.dtype, device=state.residual.device) \
            if mean_grad is None else mean_grad.reshape(state.shape)
        return self.codec.level_errors(state, grad, self.levels)

    def network(self, control, layers: list[str]) -> NetworkReport | None:
        """The window's NetworkReport, the same on every rank (two or three control
        collectives); its ``buckets`` are empty while the exchange has agreed none. Resets
        the window's timings."""
        local = [self._ready.get(n, 0.0) / self._counts[n] if self._counts.get(n) else 0.0 for n in layers]
        local.append(self._backward / self._steps if self._steps else 0.0)
        local.extend([self._math / self._math_steps, 1.0] if self._math_steps else [0.0, 0.0])  # [math, measured]
        local.extend([float(np.median(self._periods)), 1.0] if self._periods else [0.0, 0.0])  # [median, measured]
        self._ready, self._counts, self._backward, self._steps, self._periods = {}, {}, 0.0, 0, []
        self._math, self._math_steps = 0.0, 0
        mean = np.asarray(control.allreduce(local, name=f"acc.ready.{len(layers)}.s", op="sum")) / control.size
        step = float(mean[-2]) if mean[-1] == 1.0 else None  # only if every rank measured its steps
        math_s = float(mean[-4]) if mean[-3] == 1.0 and self._seconds is not None else None
        mean = mean[:-4]
        link, buckets, self._link, self._buckets = self._link, self._buckets, None, ()
        # No buckets yet (the exchange has issued none: every layer went whole so far, as in
        # the link gate's dense trial with a single-level codec) still reports the measured step;
        # a policy that predicts from buckets finds them empty and says so.
        states = self.states
        wire = {n: {level: self.codec.wire(states[n].shape, level, states[n].residual.element_size())
                    for level in self.levels} for n in layers}
        return NetworkReport(link=link, world=control.size, backward_s=float(mean[-1]),
                             ready_s={n: float(v) for n, v in zip(layers, mean[:-1])},
                             buckets=buckets, wire=wire, step_s=step,
                             kernel_s=self._kernel_seconds(states, layers, math_s))

    def _kernel_seconds(self, states: dict[str, Any], layers: list[str], math_s: float | None) -> dict:
        """Per layer and level, the seconds of its math before each round and to finish: the
        codec's work at the rate the window's levels ran (``math_s`` per step over their
        work). Empty, and the math left out of the prediction, when the rate is unknown."""
        if math_s is None:
            return {}

        def work(n: str, level: Level) -> tuple[float, ...]:
            return self.codec.kernel_work(states[n].shape, level, states[n].residual.element_size())

        ran = sum(sum(work(n, states[n].level)) for n in layers)
        if not (math.isfinite(math_s) and math_s >= 0 and ran > 0):
            log.warning("NetworkAware: this window's math (%r s per step) gives no rate; kernels left out "
                        "of the prediction", math_s)
            return {}
        rate = math_s / ran
        return {n: {level: tuple(w * rate for w in work(n, level)) for level in self.levels} for n in layers}
