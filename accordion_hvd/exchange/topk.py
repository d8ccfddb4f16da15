"""TopK's exchange: one allgather per bucket of every layer's values and indices.

Per layer (codecs/topk.py does the math): g = grad + e, the k entries of largest magnitude
are selected, and every rank's (values, int32 indices) are gathered, packed as bytes in one
payload per layer; the result is their average. k is a function of the level, the same on
every rank, so a bucket's payload has the same length everywhere. A bucket's allgather
starts as soon as its last layer is encoded (exchange/buckets.py); a step issues one
collective per bucket.

A layer whose level keeps half its entries or more is sent dense instead: it goes through
Horovod's ordinary allreduce, and its error feedback is settled at the end of the step.

With the GraVAC policy (policies/gravac.py) the choice of what to send is made per step, once
every layer is encoded: each layer is encoded at the policy's minimum factor, the gains of
the minimum and the candidate factor are summed over ranks (one control collective), and the
selections are trimmed to the candidate, kept, or undone so that every layer goes dense in
one grouped allreduce.

Non-finite gradients: a rank sends NaN values for such a layer, so every rank sees the fault
in the gathered data; every layer's selection goes back into its error feedback and the
results are zero.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from ..codecs._common import all_finite
from ..comm.channel import Channel
from ..policies.gravac import CANDIDATE, DENSE
from .buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, Round1, bytes_of, split_bytes


class TopKExchange:
    """One step at a time: ``add`` each layer as its gradient arrives, ``results`` at the
    first decompress, ``end_step`` once the step is settled.

    Args:
        codec: the ``acc.TopK`` doing the math.
        channel: the data plane.
        before_last: called right after the step's last bucket is issued.
        seconds: accumulates "compress" (math) and "comm" (waits) seconds.
        gravac: the GraVAC policy, if it is the one deciding; then ``control`` (a callable
            returning the control plane) and ``sent`` (the adapter's floats sent per layer,
            corrected for what the per-step choice sends) are needed too.
    """

    def __init__(self, codec, channel: Channel, *, first_cap: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_BYTES,
                 before_last: Callable[[], None] | None = None, seconds: dict[str, float] | None = None,
                 gravac=None, control: Callable[[], Any] | None = None, sent: dict[str, int] | None = None) -> None:
        self.codec, self.channel = codec, channel
        self.round1 = Round1(channel, "allgather", "acc.topk", first_cap=first_cap, cap=cap)
        self.before_last = before_last
        self.seconds = seconds if seconds is not None else {"compress": 0.0, "comm": 0.0}
        self.gravac, self.control, self.sent = gravac, control, sent
        self._last_exchange: float | None = None  # GraVAC: when the previous step's exchange ran
        self._begin()

    def _begin(self) -> None:
        self._layers: dict[str, tuple[Any, torch.Tensor, tuple, bool]] = {}  # name -> (state, grad, sent, finite)
        self._undo: list = []     # if the step is skipped: put a selection back into e
        self._settle: list = []   # if it is not: finish a dense layer's error feedback
        self.fault = False

    def add(self, name: str, state, grad: torch.Tensor, finite: bool) -> torch.Tensor | None:
        """Layer ``name``'s gradient. Returns the tensor Horovod must average instead, when
        the layer is sent dense this step, else None (its bucket's allgather carries it)."""
        if self.gravac is not None:  # encode at the minimum factor; trimmed later if need be
            self.codec.set_level(state, f"{self.gravac.min_factor:g}x")
        if self.codec.sends_dense(state):
            self.round1.ready(name, None, grad)  # nothing in round 1 this step
            if not finite:
                return torch.full_like(grad, float("nan"))
            started = time.perf_counter()
            out = self.codec.flush_dense(state, grad)
            self.seconds["compress"] += time.perf_counter() - started
            self._settle.append(lambda s=state, dtype=grad.dtype: self.codec.settle_dense(s, dtype))
            return out
        started = time.perf_counter()
        encoded = self.codec.encode(state, grad) if finite else self.codec.poisoned(state)
        self.seconds["compress"] += time.perf_counter() - started
        self._layers[name] = (state, grad, encoded, finite)
        if self.gravac is None:  # GraVAC decides what to send once every layer is encoded
            self.round1.ready(name, bytes_of(*encoded), grad)
        return None

    @torch.no_grad()
    def results(self) -> dict[str, torch.Tensor]:
        """Wait for the step's exchange; each sparse-sent layer's averaged gradient."""
        names = sorted(self._layers)
        if self.gravac is not None:
            done = self._gravac_step(names)
            for n in names:  # what the choice left to send (nothing, if dense or skipped)
                state, grad, encoded, _ = self._layers[n]
                self.round1.ready(n, None if done is not None else bytes_of(*encoded), grad)
            if done is not None:
                self.round1.results()  # issues nothing; the first step agrees on the layout
                self._layers = {}
                return done
        started = time.perf_counter()
        try:
            gathered = self.round1.results(self.before_last)
        finally:
            self.seconds["comm"] += time.perf_counter() - started
        started = time.perf_counter()
        layers = [(n, *self._layers[n]) for n in names]
        parts = {n: split_bytes(gathered[n], state.residual.dtype, state.k) for n, state, *_ in layers}
        out: dict[str, torch.Tensor] = {}
        if not all(all_finite(values) for values, _ in parts.values()):  # a rank sent NaN
            out = self._skip(layers)
        else:
            for n, state, grad, encoded, _ in layers:
                values, indices = parts[n]
                out[n] = self.codec.decode(state, values, indices, self.channel.size, grad.dtype)
                self._undo.append(lambda s=state, sent=encoded: self.codec.restore(s, *sent))
        self.seconds["compress"] += time.perf_counter() - started
        self._layers = {}
        return out

    def _skip(self, layers) -> dict[str, torch.Tensor]:
        """A rank's gradient was not finite: each selection goes back into e (a layer that was
        not finite here left e untouched); the results are zero."""
        self.fault = True
        for n, state, grad, encoded, finite in layers:
            if finite:
                self.codec.restore(state, *encoded)
        return {n: torch.zeros_like(grad) for n, state, grad, *_ in layers}

    def _gravac_step(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """GraVAC's per-step choice. Both gains come from the selection at the minimum factor
        (the candidate's is its top); the model's squared norms and the step's time are summed
        over ranks, so every rank chooses alike. Returns the results if the step's exchange is
        done (dense, or skipped), else None: the (trimmed) selections are to be sent."""
        candidate, _ = self.gravac.factors()
        now = time.perf_counter()
        seconds = 0.0 if self._last_exchange is None else now - self._last_exchange
        self._last_exchange = now
        layers = [(n, *self._layers[n]) for n in names]
        g_sq = kept_min = kept_cand = 0.0
        for n, state, grad, (values, _), _ in layers:
            k = self.codec.factor_k(state.residual.numel(), candidate)
            g_sq, kept_min = g_sq + state.g_sq, kept_min + state.kept_sq
            top = values.abs().topk(k).values if k < values.numel() else values
            kept_cand += top.double().square().sum().item()
        control = self.control()
        totals = control.allreduce([g_sq, kept_min, kept_cand, seconds], name="acc.gravac", op="sum")
        if not all(math.isfinite(t) for t in totals[:3]):  # a rank's gradient was not finite
            return self._skip(layers)
        total_g = totals[0]
        gains = (totals[2] / total_g, totals[1] / total_g) if total_g > 0 else (1.0, 1.0)
        choice = self.gravac.choose(*gains)
        self.gravac.end_step(totals[3] / control.size)
        for n, state, grad, (values, indices), finite in layers:
            numel = state.residual.numel()
            before = self.codec.floats_sent(state)
            if choice == CANDIDATE:
                trimmed = self.codec.trim(state, values, indices, self.codec.factor_k(numel, candidate))
                self._layers[n] = (state, grad, trimmed, finite)
                state.level = f"{candidate:g}x"
            elif choice == DENSE:
                self.codec.restore(state, values, indices)
                state.level = DENSE
            if self.sent is not None:
                self.sent[n] += (numel if choice == DENSE else self.codec.floats_sent(state)) - before
        if choice != DENSE:
            return None
        # Dense: every layer's g = grad + e averaged in one grouped allreduce; e is reset once
        # the step is known not to be skipped.
        states = [self._layers[n][0] for n in names]
        started = time.perf_counter()
        avgs = self.channel.wait(self.channel.allreduce_mean_async([s.residual for s in states],
                                                                    name=f"acc.dense.{len(names)}"))
        self.seconds["comm"] += time.perf_counter() - started
        out = {}
        for n, state, avg in zip(names, states, avgs):
            out[n] = avg.to(self._layers[n][1].dtype).view(state.shape)
            self._settle.append(state.residual.zero_)
        return out

    def end_step(self, skipped: bool) -> None:
        """Settle the step: undo the selections sent if it is skipped, else finish the dense
        layers' error feedback."""
        for action in (self._undo if skipped else self._settle):
            action()
        if self.round1.active:  # only dense-level layers this step: nothing was waited for
            self.round1.results()
        self._begin()

    def abort(self) -> None:
        """Forget the step in flight (its collectives will never complete)."""
        self.round1.begin_step()
        self._begin()
