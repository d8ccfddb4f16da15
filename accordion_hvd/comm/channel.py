"""The data-plane interface the compressor needs: named, asynchronous, batched collectives.

Every collective carries a name. Ranks pair collectives by name, so a rank that issued a
different sequence (a different layer set, another level) fails loudly instead of summing
the wrong tensors.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

Handle = Any  # opaque, channel-specific


class Channel(Protocol):
    rank: int
    size: int

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str) -> Handle:
        """Start averaging each tensor over all ranks (one batched round)."""

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Handle:
        """Start concatenating every rank's 1-D ``tensor`` (same length everywhere), rank order."""

    def wait(self, handle: Handle) -> Any:
        """Finish a collective: a list of averaged tensors, or the gathered tensor."""
