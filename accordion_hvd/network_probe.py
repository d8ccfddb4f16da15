"""What the adapter measures for a network-aware policy (``Policy.uses_network``).

The regime controller asks it, at each window's end, for two things the policy's report
needs beyond gradient norms (policies/base.py: ``WindowReport.errors``, ``NetworkReport``):

* **level errors**: each compressed layer's window-mean gradient plus its error feedback,
  compressed at each of the codec's levels (``codec.level_errors``), on this rank; the
  controller averages them over ranks in the window's own control collective;
* **a step's shape**: when each layer's gradient was ready, timed at ``compress`` as
  backward produces it (seconds after the step's first compressed gradient, averaged over
  the window's steps, then over ranks in one control collective of ``layers + 3`` floats),
  the exchange's agreed buckets, what each layer costs on the wire at each level
  (``codec.wire``), and the link fitted to the window's own collectives
  (``AccordionCompressor.measure_link``: two small control collectives);
* **the step it got**: the median time between consecutive steps' ends over the window
  (mean over ranks, in the same collective as the ready times), which the policy compares
  between the windows of different levels (policies/network_aware.py, ``verify``).

Nothing here sends data-plane traffic. Every rank calls ``network`` at the same point (the
window's end), so the control collectives pair.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from .costmodel import Link
from .levels import DENSE, Level
from .policies.base import NetworkReport


class NetworkProbe:
    """Args:
        codec: the compressor's codec (``levels``, ``wire``, ``level_errors``).
        states: returns the compressor's dict of layer name -> codec state (read, never changed).
        buckets: returns the exchange's agreed buckets (tuples of layer names), or None
            before they are agreed.
        measure_link: returns the window's Link (or None); a control-plane collective.
        dense_level: the level a layer sent whole is measured and priced at (the policy's
            ``dense_level``: DENSE, or DENSE16 for float16).
    """

    def __init__(self, codec, states: Callable[[], dict[str, Any]], buckets: Callable[[], Any],
                 measure_link: Callable[[], Link | None], dense_level: Level = DENSE) -> None:
        self.codec, self.states = codec, states
        self._buckets, self._measure_link = buckets, measure_link
        # the codec's levels, with its whole-layer one sent as the policy asks (DENSE or DENSE16)
        self.levels: tuple[Level, ...] = tuple(dense_level if lv == DENSE else lv for lv in codec.levels)
        self._marks: dict[str, float] = {}   # this step: seconds after its first compressed gradient
        self._first: float | None = None
        self._ready: dict[str, float] = {}   # sums over the window's steps
        self._counts: dict[str, int] = {}
        self._backward = 0.0
        self._steps = 0
        self._last_end: float | None = None  # when the previous step ended
        self._periods: list[float] = []      # this window: seconds from one step's end to the next

    # --- per step (called by the adapter) --------------------------------------------------------
    def mark(self, name: str) -> None:
        """Layer ``name``'s gradient is ready now."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
        self._marks[name] = now - self._first

    def end_step(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._periods.append(now - self._last_end)
        self._last_end = now
        for name, seconds in self._marks.items():
            self._ready[name] = self._ready.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + 1
        if self._marks:
            self._backward += max(self._marks.values())
            self._steps += 1
        self._marks, self._first = {}, None

    def forget_step(self) -> None:
        """The step was abandoned (a world change): forget it, and time the next from its start."""
        self._marks, self._first, self._last_end = {}, None, None

    # --- per window (called by the controller) ---------------------------------------------------
    @torch.no_grad()
    def errors(self, layer: str, mean_grad: torch.Tensor | None) -> list[float]:
        """This rank's squared error of ``layer`` at each of ``levels`` (see module doc);
        ``mean_grad``: its window-mean gradient (flat), or None (no gradient this window)."""
        state = self.states()[layer]
        grad = torch.zeros(state.shape, dtype=state.residual.dtype, device=state.residual.device) \
            if mean_grad is None else mean_grad.reshape(state.shape)
        return self.codec.level_errors(state, grad, self.levels)

    def network(self, control, layers: list[str]) -> NetworkReport | None:
        """The window's NetworkReport, the same on every rank (two or three control
        collectives); None when the exchange has not agreed its buckets yet. Resets the
        window's timings."""
        local = [self._ready.get(n, 0.0) / self._counts[n] if self._counts.get(n) else 0.0 for n in layers]
        local.append(self._backward / self._steps if self._steps else 0.0)
        local.extend([float(np.median(self._periods)), 1.0] if self._periods else [0.0, 0.0])  # [median, measured]
        self._ready, self._counts, self._backward, self._steps, self._periods = {}, {}, 0.0, 0, []
        mean = np.asarray(control.allreduce(local, name=f"acc.ready.{len(layers)}.s", op="sum")) / control.size
        step = float(mean[-2]) if mean[-1] == 1.0 else None  # only if every rank measured its steps
        mean = mean[:-2]
        link = self._measure_link()
        buckets = self._buckets()
        if not buckets:
            return None
        states = self.states()
        wire = {n: {level: self.codec.wire(states[n].shape, level, states[n].residual.element_size())
                    for level in self.levels} for n in layers}
        return NetworkReport(link=link, world=control.size, backward_s=float(mean[-1]),
                             ready_s={n: float(v) for n, v in zip(layers, mean[:-1])},
                             buckets=tuple(tuple(b) for b in buckets), wire=wire, step_s=step)
