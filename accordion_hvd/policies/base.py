"""The interface every level policy implements."""

from __future__ import annotations

from dataclasses import dataclass


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


class Policy:
    """Decides each compressed layer's level ("normal" = aggressive, "critical" = gentle).

    ``initial_level`` is the level of a layer when it first appears; ``end_window`` returns
    the levels for the next window; ``lr_decreased`` is called in the step the learning rate
    goes down, and returns levels to use from the next step (or None: no change).
    """

    name = "policy"
    uses_norms = True   # False: the controller need not gather gradient norms at all
    reacts_to_lr = True  # False: no per-step learning-rate reduction either

    def config(self) -> dict:
        return {"policy": self.name}

    def initial_level(self, layer: str) -> str:
        raise NotImplementedError

    def end_window(self, report: WindowReport) -> dict[str, str]:
        raise NotImplementedError

    def lr_decreased(self, layers: list[str]) -> dict[str, str] | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
