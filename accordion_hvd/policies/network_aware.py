"""NetworkAware: per layer, the level that gives the fastest predicted step, never losing more
than Accordion's rule allows.

Accordion (Agarwal et al., MLSys 2021) decides *when* to compress gently: a layer in a
critical regime gets the codec's gentle level. L-GreCo (Markov et al., MLSys 2024) decides
*which layers* take which setting, under a budget of total compression error. This policy
does both, against the network it runs on:

1. **The budget** is Accordion's decision, run unchanged inside (``self.regimes``, with the
   same eta, learning-rate decays included): the total squared compression error of every
   layer at the level Accordion gives it, aggressive in normal regimes, gentle in critical
   ones. The chosen levels never exceed it.
2. **The error of a level** is measured as L-GreCo does, on the error-feedback-corrected
   gradient: at each window's end, each layer's mean gradient over the window plus its
   error feedback is compressed at every candidate level (TopK: exactly, the energy outside
   the top k; PowerSGD: two subspace iterations, codecs/*.py ``level_errors``), averaged
   over ranks by the controller. Only when the search runs: a window whose levels the
   clock has already decided (below) asks for none, and costs what Accordion's costs plus
   the probe's timings.
3. **The time of a choice** is the cost model's step (accordion_hvd/costmodel.py): the
   exchange's buckets, issued when their last layer is ready in backward, each collective
   priced by the alpha-beta link fitted online to this window's own collectives.
4. **The choice** is greedy over single-layer moves, starting from the budget's levels:
   (a) every layer, earliest-ready first, takes its gentlest level (dense where the codec
   has one) that does not make the predicted step longer: communication that hides under the
   rest of backward costs nothing, so such a layer stays gentle or dense; (b) the error this
   saved is spent on making layers more aggressive, the move that saves the most predicted
   time per unit of error first, while one saves time and fits the budget; (c) (a) again.
   L-GreCo solves its knapsack by dynamic programming over bytes; here the objective is a
   simulated step with overlap, not a sum over layers, hence a greedy search; with the two
   or three levels per layer of our codecs it evaluates O(layers^2 x levels) steps.

Where a window gives nothing to predict with (no link determined, a window with no exchange,
a non-finite or negative timing or error), every layer takes the gentle level for that
window, the safe choice, with a logged reason; Accordion's regime detection goes on
underneath, so the next usable window decides as usual. Every input is reduced over ranks
and the search is deterministic, so every rank decides the same levels by construction.

Two margins keep the model's error from costing time (the first version, without them, sent
layers dense that were predicted to hide and did not, for tiny predicted gains; measured:
docs/design.md, "Measured reasons"): every prediction is made on a link ``headroom`` times
slower than the one measured (latency and time per byte both; default 2), so a transfer counts
as hidden only with that margin; and the error-for-time trades of (b) are kept only if the step
they give is predicted at least ``min_gain`` (default 2%) shorter than at Accordion's levels,
else the levels after (a) stand.

The model is checked against the clock (``verify``, on by default): a prediction that is
right about the link can still be wrong about the machine (on the emulated cluster, whose
nodes share two cores, a dense layer's transfer that hid on the link slowed both ranks'
backward; measured: docs/design.md, "Measured reasons"). So the policy leaves Accordion's
levels only after it has measured them: for each budget (Accordion's levels of a window), it
first runs a window at exactly those levels and keeps their measured step (the probe's
median time between steps' ends, network_probe.py); then it runs its own levels, and as soon
as the windows at its own levels for that budget measure slower on average than the budget's
window, it goes back to the budget's levels for that budget. Measurements and that verdict
expire after ``memory`` windows (the network or the model may have changed), so the policy
measures again. So does a search that kept the budget's own levels: it is not repeated for
that budget until then (or until the host cost per byte below changes), since its level
errors' products cost a window's end a visible share of a step (measured: docs/design.md,
"Measured reasons"). Its cost against Accordion is at most the trial windows; without a
measured step (a rank timed none) it keeps Accordion's levels.

``tolerance``: a move of (a) may lengthen the predicted step by up to this fraction of the
budget's predicted step (0: only moves that cost nothing).

``warmup``: the first windows (8 by default) run Accordion's levels, with no search and no
trial: a trial that measures slower costs up to a whole window before it is undone, and on a
short job that is a large share of all its steps (measured: docs/design.md, "Measured
reasons"). After 8 windows a failed trial is at most one window in nine.

The prediction has each level's math as well as its transfers: the codec counts a level's
work per layer (bytes and multiply-adds, ``codec.kernel_work``), and the probe prices it at
the rate the window's own math ran (network_probe.py), so a level whose kernels cost more
than its transfer saves (on a fast link, PowerSGD against sending a layer whole) is seen to.

What the link fit cannot see is the CPU a transfer takes from the computation beside it (TCP
copies, and on the emulated cluster the other node's network stack on the same cores): a layer
sent whole whose bytes hid on the link still lengthened backward there (measured:
docs/design.md, "Measured reasons"). The policy learns that cost from its own trials: each
trial window's measured step against the budget's, less what the model predicted for the same
two, is the model's error; divided by the bytes per step the trial put on the wire beyond the
budget's, it corrects a host cost per byte (seconds of the main thread per byte issued, never
below 0), which every later prediction charges before each round as it charges the round's
math. A trial that measured faster than predicted lowers it again; one that sent less than 10%
more bytes than the budget teaches nothing (its difference is the noise of a measured step).
One number for the machine, kept in the state (``host_s_per_byte`` in ``last``): after one
dense-heavy trial was measured slower, the next budget's search no longer counts such a
transfer as free. It also stands for what the link fit, made on the exchange's kilobyte-sized
collectives, misses about megabytes (measured: docs/design.md, "Measured reasons").
"""

from __future__ import annotations

import logging
import math
import zlib

from ..levels import CRITICAL, DENSE, DENSE16, Level
from . import level_search
from .accordion import Accordion
from .base import NetworkReport, Policy, WindowReport
from .level_search import unusable_network, unusable_errors, wire_bytes

log = logging.getLogger("accordion_hvd.policies")
_MIN_EXTRA_BYTES = 0.1  # a trial teaches the host cost of a byte if it sent this fraction more than the budget
_DENSE_LEVELS = {"fp32": DENSE, "fp16": DENSE16}


class NetworkAware(Policy):
    """Args:
        eta: Accordion's threshold on the relative change of a layer's window norm (0.5).
        tolerance: fraction of a step a gentler level may add to the predicted step (0.0).
        headroom: plan for a link this many times slower than measured (2.0; at least 1).
        min_gain: trades of error for time only for a predicted step this fraction shorter (0.02).
        verify: leave Accordion's levels only while that measures no slower (True; see module doc).
        memory: windows after which a measured step or a verdict expires (20).
        dense: how a layer goes when it goes whole: "fp32" (``DENSE``, in the gradient's
            dtype; PowerSGD sends it in its bucket's P round) or "fp16" (``DENSE16``: float16
            through Horovod's allreduce, half the bytes, the rounding error kept in the
            layer's error feedback).
        warmup: windows run at Accordion's levels before the first search (8): a trial of
            its own levels that measures slower costs up to a window, which a short job
            cannot win back (module doc).
    """

    name = "network-aware"
    uses_network = True

    def __init__(self, eta: float = 0.5, *, tolerance: float = 0.0, headroom: float = 2.0,
                 min_gain: float = 0.02, verify: bool = True, memory: int = 20, dense: str = "fp32",
                 warmup: int = 8) -> None:
        self.regimes = Accordion(eta)
        self.tolerance = _fraction("tolerance", tolerance)
        self.min_gain = _fraction("min_gain", min_gain)
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1 <= headroom < math.inf:
            raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
        self.headroom = float(headroom)
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False, got {verify!r}")
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
            raise ValueError(f"memory must be an int >= 1 (windows), got {memory!r}")
        self.verify, self.memory = verify, memory
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (windows), got {warmup!r}")
        self.warmup = warmup
        if dense not in _DENSE_LEVELS:
            raise ValueError(f"dense must be one of {sorted(_DENSE_LEVELS)}, got {dense!r}")
        self.dense, self.dense_level = dense, _DENSE_LEVELS[dense]
        self._levels: dict[str, Level] = {}
        self._window = 0                                   # windows ended so far
        self._measured: dict[str, list] = {}              # levels' signature -> [window, step seconds]
        self._trials: dict[str, list] = {}                # budget's signature -> [first window, [step seconds]]
        self._vetoed: dict[str, int] = {}                 # budget's signature -> window of the verdict
        self._kept: dict[str, int] = {}                   # budget's signature -> window its search kept it
        self._trial_of: str | None = None                 # the budget the current window's own levels are tried for
        self._trial_model: list | None = None             # its prediction: [budget's step, own step, their bytes]
        self._host = 0.0                                   # seconds of the main thread per byte issued (module doc)
        self._mixed = False                                # levels changed inside the window (a decay)
        self.last: dict = {}  # the last window's decision (its predictions on the planning link), for logs

    @property
    def eta(self) -> float:
        return self.regimes.eta

    def __repr__(self) -> str:
        return (f"NetworkAware(eta={self.eta}, tolerance={self.tolerance}, headroom={self.headroom}, "
                f"min_gain={self.min_gain}, verify={self.verify}, memory={self.memory}, dense={self.dense!r}, "
                f"warmup={self.warmup})")

    def config(self) -> dict:
        return {"policy": self.name, "eta": self.eta, "tolerance": self.tolerance, "headroom": self.headroom,
                "min_gain": self.min_gain, "verify": self.verify, "memory": self.memory, "dense": self.dense,
                "warmup": self.warmup}

    def initial_level(self, layer: str) -> Level:
        return CRITICAL

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        self._window += 1
        budget = self.regimes.end_window(report)
        ran = {layer: self._levels.get(layer, CRITICAL) for layer in budget}
        self._record(ran, None if report.network is None else report.network.step_s)
        self._trial_of, self._trial_model = None, None
        self.last = {}
        if self._window <= self.warmup:  # a short job stays Accordion: no search, no trial (module doc)
            self.last = {"kept": f"warm-up: Accordion's levels for the first {self.warmup} windows"}
            return self._decided(dict(budget), report)
        why = unusable_network(report.network, budget)
        if not why and self.verify:
            settled = self._settled(budget)
            if settled is not None:  # Accordion's levels, decided without the level errors
                return self._decided(settled, report)
        if not why:
            errors = report.level_errors()  # measured only now that the search needs them
            why = unusable_errors(errors, budget)
        if why:  # the safe choice: every layer gentle, whatever Accordion's regimes say
            log.warning("NetworkAware: every layer at the gentle level for this window: %s", why)
            self.last = {"kept": why}
            return self._decided({layer: CRITICAL for layer in budget}, report)
        chosen = self.choose(budget, errors, report.network)
        if chosen == budget:
            self._kept[_signature(budget)] = self._window
        elif self.verify:
            self.last["verified"] = "trying its own levels against Accordion's measured step"
            self._trial_of = _signature(budget)
            self._trial_model = [self.last["accordion_s"], self.last["predicted_s"],
                                 wire_bytes(budget, report.network), wire_bytes(chosen, report.network)]
        return self._decided(chosen, report)

    def _decided(self, levels: dict[str, Level], report: WindowReport) -> dict[str, Level]:
        self.last["measured_s"] = None if report.network is None else report.network.step_s  # the window's own
        self._levels.update(levels)
        return levels

    def lr_decreased(self, layers: list[str]) -> dict[str, Level]:
        decided = self.regimes.lr_decreased(layers)
        self._levels.update(decided)
        self._mixed = True  # this window's step no longer measures one set of levels
        self._trial_of, self._trial_model = None, None
        return decided

    # --- the check against the clock (module doc) --------------------------------------------
    def _fresh(self, since: int) -> bool:
        return self._window - since <= self.memory

    def _record(self, ran: dict[str, Level], step_s: float | None) -> None:
        """File the ended window's measured step under the levels it ran, and judge a trial."""
        mixed, self._mixed = self._mixed, False
        for table in (self._measured, self._trials, self._vetoed, self._kept):  # forget what expired
            for key in [k for k, v in table.items() if not self._fresh(v if isinstance(v, int) else v[0])]:
                del table[key]
        if mixed or step_s is None or not math.isfinite(step_s) or step_s <= 0:
            return
        self._measured[_signature(ran)] = [self._window, step_s]
        budget = self._trial_of
        if budget is None or budget not in self._measured:
            return
        _, steps = self._trials.setdefault(budget, [self._window, []])
        steps.append(step_s)
        base, mean = self._measured[budget][1], sum(steps) / len(steps)
        self._calibrate(step_s - base)
        if mean > base:
            self._vetoed[budget] = self._window
            log.info("NetworkAware: its levels measured %.4f s per step over %d window(s), Accordion's %.4f s: "
                     "back to Accordion's levels for %d windows", mean, len(steps), base, self.memory)

    def _calibrate(self, measured: float) -> None:
        """Correct the host cost per byte by the trial's error: ``measured`` seconds per step
        it took beyond the budget's window, against what the model predicted (module doc)."""
        if self._trial_model is None:
            return
        predicted_budget, predicted_own, bytes_budget, bytes_own = self._trial_model
        extra = bytes_own - bytes_budget
        if extra <= _MIN_EXTRA_BYTES * bytes_budget:  # (bytes are never negative: covers extra <= 0)
            return  # too few bytes more to tell a cost per byte from the noise of a measured step
        error = measured - (predicted_own - predicted_budget)
        before, self._host = self._host, max(0.0, self._host + error / extra)
        if self._host != before:
            self._kept.clear()  # searched with another cost per byte: search again
        log.info("NetworkAware: its levels took %+.4f s per step against Accordion's, the model said %+.4f s, "
                 "for %d bytes more per step: host cost per byte %.3g -> %.3g s", measured,
                 predicted_own - predicted_budget, extra, before, self._host)

    def _settled(self, budget: dict[str, Level]) -> dict[str, Level] | None:
        """The budget's own levels when the clock has decided for them (measured slower, or not
        measured yet) or the search did (it kept them, with the same cost per byte), else None:
        the search may run."""
        key = _signature(budget)
        if key in self._vetoed:
            self.last["verified"] = "measured slower than Accordion's levels: Accordion's levels"
        elif key in self._kept:
            self.last["verified"] = "its search kept Accordion's levels for this budget: Accordion's levels"
        elif key not in self._measured:
            self.last["verified"] = "Accordion's levels not measured yet: measuring them first"
        else:
            return None
        return dict(budget)

    # --- the search (level_search.py) -------------------------------------------------------
    def choose(self, budget: dict[str, Level], errors: dict[str, dict[Level, float]],
               network: NetworkReport) -> dict[str, Level]:
        """The levels of the fastest predicted step within the budget (see module doc)."""
        levels, self.last = level_search.choose(budget, errors, network, headroom=self.headroom,
                                                tolerance=self.tolerance, min_gain=self.min_gain,
                                                host_s_per_byte=self._host)
        return levels

    predict = staticmethod(level_search.predict)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"regimes": self.regimes.state_dict(), "levels": {k: v.to_state() for k, v in self._levels.items()},
                "window": self._window, "measured": {k: list(v) for k, v in self._measured.items()},
                "trials": {k: [v[0], list(v[1])] for k, v in self._trials.items()}, "vetoed": dict(self._vetoed),
                "kept": dict(self._kept),
                "trial_of": self._trial_of, "trial_model": None if self._trial_model is None else list(self._trial_model),
                "host_s_per_byte": self._host}

    def load_state_dict(self, state: dict) -> None:
        self.regimes.load_state_dict(state["regimes"])
        self._levels = {str(k): Level.from_state(v) for k, v in state["levels"].items()}
        # checkpoints from before the check against the clock carry none of it: start measuring afresh
        self._window = int(state.get("window", 0))
        self._measured = {str(k): [int(v[0]), float(v[1])] for k, v in state.get("measured", {}).items()}
        self._trials = {str(k): [int(v[0]), [float(x) for x in v[1]]] for k, v in state.get("trials", {}).items()}
        self._vetoed = {str(k): int(v) for k, v in state.get("vetoed", {}).items()}
        self._kept = {str(k): int(v) for k, v in state.get("kept", {}).items()}
        self._trial_of = state.get("trial_of")
        model = state.get("trial_model")
        self._trial_model = None if model is None else [float(x) for x in model]
        self._host = float(state.get("host_s_per_byte", 0.0))


def _signature(levels: dict[str, Level]) -> str:
    """A short name for a set of per-layer levels (a checkpoint keeps it as a plain string)."""
    return f"{zlib.crc32(';'.join(f'{n}={levels[n]}' for n in sorted(levels)).encode()):08x}"


def _fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


__all__ = ["NetworkAware"]
