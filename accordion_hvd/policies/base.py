"""The interface every level policy implements."""

from __future__ import annotations

from dataclasses import dataclass

from ..levels import Level


@dataclass(frozen=True)
class WindowReport:
    """What the controller hands a policy at the end of a detection window. Every field is
    identical on all ranks (reduced over the control plane before the policy sees it).

    norms: per compressed layer, the norm of its gradient over the window (the mean over
        ranks of each rank's local norm), in sorted layer order.
    steps: optimizer steps in the window.
    lr_decreased: whether the learning rate went down during the window.
    """
    norms: dict[str, float]
    steps: int
    lr_decreased: bool = False


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

    def config(self) -> dict:
        return {"policy": self.name}

    def initial_level(self, layer: str) -> Level:
        raise NotImplementedError

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        raise NotImplementedError

    def lr_decreased(self, layers: list[str]) -> dict[str, Level] | None:
        return None

    def step_levels(self) -> tuple[Level, ...]:
        """Per-step policies: the levels whose gains this step's choice needs."""
        raise NotImplementedError(f"policy {self.name!r} does not decide per step")

    def choose_step(self, report: StepReport) -> Level:
        """Per-step policies: the level of every compressed layer in this step."""
        raise NotImplementedError(f"policy {self.name!r} does not decide per step")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
