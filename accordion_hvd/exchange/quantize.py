"""Quantize's exchange: one allgather per bucket of every layer's scales and integers.

Per layer (codecs/quantize.py does the math): g = grad + e is quantized to int8 (or int16)
with one float32 scale per chunk, and every rank's payload (its scales, then its integers,
as bytes) is gathered in its bucket (exchange/buckets.py: DDP's cut, issued as each bucket
completes in backward); the result is the mean of the dequantized payloads. A payload's
length depends only on the layer and its level, the same on every rank.

A layer at ``DENSE16`` goes through the front end's allreduce in float16 instead, and its
error feedback is settled at the end of the step.

Non-finite gradients: a rank sends NaN scales for such a layer (its gradient not folded into
e), so every rank's result for it is NaN: the fault flag is raised on the device and the
step is skipped by the engine; ``end_step(skipped)`` then leaves every e holding g.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..codecs.quantize import Quantize
from ..flags import either, finite_flag
from .base import Exchange
from .registry import register


class QuantizeExchange(Exchange):
    """Quantize's exchange (module doc; the contract and the arguments: exchange/base.py)."""

    round1_kind, round1_prefix = "allgather", "acc.quant"

    def _begin(self) -> None:
        super()._begin()
        self._layers: dict[str, tuple[Any, torch.Tensor]] = {}  # name -> (state, grad), gathered this step
        self._settle: list = []   # f(done): each layer's error feedback, once the step is settled

    def add(self, name: str, state, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        """Layer ``name``'s gradient and its finite flag (0-d bool). Returns the tensor the
        front end must average instead (at DENSE16), else None (its bucket carries it)."""
        started = time.perf_counter()
        if self.codec.sends_dense(state):
            self.round1.ready(name, None, grad)  # nothing in round 1 this step
            out = self.codec.flush_dense(state, grad, finite)
            self._settle.append(lambda done, s=state, dtype=out.dtype: self.codec.settle_dense(s, dtype, done))
            self.seconds["compress"] += time.perf_counter() - started
            return out
        payload = self.codec.encode(state, grad, finite)
        self._layers[name] = (state, grad)
        self._settle.append(lambda done, s=state: self.codec.settle(s, done))
        self.seconds["compress"] += time.perf_counter() - started
        self.round1.ready(name, payload, grad)
        return None

    @torch.no_grad()
    def results(self, choice: Any = None) -> dict[str, torch.Tensor]:
        """Wait for the step's exchange; each gathered layer's averaged gradient."""
        started = time.perf_counter()
        try:
            gathered = self.round1.results()
        finally:
            self.seconds["comm"] += time.perf_counter() - started
        started = time.perf_counter()
        out = {n: self.codec.decode(state, gathered[n], grad.dtype) for n, (state, grad) in sorted(self._layers.items())}
        if out:  # a rank sent NaN scales: flagged here; the NaN results are zeroed by the engine
            self.fault = either(self.fault, ~torch.stack([finite_flag(r) for r in out.values()]).all())
        self.seconds["compress"] += time.perf_counter() - started
        self._layers = {}
        return out

    def end_step(self, skipped: torch.Tensor) -> None:
        """Settle the step (``skipped``: 0-d bool, on the device): e = g - sent where it went
        through; else e keeps g."""
        done = ~skipped
        for action in self._settle:
            action(done)
        if self.round1.active:  # only DENSE16 layers this step: nothing was waited for
            self.round1.results()
        self._begin()

register(Quantize, QuantizeExchange)
