"""PowerSGD's exchange: a P round and a Q round per bucket, pipelined with backward.

Per layer (codecs/powersgd.py does the math): P = M Q is averaged over ranks, orthogonalized,
Q^T = P^T M is averaged, and M_hat = P Q^T is the result. The rounds go by the buckets of
exchange/buckets.py, as DDP's ``powerSGD_hook`` does:

* a bucket's P allreduce starts when its last layer is encoded, during backward;
* its Q allreduce starts as soon as its P average is back: checked, without waiting, each
  time a gradient arrives, so the Q rounds of the first buckets travel while backward is
  still computing the last ones; once the step's last layer is in, the remaining P rounds are
  waited for in bucket order and their Q rounds started;
* at the first ``decompress`` each bucket's Q is waited for in order and its layers finished,
  so the last buckets' transfers overlap with the finishing math of the first ones.

Ranks see P averages arrive at different times, so they would start Q rounds in a different
order relative to the P rounds. The Q rounds therefore go on a separate lane of the channel
(``exchange.buckets.lane``: its own Gloo group, whose collectives pair by their own order,
always bucket order). A step issues 2 collectives per bucket.

A layer at ``levels.DENSE`` sends M = grad + e itself in its bucket's P round (one allreduce
with the others' P); its average is the result, it has no Q round, and its error feedback is
zero once the step is settled. At ``levels.DENSE16`` M goes in float16 through Horovod's
allreduce instead (the P round's buffer is float32), and the error feedback keeps what
float16 rounded away. A network-aware policy uses them for layers whose transfer hides
under backward (policies/network_aware.py).

The math goes a bucket at a time: a compressed layer's gradient is held until its bucket is
complete, then one call computes M = grad + e and P for every layer of the bucket, writing
the P round's payload (``codec.bucket.start_many``, exchange/buckets.py's ``DEFERRED``); one call
makes the bucket's Q^T payload once its P average is back (``middle_many``), one writes
every result (``finish_many``) and one settles every error feedback (``settle_many``): a
fixed number of kernel calls per bucket, whatever its layer count. Layers the bucket ops do
not take (float64, a rank above ``ops.MAX_BUCKET_RANK``, DENSE) go layer by layer, in the
same collectives.

Non-finite gradients: a rank sends NaN as P for such a layer (and does not fold that
gradient into e), so the fault shows in the averaged P that every rank reads. Nothing here
reads a tensor on the host: each bucket's averaged P gives a 0-d bool flag on the device,
every Q round is issued all the same, ``finish`` masks P and Q^T with the flag (M_hat zero,
Q kept), and ``end_step(skipped)`` makes e = M - M_hat only where the step went through
(else e keeps M = grad + e: nothing lost).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..codecs import PowerSGD
from ..flags import either, finite_flag
from ..levels import DENSE
from .buckets import DEFERRED, lane
from .base import Exchange
from .registry import register


class PowerSGDExchange(Exchange):
    """PowerSGD's exchange (module doc; the contract and the arguments: exchange/base.py). Its
    Q rounds go on the data plane's lane "q"."""

    round1_kind, round1_prefix = "allreduce", "acc.P"

    def __init__(self, codec, channel, **kwargs) -> None:
        self.q_lane = lane(channel, "q")
        self._finished: list[Any] = []  # layers finished this step: e = M - M_hat once it is not skipped
        self._finished_many: list[list[Any]] = []  # the same, a bucket's bucket-op layers at once
        self._ok: torch.Tensor | None = None  # no rank's gradient was non-finite (0-d bool), for those
        self._settle: list[Any] = []    # DENSE layers finished this step: e = 0 once it is not skipped
        self._sent_whole: list[tuple[Any, torch.dtype]] = []  # DENSE16 layers and the dtype they went in
        super().__init__(codec, channel, **kwargs)

    def _round1_encoder(self):
        return self._encode_bucket

    def _begin(self) -> None:
        super()._begin()
        self._layers: dict[str, tuple[Any, torch.Tensor]] = {}  # this step: name -> (state, where its result
                                                                 # goes: its gradient, or write_into's target)
        self._deferred: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # name -> (state, grad, finite)
        self._targets: dict[str, torch.Tensor] = {}  # deferred layers' results go here, not into grad
        self._many: set[str] = set()  # this step's layers that go through the bucket ops
        self._q: list[tuple[int, list[str], list[str], Any]] = []  # Q rounds issued: (bucket, bucket-op
                                                                    # layers, per-layer ones, handle)
        self._dense: dict[str, torch.Tensor] = {}               # DENSE layers' averaged M, once back
        self._next_q = 0        # the next bucket whose Q round is due, in layout order
        self._closed = False    # every P round issued

    def add(self, name: str, state, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        """Layer ``name``'s gradient and its finite flag (0-d bool): M = grad + e and P = M Q;
        its bucket's P round starts once the bucket is complete, and Horovod carries nothing
        for it (returns None). At DENSE16 returns M in float16, for Horovod to average."""
        if self.codec.sends_dense(state):
            self.round1.ready(name, None, grad)  # nothing in round 1 this step
            started = time.perf_counter()
            out = self.codec.flush_dense(state, grad, finite)
            self.seconds["compress"] += time.perf_counter() - started
            self._sent_whole.append((state, out.dtype))
            if self.round1.complete:
                self._close()
            return out
        if self.codec.bucket.encodes_many(state):  # encoded with the rest of its bucket (_encode_bucket)
            self._deferred[name] = (state, grad, finite)
            self.round1.ready(name, DEFERRED, grad)
        else:
            started = time.perf_counter()
            p = self.codec.start(state, grad, finite)
            self._layers[name] = (state, grad)
            self.seconds["compress"] += time.perf_counter() - started
            self.round1.ready(name, [p], grad)
        if self.round1.complete:  # the step's last layer: start everything that is left
            self._close()
        else:
            self._start_q_rounds(wait=False)
        return None

    def write_into(self, name: str, target: torch.Tensor) -> bool:
        """Write layer ``name``'s M_hat into ``target`` instead of the gradient ``add`` was
        given: a tensor of the same shape and dtype, whose values are never read (the DDP
        front end's view of the layer in DDP's bucket: the result needs no copy into it). The
        gradient is still what the layer is encoded from. Returns False for a layer not
        compressed this step (nothing changed)."""
        entry = self._deferred.get(name) or self._layers.get(name)
        if entry is None:
            return False
        grad = entry[1]
        if target.shape != grad.shape or target.dtype != grad.dtype:
            raise ValueError(f"write_into: {name!r} has a gradient of {tuple(grad.shape)} {grad.dtype}, "
                             f"got a target of {tuple(target.shape)} {target.dtype}")
        if name in self._deferred:  # not encoded yet: it still reads the gradient
            self._targets[name] = target
        else:
            self._layers[name] = (entry[0], target)
        return True

    def _encode_bucket(self, names: list[str]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Round 1's ``encode``: M and P of a complete bucket's deferred layers in one call;
        returns the P payload and each layer's P shape (n, r)."""
        started = time.perf_counter()
        states, grads, finites = zip(*(self._deferred.pop(n) for n in names))
        payload = self.codec.bucket.start_many(states, grads, torch.stack(finites))
        for n, state, grad in zip(names, states, grads):
            self._layers[n] = (state, self._targets.pop(n, grad))  # where its result goes
            self._many.add(n)
        self.seconds["compress"] += time.perf_counter() - started
        return payload, [(s.residual.shape[0], s.q.shape[1]) for s in states]

    def _close(self) -> None:
        if not self._closed:
            self.round1.launch_rest()
            self._closed = True
        self._start_q_rounds(wait=True)

    def _start_q_rounds(self, wait: bool) -> None:
        """Start the Q round of each issued bucket whose P average is back (every one, in
        order, if ``wait``)."""
        while self._next_q < self.round1.launched:
            index = self._next_q
            if not wait and not self.round1.arrived(index):
                return
            started = time.perf_counter()
            averages = self.round1.take(index)
            self.seconds["comm"] += time.perf_counter() - started
            self._next_q += 1
            if averages:  # a rank sent NaN: flagged here, masked in ``finish``
                packed = self.round1.packed(index)  # one check for the whole bucket, when it was sent packed
                ok = finite_flag(packed) if packed is not None else \
                    torch.stack([finite_flag(a[0]) for a in averages.values()]).all()
                self.fault = either(self.fault, ~ok)
            dense = [n for n in averages if self._layers[n][0].level == DENSE]
            for n in dense:  # M itself was averaged: that is the result, no Q round
                self._dense[n] = averages[n][0]
            many = [n for n in averages if n in self._many]
            single = [n for n in averages if n not in self._dense and n not in self._many]
            if not many and not single:
                continue
            started = time.perf_counter()
            qs = [self.codec.bucket.middle_many([self._layers[n][0] for n in many], [averages[n][0] for n in many])] \
                if many else []
            qs += self.codec.middle([self._layers[n][0] for n in single], [averages[n][0] for n in single])
            self.seconds["compress"] += time.perf_counter() - started
            name = f"acc.Q.b{index}.{len(many) + len(single)}"
            self._q.append((index, many, single, self.q_lane.allreduce_mean_async(qs, name=name)))

    def results(self, choice: Any = None) -> dict[str, torch.Tensor]:
        """Wait for the rest of the step's exchange; each layer's averaged gradient M_hat,
        shaped and typed like its gradient (zeros, for the compressed layers, if some rank's
        gradient was not finite)."""
        self._close()
        ok = None if self.fault is None else ~self.fault
        out: dict[str, torch.Tensor] = {}
        self._ok = ok
        for index, many, single, handle in self._q:
            started = time.perf_counter()
            try:
                q_avgs = self.q_lane.wait(handle)
            except TimeoutError as exc:
                names = many + single
                raise type(exc)(f"{exc} (Q round of bucket {index}: {', '.join(names[:4])}"
                                   f"{' ...' if len(names) > 4 else ''})") from exc
            self.seconds["comm"] += time.perf_counter() - started
            started = time.perf_counter()
            if many:  # the first tensor of the round: the bucket ops' Q^T, layer after layer
                states, grads = zip(*(self._layers[n] for n in many))
                shapes = [tuple(s.q.t().shape) for s in states]
                qts = [t.view(shape) for t, shape in zip(torch.split(q_avgs[0], [r * m for r, m in shapes]), shapes)]
                out.update(zip(many, self.codec.bucket.finish_many(states, qts, grads, ok)))
                self._finished_many.append(list(states))
                q_avgs = q_avgs[1:]
            for n, q in zip(single, q_avgs):
                state, grad = self._layers[n]
                out[n] = self.codec.finish(state, q, grad, ok)
                self._finished.append(state)
            self.seconds["compress"] += time.perf_counter() - started
        for n, m_avg in self._dense.items():
            state, grad = self._layers[n]
            out[n] = self.codec.finish_dense(state, m_avg, grad)
            self._settle.append(state)
        self.round1.begin_step()
        self._layers, self._q, self._dense, self._next_q, self._closed = {}, [], {}, 0, False  # ``fault`` stays
        self._deferred, self._targets, self._many = {}, {}, set()
        return out

    @torch.no_grad()
    def end_step(self, skipped: torch.Tensor) -> None:
        """Settle the step (``skipped``: 0-d bool, on the device): where it went through, each
        finished layer's e = M - M_hat and a DENSE layer's e = 0; where it is skipped, e keeps
        M. Before the engine zeroes the results: M_hat may live in the result's memory."""
        done = ~skipped
        for state in self._finished:
            self.codec.settle(state, done)
        if self._finished_many:  # the bucket ops' layers kept M where P was NaN: settle only if ok
            flag = done if self._ok is None else done & self._ok
            for states in self._finished_many:
                self.codec.bucket.settle_many(states, flag)
        for state in self._settle:  # a DENSE layer's e held M until now
            self.codec.settle_dense(state, done)
        for state, dtype in self._sent_whole:
            self.codec.settle_sent(state, dtype, done)
        self._finished, self._finished_many, self._settle, self._sent_whole, self._ok = [], [], [], [], None
        if self.round1.active:  # layers reported but no results taken (nothing to decompress)
            self.round1.results()
        self._begin()

    def abort(self) -> None:
        """Forget the step in flight (its collectives will never complete)."""
        for states in self._finished_many:  # e keeps M, as a skipped step's; drop the factors
            for state in states:
                state.factors = None
        self._finished, self._finished_many, self._settle, self._sent_whole, self._ok = [], [], [], [], None
        super().abort()


register(PowerSGD, PowerSGDExchange)
