"""The written contract between the step engine and a codec's exchange.

The engine (engine/engine.py) drives an exchange one step at a time without knowing its
codec; every exchange is an ``Exchange``:

1. ``add(name, state, grad, finite)`` as each gradient arrives: the layer's payload enters
   its bucket of round 1 (``round1``: the bucketed first round, exchange/buckets.py), which
   starts as soon as the bucket is complete. Returns the tensor the front end must average
   instead (a layer sent whole this step: TopK keeping half or more, a 16-bit dense level),
   else None.
2. ``results()`` at the step's first finish: wait for the step's rounds; each carried
   layer's average. A per-step policy's exchange (``measures_gain``) is asked ``gains()``
   first and then ``results(choice)``, with ``plan_step(levels)`` before the step's first add.
3. ``end_step(skipped)`` once the step is settled or skipped (0-d bool on the device): commit
   or roll back the step's error feedback. ``abort()`` instead when Elastic drops the step.

What the engine reads after ``results``: ``fault`` (0-d bool or None: some rank's gradient
was not finite, as seen in the exchanged data) and ``errors`` ((0-d bool, message) pairs
that fail the run if set). ``write_into(name, target)`` lets a front end give the memory a
layer's result goes to (PowerSGD's does; the default declines).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm.channel import Channel
from ..counters import Counters
from .buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, Round1


class Exchange:
    """The contract (module doc), the constructor every exchange shares, and defaults for
    the optional parts.

    Args:
        codec: the codec doing the math.
        channel: the data plane.
        first_cap, cap: round 1's first and later bucket caps, in bytes.
        counters: the engine's counters (accordion_hvd/counters.py): the exchange adds its
            "compress" (math) and "comm" (waits) seconds.
        per_step: the policy decides per step; refused unless ``measures_gain``.
    """

    measures_gain = False  # True: gains() and results(choice) serve a per-step policy
    round1_kind, round1_prefix = "allreduce", "acc.x"  # round 1's collective and its names

    def __init__(self, codec, channel: Channel, *, first_cap: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_BYTES,
                 counters: Counters | None = None, per_step: bool = False) -> None:
        if per_step and not self.measures_gain:
            raise ValueError(f"{type(codec).__name__} measures no per-step gain: a per-step policy needs the TopK "
                             f"codec")
        self.codec, self.channel, self.per_step = codec, channel, bool(per_step)
        self.round1 = Round1(channel, self.round1_kind, self.round1_prefix, first_cap=first_cap, cap=cap,
                             encode=self._round1_encoder())
        self.counters = counters if counters is not None else Counters()
        self.seconds = self.counters.seconds
        self._begin()

    def _round1_encoder(self) -> Callable | None:
        """Encodes a whole bucket at once (``Round1``'s ``encode``), or None: per layer."""
        return None

    def _begin(self) -> None:
        """The step's state, fresh (the one reset; subclasses extend it)."""
        self.fault: torch.Tensor | None = None
        self.errors: list[tuple[torch.Tensor, str]] = []

    # --- the contract ----------------------------------------------------------------------------
    def add(self, name: str, state, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def results(self, choice: Any = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def end_step(self, skipped: torch.Tensor) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Forget the step in flight (its collectives will never complete)."""
        self.round1.begin_step()
        self._begin()

    # --- optional parts, with their defaults -----------------------------------------------------
    def plan_step(self, levels: tuple) -> None:
        """(Per-step policies.) The levels the policy asks about this step."""

    def gains(self) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} measures no per-step gain")

    def write_into(self, name: str, target: torch.Tensor) -> bool:
        """Write ``name``'s result into ``target``; returns whether it will (default: no)."""
        return False
