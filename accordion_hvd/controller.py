"""The regime controller: gathers what a level decision needs, identically on every rank.

Between the compressor (which sees each layer's raw local gradient) and the policy (pure
decision logic), the controller

* accumulates each compressed layer's raw local gradient over the detection window (one
  float32 buffer per compressed layer, the size of the layer: the memory cost of
  detection), or, with ``accumulate=False``, only each step's squared norm (no buffer);
  the window's measure is the norm of the *mean* gradient over the window (or the root mean
  square of the step norms), so windows of different lengths (epochs of another size, or
  another batch size) still compare like for like;
* ends a window every ``interval`` optimizer steps (fewer where the policy asks for a short
  one: ``Policy.window_steps``), or at ``epoch_end()`` when ``interval`` is None;
* reduces the inputs of every decision over the control plane (MPI when its world is
  Horovod's, else Horovod's own collectives): the window norms (mean over ranks of each
  rank's local norm) and, every step, the learning rates (minimum and maximum over ranks:
  they must agree, and a decrease is seen by all ranks in the same step);
* hands the policy those reduced numbers and returns its levels to the compressor;
* for a network-aware policy (``policy.uses_network``), adds what predicts a step (the
  engine's ``probe``: a ``NetworkReport``) and, only if the policy asks for them, each
  layer's error at each of the codec's levels on its window-mean gradient plus error
  feedback, averaged over ranks in a collective of their own;
* for a per-step policy (``policy.per_step``: GraVAC), reduces each step's compression gains
  and step time over the control plane and hands them to the policy in a ``StepReport``
  (``choose_step``): the policy's choice applies to that very step.

Every rank runs the same deterministic rule on the same reduced numbers, so all ranks switch
levels in the same step; a rank-dependent local norm cannot make them disagree.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import zlib
from typing import Any

import numpy as np
import torch

from . import ops
from .levels import Level, positive_number
from .policies import Policy, StepReport, WindowReport

log = logging.getLogger("accordion_hvd.controller")


class RegimeController:
    def __init__(self, policy: Policy, interval: int | None, *, accumulate: bool = True) -> None:
        self.policy = policy
        self.interval = None if interval is None else positive_number("interval", interval, integer=True)
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
        self.accumulate = accumulate
        self.levels: dict[str, Level] = {}         # the level each layer uses now
        self._sums: dict[str, torch.Tensor] = {}   # accumulate=True: sum of raw gradients
        # Floats, or 0-d tensors on the gradients' device: a step adds to them without the host
        # reading anything; the window's end reads them all at once.
        self._sq: dict[str, float | torch.Tensor] = {}      # accumulate=False: sum of squared norms
        self._weight: dict[str, float | torch.Tensor] = {}  # what the sums above are sums of (steps)
        self._window_steps = 0
        self._lrs: list[float] | None = None       # learning rates agreed at the last step
        self._lr_peak: list[float] | None = None   # the highest each has been
        self.windows = 0                           # detection points so far
        self._seen: set[str] = set()               # layers with a nonzero window norm (on some rank) so far
        self._known: set[str] = set()              # layers of the last window whose norms were measured
        self._warned_epoch_end = False
        self._last_step: float | None = None       # per-step policies: when the last step chose
        self.probe = None  # a network-aware policy's measurements, set by the engine (network_probe.py)

    def config(self) -> dict:
        return {**self.policy.config(), "interval": self.interval, "accumulate": self.accumulate}

    def level_of(self, layer: str) -> Level:
        """The level of a layer (a new layer gets the policy's initial level)."""
        if layer not in self.levels:
            self.levels[layer] = self.policy.initial_level(layer)
        return self.levels[layer]

    @torch.no_grad()
    def observe(self, layer: str, grad: torch.Tensor, weight: float = 1.0,
                finite: torch.Tensor | None = None) -> None:
        """Called with each compressed layer's raw local gradient, before compression.
        ``weight``: how many samples' worth the gradient is the mean of, in units the window
        divides by (1 per step for the compressor; micro-batches for the batch-size mode).
        ``finite`` (0-d bool): a gradient flagged False does not count (decided on the device)."""
        if not self.policy.uses_norms:
            return
        counted = weight if finite is None else finite * weight
        self._weight[layer] = self._weight.get(layer, 0.0) + counted
        if self.accumulate:
            total = self._sums.get(layer)
            if total is None:
                self._sums[layer] = total = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
            if finite is None:
                total.add_(grad.reshape(-1), alpha=weight)
            elif weight == 1 and grad.dtype in (torch.float32, torch.float16, torch.bfloat16) and ops.has_kernel(total):
                ops.ef_add_(grad.reshape(-1), total, finite)  # the masked add in one pass (error feedback's op)
            else:
                total.add_(torch.where(finite, grad.reshape(-1), 0.0), alpha=weight)
        else:
            sq = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
            self._sq[layer] = self._sq.get(layer, 0.0) + weight * (sq if finite is None else torch.where(finite, sq, 0.0))

    def end_step(self, control: Any, layers: list[str], lrs: list[float] | None,
                 gathered: np.ndarray | None = None) -> dict[str, Level] | None:
        """At the end of every optimizer step (all ranks, same step). ``lrs``: this rank's
        learning rates (one per param group), or None when unknown (then on every rank);
        ``gathered``: every rank's (ranks x groups), when they travelled with the step's
        exchange (then on every rank), else they are reduced here.
        Returns the levels to use from the next step when any changes, else None."""
        self._window_steps += 1
        lr_down = lrs is not None and self.policy.reacts_to_lr and self._lr_decreased(control, lrs, gathered)
        decided = None
        if self.interval is not None and self._window_steps >= self.policy.window_steps(self.interval):
            decided = self._end_window(control, layers)
        if lr_down:  # wins over a detection in the same step: critical until the next one
            decided = self.policy.lr_decreased(layers) or decided
            log.info("learning rate decreased: every layer at the policy's level for a decay until the next "
                     "detection point")
        return self._apply(decided)

    def window_ends(self, epoch_end: bool = False) -> bool:
        """Whether the next ``end_step`` (``epoch_end``, with ``epoch_end``) closes a detection
        window whose report needs the network probe's inputs (the engine then hands them over)."""
        if self.probe is None:  # (made for a policy that uses the network, norms or not)
            return False
        if epoch_end:
            return self.interval is None and self._window_steps > 0
        return self.interval is not None and self._window_steps + 1 >= self.policy.window_steps(self.interval)

    def epoch_end(self, control: Any, layers: list[str]) -> dict[str, Level] | None:
        """An explicit detection point (windows are epochs when ``interval`` is None)."""
        if self.interval is not None:
            if not self._warned_epoch_end:
                log.warning("epoch_end() ignored: detection windows are every %d steps (pass interval=None "
                            "to detect at epoch ends instead)", self.interval)
                self._warned_epoch_end = True
            return None
        return self._apply(self._end_window(control, layers)) if self._window_steps else None

    def unused(self) -> frozenset[str]:
        """Layers that had no gradient on any rank in any window so far (the window norms
        say; empty for policies that measure no norms)."""
        return frozenset(self._known - self._seen)

    # --- per-step policies --------------------------------------------------------------------
    def step_levels(self) -> tuple[Level, ...]:
        """The levels whose gains a per-step policy needs this step."""
        return self.policy.step_levels()

    def choose_step(self, control: Any, g_sq: float, kept: list[float]) -> Level | None:
        """A per-step policy's level for this step, on every rank alike. ``g_sq``: this
        rank's squared norm of gradient plus error feedback over its compressed layers;
        ``kept[i]``: the squared norm it keeps at ``step_levels()[i]``. Both, and the time
        since the last step, are summed over ranks in one control collective. Returns None,
        without consulting the policy, when some rank's numbers are not finite (a non-finite
        gradient: the step is skipped)."""
        levels = self.step_levels()
        if len(kept) != len(levels):
            raise ValueError(f"choose_step: {len(kept)} kept norms for {len(levels)} levels")
        now = time.perf_counter()
        seconds = 0.0 if self._last_step is None else now - self._last_step
        self._last_step = now
        totals = control.allreduce([g_sq, *kept, seconds], name=f"acc.step.{len(levels)}", op="sum")
        if not all(math.isfinite(t) for t in totals[:-1]):
            return None
        total_g = totals[0]
        gains = tuple(t / total_g if total_g > 0 else 1.0 for t in totals[1:-1])
        return self.policy.choose_step(StepReport(levels, gains, totals[-1] / control.size))

    # --- internals --------------------------------------------------------------------------
    def _apply(self, decided: dict[str, Level] | None) -> dict[str, Level] | None:
        if not decided:
            return None
        changed = {layer: level for layer, level in decided.items() if self.levels.get(layer) != level}
        self.levels.update(decided)
        return changed or None

    def _lr_decreased(self, control: Any, lrs: list[float], gathered: np.ndarray | None) -> bool:
        """Agree on the learning rates (min and max over ranks: from ``gathered``, else one
        small collective) and say whether any went down since the last step."""
        if gathered is not None:
            low, high = gathered.min(axis=0), gathered.max(axis=0)
        else:
            local = np.asarray([float(x) for x in lrs], dtype=np.float64)
            reduced = control.allreduce(np.concatenate([local, -local]), name=f"acc.lr.{len(lrs)}", op="min")
            low, high = reduced[:len(lrs)], -reduced[len(lrs):]
        if not np.array_equal(low, high):
            raise RuntimeError(f"AccordionCompressor: ranks use different learning rates (per param group, "
                               f"min {low.tolist()} vs max {high.tolist()} over ranks); the regime controller "
                               f"needs them equal")
        previous, self._lrs = self._lrs, low.tolist()
        if self._lr_peak is None or len(self._lr_peak) != len(self._lrs):
            self._lr_peak = list(self._lrs)
        else:
            self._lr_peak = [max(p, x) for p, x in zip(self._lr_peak, self._lrs)]
        return previous is not None and len(previous) == len(self._lrs) and any(
            new < old for new, old in zip(self._lrs, previous))

    def _lr_fraction(self) -> float | None:
        """The learning rate now over its peak so far (smallest over groups; None if unknown)."""
        if self._lrs is None or self._lr_peak is None:
            return None
        return min((x / p if p > 0 else 1.0) for x, p in zip(self._lrs, self._lr_peak))

    def _end_window(self, control: Any, layers: list[str]) -> dict[str, Level]:
        steps, self._window_steps = self._window_steps, 0
        self.windows += 1
        # The collectives' names carry a digest of the layer list: ranks that compress
        # different layers fail by name instead of comparing the wrong numbers.
        digest = zlib.crc32("\0".join(layers).encode())
        try:
            norms = {layer: 0.0 for layer in layers}
            if self.policy.uses_norms:  # (a link gate around a static policy measures steps alone)
                local = np.asarray(self._local_norms(layers), dtype=np.float64)
                total = control.allreduce(local, name=f"acc.window.{len(layers)}.{digest:08x}", op="sum") / control.size
                norms = {layer: float(v) for layer, v in zip(layers, total)}
                self._seen.update(layer for layer, v in norms.items() if v != 0)
                self._known = set(layers)
            probe = self.probe if self.policy.uses_network else None
            network = measure = None
            if probe is not None and probe.levels:
                network = probe.network(control, layers)
                measure = functools.partial(self._level_errors, control, layers, probe, digest)
            levels = self.policy.end_window(WindowReport(norms, steps, lr_fraction=self._lr_fraction(),
                                                         network=network, measure_errors=measure))
        finally:  # the window's sums are spent, whatever the policy did with them
            self._sums.clear()
            self._sq.clear()
            self._weight.clear()
        log.debug("window %d (%d steps): norms %s -> levels %s", self.windows, steps,
                  {k: round(v, 6) for k, v in list(norms.items())[:8]},
                  {k: str(v) for k, v in list(levels.items())[:8]})
        return levels

    def _level_errors(self, control: Any, layers: list[str], probe, digest: int) -> dict[str, dict[Level, float]]:
        """Each layer's error at each of the codec's levels on its window-mean gradient plus
        error feedback, mean over ranks (one control collective). Only when a network-aware
        policy asks: a window whose levels are already decided (Accordion's, vetoed or not yet
        timed) skips the products."""
        local = [e for layer in layers for e in probe.errors(layer, self._window_mean(layer))]
        total = control.allreduce(np.asarray(local, dtype=np.float64), op="sum",
                                  name=f"acc.errors.{len(layers)}x{len(probe.levels)}.{digest:08x}") / control.size
        per_layer = np.asarray(total).reshape(len(layers), len(probe.levels))
        return {layer: dict(zip(probe.levels, map(float, row))) for layer, row in zip(layers, per_layer)}

    def _window_mean(self, layer: str) -> torch.Tensor | None:
        """The layer's mean raw gradient over the window (``accumulate``), or None."""
        weight = float(self._weight.get(layer, 0.0))
        if not self.accumulate or weight == 0:
            return None
        return self._sums[layer] / weight

    def _local_norms(self, layers: list[str]) -> list[float]:
        """Each layer's window-mean gradient norm on this rank (0 for a layer not seen), read
        from the device in one go."""
        weights = _host_floats([self._weight.get(layer, 0.0) for layer in layers])
        if self.accumulate:
            sq = _host_floats([torch.linalg.vector_norm(self._sums[layer], dtype=torch.float64) ** 2
                               if w > 0 else 0.0 for layer, w in zip(layers, weights)])
            return [math.sqrt(s) / w if w > 0 else 0.0 for s, w in zip(sq, weights)]
        sq = _host_floats([self._sq.get(layer, 0.0) if w > 0 else 0.0 for layer, w in zip(layers, weights)])
        return [math.sqrt(s / w) if w > 0 else 0.0 for s, w in zip(sq, weights)]

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"levels": {k: v.to_state() for k, v in self.levels.items()}, "window_steps": self._window_steps, "windows": self.windows,
                "lrs": None if self._lrs is None else list(self._lrs),
                "lr_peak": None if self._lr_peak is None else list(self._lr_peak),
                "sums": {k: v.clone() for k, v in self._sums.items()}, "sq": {k: float(v) for k, v in self._sq.items()},
                "weight": {k: float(v) for k, v in self._weight.items()},
                "seen": sorted(self._seen), "known": sorted(self._known),
                "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.levels = {str(k): Level.from_state(v) for k, v in state["levels"].items()}
        self._window_steps = int(state["window_steps"])
        self.windows = int(state["windows"])
        self._lrs = None if state["lrs"] is None else [float(x) for x in state["lrs"]]
        peak = state.get("lr_peak", state["lrs"])  # older states: the peak is unknown, the last rate stands in
        self._lr_peak = None if peak is None else [float(x) for x in peak]
        self._sums = {k: v.clone() for k, v in state["sums"].items()}
        self._sq = {k: float(v) for k, v in state["sq"].items()}
        self._weight = {k: float(v) for k, v in state["weight"].items()}
        self._known = {str(k) for k in state.get("known", ())}
        self._seen = {str(k) for k in state.get("seen", self._known)}  # older states: none reported unused
        self.policy.load_state_dict(state["policy"])


def _host_floats(values: list) -> list[float]:
    """Floats and 0-d tensors (all on one device) as floats, with one read from the device
    rather than one per tensor."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.to(torch.float64) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
