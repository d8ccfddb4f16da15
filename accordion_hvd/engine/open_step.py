"""What one step keeps until its end, to settle it or to skip it: the engine's and the whole
route's shared record of the step in flight (engine.py, whole.py), reset in one place."""

from __future__ import annotations

import torch


class OpenStep:
    def __init__(self) -> None:
        self.in_flight: set[str] = set()  # layers (or whole buffers) added, not finished yet
        self.reset()

    def reset(self) -> None:
        """A new step. ``in_flight`` is cleared in place (the between-steps part holds it)."""
        self.in_flight.clear()
        self.outputs: list[torch.Tensor] = []                # every result handed out
        self.results: dict[str, torch.Tensor] | None = None  # the step's rounds', once waited for
        self.rounds: set[str] = set()                        # which of our rounds carry layers this step
        self.dtypes: dict[str, torch.dtype] = {}             # a layer's gradient dtype where its round may change it
        self.planned = False                                 # a per-step policy's levels handed to the exchange
