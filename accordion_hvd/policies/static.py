"""Static: every layer at the codec's normal level, always (no detection, no norms)."""

from __future__ import annotations

from ..levels import NORMAL, Level
from .base import Policy, WindowReport


class Static(Policy):
    name = "static"
    uses_norms = False
    reacts_to_lr = False

    def __repr__(self) -> str:
        return "Static()"

    def initial_level(self, layer: str) -> Level:
        return NORMAL

    def end_window(self, report: WindowReport) -> dict[str, Level]:
        return {layer: NORMAL for layer in report.norms}
