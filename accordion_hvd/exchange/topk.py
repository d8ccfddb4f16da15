"""TopK's exchange: one allgather per bucket of every layer's values and indices.

Per layer (codecs/topk.py does the math): g = grad + e, the k entries of largest magnitude
are selected, and every rank's (values, int32 indices) are gathered, packed as bytes in one
payload per layer; the result is their average. k is a function of the level, the same on
every rank, so a bucket's payload has the same length everywhere. A layer's gradient is held
until its bucket is complete; then the whole bucket is encoded in one kernel call
(``accordion::topk_ef_many``, which writes the bytes the bucket sends) and its allgather
starts (exchange/buckets.py): one kernel call and one collective per bucket, whatever the
layer count. (float64 layers, which have no kernel, and per-step policies encode layer by
layer.)

A layer whose level keeps half its entries or more is sent dense instead: it goes through
Horovod's ordinary allreduce, and its error feedback is settled at the end of the step.

With a per-step policy (``policy.per_step``: GraVAC) the choice of what to send is made per
step, once every layer is encoded: the engine names the levels the policy asks about
(``plan_step``), each layer is encoded at the widest of them, each level's kept squared norm
is measured from that selection (``gains``), the engine has the controller reduce them over
ranks and the policy choose (one control collective), and ``results(choice)`` trims the
selections to the chosen level, keeps them, or undoes them so that every layer goes dense in
one grouped allreduce. The exchange asks nothing of the controller itself.

Non-finite gradients: a rank sends NaN values for such a layer (selected from e alone: that
gradient is not folded in), so every rank sees the fault in the gathered data. The check is
a 0-d bool flag on the device, never read by the host here: the results carry the NaN (the
engine zeroes them) and ``end_step(skipped)`` puts each selection back into its error
feedback where the step is skipped (the bucket kernel leaves a non-finite layer's e as it
was, so that layer has nothing to undo).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import ops
from ..codecs import TopK
from ..flags import either, finite_flag, nan_unless
from ..levels import DENSE
from .buckets import DEFERRED, bytes_of, split_bytes
from .base import Exchange
from .registry import register


class TopKExchange(Exchange):
    """TopK's exchange (module doc; the contract and the arguments: exchange/base.py). With a
    per-step policy: ``plan_step`` each step before its first ``add``, ``gains`` before
    ``results(choice)``; the counters' floats sent are corrected to the level chosen."""

    measures_gain = True
    round1_kind, round1_prefix = "allgather", "acc.topk"

    def __init__(self, codec, channel, **kwargs) -> None:
        self._step_levels: tuple = ()  # per-step policies: the levels asked about this step
        super().__init__(codec, channel, **kwargs)

    def _round1_encoder(self):
        return self._encode_bucket

    def _begin(self) -> None:
        super()._begin()
        # name -> (state, grad, (values, indices), finite flag)
        self._layers: dict[str, tuple[Any, torch.Tensor, tuple, torch.Tensor]] = {}
        self._undo: list = []     # (state, values, indices): back into e if the step is skipped
        self._undo_buckets: list = []  # (states, payload, ks, finite flags): the same, a bucket at once
        self._deferred: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # name -> (state, grad, finite)
        self._settle: list = []   # f(done): finish a dense layer's error feedback if it is not

    def add(self, name: str, state, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        """Layer ``name``'s gradient and its finite flag (0-d bool). Returns the tensor Horovod
        must average instead, when the layer is sent dense this step, else None (its bucket's
        allgather carries it)."""
        if self.per_step:  # encode at the widest level asked about; trimmed later
            numel = state.residual.numel()
            self.codec.set_level(state, max(self._step_levels, key=lambda lv: self.codec.level_k(lv, numel)))
        if self.codec.sends_dense(state):
            self.round1.ready(name, None, grad)  # nothing in round 1 this step
            started = time.perf_counter()
            out = self.codec.flush_dense(state, grad, finite)
            self.seconds["compress"] += time.perf_counter() - started
            self._settle.append(lambda done, s=state, dtype=out.dtype: self.codec.settle_dense(s, dtype, done))
            return out
        if not self.per_step and self.codec.encodes_many(state):
            # Encoded with the rest of its bucket when the bucket is complete: one kernel call
            # per bucket, however many layers (_encode_bucket).
            self._deferred[name] = (state, grad, finite)
            self.round1.ready(name, DEFERRED, grad)
            return None
        started = time.perf_counter()
        encoded = self.codec.encode(state, grad, finite)
        self.seconds["compress"] += time.perf_counter() - started
        self._layers[name] = (state, grad, encoded, finite)
        if not self.per_step:  # else the policy decides what to send once every layer is encoded
            self.round1.ready(name, _payload(encoded, finite), grad)
        return None

    def _encode_bucket(self, names: list[str]) -> tuple[torch.Tensor, list[int]]:
        """Round 1's ``encode``: a complete bucket's deferred layers in one call. A layer whose
        gradient is not finite sends NaN and leaves its e untouched (nothing to undo)."""
        started = time.perf_counter()
        states, grads, finites = zip(*(self._deferred.pop(n) for n in names))
        flags = torch.stack(finites)
        payload = self.codec.encode_many(states, grads, flags)
        for n, state, grad, finite in zip(names, states, grads, finites):
            self._layers[n] = (state, grad, None, finite)  # the selection is in the payload
        self._undo_buckets.append((states, payload, [s.k for s in states], flags))
        self.seconds["compress"] += time.perf_counter() - started
        return payload, [8 * s.k for s in states]

    def plan_step(self, levels: tuple) -> None:
        """(Per-step policies.) The levels the policy asks about this step, before its first ``add``."""
        self._step_levels = tuple(levels)

    @torch.no_grad()
    def results(self, choice: Any = None) -> dict[str, torch.Tensor]:
        """Wait for the step's exchange; each sparse-sent layer's averaged gradient. With a
        per-step policy, ``choice`` is its level for this step (from ``gains``, reduced over
        ranks), or None when some rank's gradient was not finite (the step is skipped)."""
        names = sorted(self._layers)
        if self.per_step:
            done = self._apply_choice(names, choice)
            for n in names:  # what the choice left to send (nothing, if dense or skipped)
                state, grad, encoded, finite = self._layers[n]
                self.round1.ready(n, None if done is not None else _payload(encoded, finite), grad)
            if done is not None:
                self.round1.results()  # issues nothing; the first step agrees on the layout
                self._layers = {}
                return done
        started = time.perf_counter()
        try:
            gathered = self.round1.results()
        finally:
            self.seconds["comm"] += time.perf_counter() - started
        started = time.perf_counter()
        names = sorted(self._layers)  # now with the layers encoded as their buckets launched
        layers = [(n, *self._layers[n]) for n in names]
        parts = {n: split_bytes(gathered[n], state.residual.dtype, state.k) for n, state, *_ in layers}
        out: dict[str, torch.Tensor] = {}
        if parts:  # a rank sent NaN: flagged here; the NaN results are zeroed by the engine
            self.fault = either(self.fault, ~torch.stack([finite_flag(values) for values, _ in parts.values()]).all())
        corrupt = torch.zeros((), dtype=torch.bool, device=layers[0][2].device) if layers else None
        for n, state, grad, encoded, _ in layers:
            values, indices = parts[n]
            out[n] = self.codec.decode(state, values, indices, self.channel.size, grad.dtype, corrupt)
            if encoded is not None:  # else undone with its bucket (_undo_buckets)
                self._undo.append((state, *encoded))
        if corrupt is not None:  # an index outside its layer: the step is skipped, the run fails
            self.fault = either(self.fault, corrupt)
            self.errors.append((corrupt, f"AccordionCompressor: TopK indices outside their layer in the data "
                                         f"gathered for {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: "
                                         f"corrupted in transit, or the ranks disagree on the layers"))
        self.seconds["compress"] += time.perf_counter() - started
        self._layers = {}
        return out

    def _skip(self, layers) -> dict[str, torch.Tensor]:
        """(Per-step policies, which read the norms on the host anyway.) A rank's gradient was
        not finite: each selection goes back into e (a layer that was not finite here was
        selected from e alone, so e is as it was); the results are zero."""
        for n, state, grad, encoded, finite in layers:
            self.codec.restore(state, *encoded)
        if layers:
            self.fault = torch.ones((), dtype=torch.bool, device=layers[0][2].device)
        return {n: torch.zeros_like(grad) for n, state, grad, *_ in layers}

    def gains(self) -> list[float]:
        """(Per-step policies.) This rank's squared norm of gradient plus error feedback over
        the step's layers (NaN if one was not finite here), then the squared norm each level of
        ``plan_step`` keeps: every level's from the selection at the widest one (a narrower
        level's is its top). One host read per step."""
        rows = []  # per layer: |g|^2, then the kept |g|^2 of each level
        for n in sorted(self._layers):
            state, grad, (values, _), finite = self._layers[n]
            row = [nan_unless(finite, state.g_sq)]  # a rank's fault shows in the reduced sums
            for level in self._step_levels:
                k = self.codec.level_k(level, state.residual.numel())
                row.append(state.kept_sq if k >= values.numel() else values.abs().topk(k).values.double().square().sum())
            rows.append(torch.stack(row))
        return torch.stack(rows).sum(0).tolist() if rows else [0.0] * (1 + len(self._step_levels))

    def _apply_choice(self, names: list[str], choice: Any) -> dict[str, torch.Tensor] | None:
        """The per-step policy's choice applied. Returns the results if the step's exchange is
        done (dense, or skipped), else None: the (trimmed) selections are to be sent."""
        layers = [(n, *self._layers[n]) for n in names]
        if choice is None:  # a rank's gradient was not finite
            return self._skip(layers)
        for n, state, grad, (values, indices), finite in layers:
            numel = state.residual.numel()
            before = self.codec.floats_sent(state)
            if choice == DENSE:
                self.codec.restore(state, values, indices)  # every rank's gradient was finite
            else:
                trimmed = self.codec.trim(state, values, indices, self.codec.level_k(choice, numel))
                self._layers[n] = (state, grad, trimmed, finite)
            state.level = choice
            self.counters.floats(n, (numel if choice == DENSE else self.codec.floats_sent(state)) - before)
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
            self._settle.append(lambda done, e=state.residual: e.masked_fill_(done, 0.0))
        return out

    def end_step(self, skipped: torch.Tensor) -> None:
        """Settle the step (``skipped``: 0-d bool, on the device): the selections sent go back
        into e where it is skipped; the dense layers' error feedback is finished where not."""
        for state, values, indices in self._undo:
            self.codec.restore(state, values, indices, where=skipped)
        for states, payload, ks, finite in self._undo_buckets:  # a non-finite layer's e is untouched
            self.codec.restore_many(states, payload, ks, skipped & finite)
        done = ~skipped
        for action in self._settle:
            action(done)
        if self.round1.active:  # only dense-level layers this step: nothing was waited for
            self.round1.results()
        self._begin()


def _payload(encoded: tuple[torch.Tensor, torch.Tensor], finite: torch.Tensor) -> torch.Tensor:
    """A layer's bytes to gather: its values (NaN if its gradient was not finite) and indices."""
    values, indices = encoded
    payload = bytes_of(values, indices)  # a new buffer: poisoned in place, on the device
    ops.fill_if_([payload[:values.numel() * values.element_size()].view(values.dtype)], ~finite, float("nan"))
    return payload


register(TopK, TopKExchange)
