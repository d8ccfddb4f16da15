"""The interface every level policy implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..costmodel import Link
from ..levels import DENSE, Level


@dataclass(frozen=True)
class NetworkReport:
    """What a network-aware policy needs to predict a step (``Policy.uses_network``), the
    same on every rank.

    link: the alpha-beta link fitted to the window's collectives (comm/link.py), or None when
        the window did not determine one.
    world: the number of ranks.
    backward_s: from the step's first compressed gradient to its last one (mean over the
        window's steps and over ranks): the part of backward that can hide communication;
        like ``ready_s``, without the compression math done in it (the probe takes it out
        when it has the compressor's math clock).
    ready_s: per compressed layer, when its gradient was ready, in seconds after the first.
    buckets: the exchange's agreed buckets of layers, in the order they are issued.
    wire: per layer and level, the collectives the layer costs, (kind, bytes per rank), in
        round order: "allreduce" or "allgather" in its bucket's round, or "dense" (sent alone,
        outside the buckets, by an allreduce issued when the layer is ready).
    step_s: the window's measured step, from one step's end to the next (the median over the
        window's steps, mean over ranks), or None when some rank measured none.
    kernel_s: per layer and level, the seconds of the codec's math: before each of the
        layer's rounds (one per ``wire`` entry), then to finish it (result and error
        feedback). Empty when the window gave no rate: the prediction then has no math.
    """
    link: Link | None
    world: int
    backward_s: float
    ready_s: dict[str, float]
    buckets: tuple[tuple[str, ...], ...]
    wire: dict[str, dict[Level, tuple[tuple[str, int], ...]]]
    step_s: float | None = None
    kernel_s: dict[str, dict[Level, tuple[float, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowReport:
    """What the controller hands a policy at the end of a detection window. Every field is
    identical on all ranks (reduced over the control plane before the policy sees it).

    norms: per compressed layer, the norm of its gradient over the window (the mean over
        ranks of each rank's local norm), in sorted layer order.
    steps: optimizer steps in the window.
    lr_decreased: whether the learning rate went down during the window.
    lr_fraction: the learning rate now as a fraction of the highest it has been (the smallest
        over param groups), or None when the controller knows no learning rate.
    errors: for a network-aware policy, per layer and candidate level, the squared error of
        compressing the layer's window-mean gradient plus its error feedback at that level
        (mean over ranks); None for other policies, or when nothing measured them.
    network: for a network-aware policy, what predicts a step (``NetworkReport``), or None.
    measure_errors: when ``errors`` is None, a network-aware policy may get them here, on
        demand: the controller measures them only then (they cost four products per layer
        and a control collective), so the policy calls it on every rank or on none, which a
        decision made on this report's reduced numbers guarantees. Use ``level_errors()``.
    """
    norms: dict[str, float]
    steps: int
    lr_decreased: bool = False
    lr_fraction: float | None = None
    errors: dict[str, dict[Level, float]] | None = None
    network: NetworkReport | None = None
    measure_errors: Callable[[], dict[str, dict[Level, float]]] | None = None

    def level_errors(self) -> dict[str, dict[Level, float]] | None:
        """``errors``, or those measured now by ``measure_errors`` (once: call it once per report)."""
        if self.errors is None and self.measure_errors is not None:
            return self.measure_errors()
        return self.errors


@dataclass(frozen=True)
class StepReport:
    """What the controller hands a per-step policy every step, identical on all ranks.

    levels: the levels the policy asked to measure (``step_levels()``), in its order.
    gains: for each of them, the model's compression gain at that level: the squared norm it
        keeps over the squared norm of the gradient plus error feedback, each summed over
        every compressed layer and every rank (1.0 for an all-zero gradient).
    seconds: the wall time of the previous step, mean over ranks (0.0 at the first step).
    """
    levels: tuple[Level, ...]
    gains: tuple[float, ...]
    seconds: float


class Policy:
    """Decides each compressed layer's level (``levels.NORMAL`` = aggressive,
    ``levels.CRITICAL`` = gentle, or a compression factor, or dense).

    Per window (every policy): ``initial_level`` is the level of a layer when it first
    appears; ``end_window`` returns the levels for the next window; ``lr_decreased`` is
    called in the step the learning rate goes down, and returns levels to use from the next
    step (or None: no change).

    Network-aware (``uses_network = True``): each window's report also carries, per layer,
    the error of each of the codec's levels and what predicts a step's time (``errors``,
    ``network``), measured by the engine and reduced over ranks by the controller.

    Per step (policies with ``per_step = True``): each step, every layer is encoded at the
    widest of ``step_levels()``, the gain of each of those levels is measured and reduced
    over all ranks, and ``choose_step`` picks the level every compressed layer sends in that
    very step (one of them, or ``levels.DENSE``). It needs a codec that measures gains
    (``codec.measures_gain``: TopK).
    """

    name = "policy"
    uses_norms = True    # False: the controller need not gather gradient norms at all
    reacts_to_lr = True  # False: no per-step learning-rate reduction either
    per_step = False     # True: step_levels() and choose_step() decide every step
    uses_network = False  # True: windows carry level errors and a NetworkReport
    needs_two_levels = False  # True: only switches between the codec's NORMAL and CRITICAL (useless with one)
    dense_level = DENSE   # the level such a policy may send a layer whole at (DENSE, or DENSE16)
    settled_level: Level | None = None  # every layer's level for the rest of training, once decided for good

    def config(self) -> dict:
        return {"policy": self.name}

    def initial_level(self, layer: str) -> Level:
        raise NotImplementedError

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        raise NotImplementedError

    def lr_decreased(self, layers: list[str]) -> dict[str, Level] | None:
        return None

    def window_steps(self, interval: int) -> int:
        """How many steps the window now open lasts, given the job's ``interval``: that, unless
        the policy needs a shorter one (the link gate's dense trial: a few steps price a dense
        step as well as a whole window, at a fraction of its cost on a slow link)."""
        return interval

    def step_levels(self) -> tuple[Level, ...]:
        """Per-step policies: the levels whose gains this step's choice needs."""
        raise NotImplementedError(f"policy {self.name!r} does not decide per step")

    def choose_step(self, report: StepReport) -> Level:
        """Per-step policies: the level of every compressed layer in this step."""
        raise NotImplementedError(f"policy {self.name!r} does not decide per step")

    def verdict(self) -> dict | None:
        """A decision this policy takes once for the whole job (the link gate's: compress or
        not), for ``stats()["gate"]`` and rank 0's log; None for policies that take none."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
