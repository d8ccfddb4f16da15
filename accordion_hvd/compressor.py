"""The Horovod adapter: ``AccordionCompressor``, a Horovod ``Compressor``.

Horovod's ``DistributedOptimizer`` calls ``compress(grad)`` for every parameter as its
gradient becomes ready (during backward) and allreduces what it returns; in ``step()`` it
calls ``decompress(result, ctx)`` for each and sets the parameter's gradient to the output.
We use that contract as follows:

* layers that do not gain from compression (< 2 dims, small) are returned as they are and
  go through Horovod's ordinary allreduce;
* a compressed layer returns an empty tensor to Horovod and starts its own exchange on the
  channel: PowerSGD's P allreduce starts right away, overlapping with the rest of backward;
* at the first ``decompress`` of a step every layer's compress has run (Horovod submits
  the missing ones first), so the rest of the exchange is done once, for all layers
  together: PowerSGD's Q round is one grouped allreduce, TopK is one allgather of every
  layer's values and indices packed in a single buffer. Layers are always ordered by name,
  never by hook order, which differs between ranks.

Which parameter a ``compress(tensor)`` call is about: Horovod passes only the tensor, and
with torch 2.x gradients are new tensors every step. We read the parameter from Horovod's
calling frame (``_allreduce_grad_async(self, p)``) and take its name from the optimizer's
own ``_parameter_names``, the name Horovod itself uses for the collective. That is exact,
independent of hook order, and fails loudly if called from anywhere else.

Nothing may hang: at the first ``compress`` every rank allgathers its settings and all ranks
raise the same ``ValueError`` if they differ; every wait on the channel has a timeout.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch

from .codecs import PowerSGD, TopK
from .codecs._common import NORMAL, positive_number


_DENSE, _POWERSGD, _TOPK = "dense", "powersgd", "topk"
_CONFIG_BYTES = 1024  # the settings' canonical JSON, zero-padded: one fixed-size allgather


class _DefaultInstanceMethod:
    """Lets Horovod use the class itself as ``compression=``: on the class, the method binds
    to one default instance of it (created on first use, with the paper's defaults)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        if obj is None:
            obj = cls.default_instance()
        return self.fn.__get__(obj, cls)


class AccordionCompressor:
    """Adaptive gradient compression for ``hvd.DistributedOptimizer(..., compression=...)``.

    Args:
        codec: ``acc.PowerSGD(...)`` or ``acc.TopK(...)``; default ``PowerSGD(rank=1,
            critical_rank=4)``.
        eta: Accordion threshold on the relative change of a layer's gradient norm.
        interval: detection period in optimizer steps.
        policy: the level policy (the regime controller); ``None`` = Accordion.
        channel: the data plane (default: Horovod's collectives); tests pass a simulated one.

    Until the regime controller lands, every layer runs at the codec's normal level; levels
    can already be switched per layer with ``set_level``.
    """

    _default = None

    def __init__(self, codec: PowerSGD | TopK | None = None, *, eta: float = 0.5, interval: int = 100,
                 policy: Any = None, channel: Any = None) -> None:
        if codec is None:
            codec = PowerSGD(rank=1, critical_rank=4)
        if not isinstance(codec, (PowerSGD, TopK)):
            raise TypeError(f"codec must be acc.PowerSGD(...) or acc.TopK(...), got {type(codec).__name__}")
        self.codec = codec
        self.eta = float(positive_number("eta", eta))
        self.interval = positive_number("interval", interval, integer=True)
        self.policy = policy
        self._channel = channel
        self._kind = _POWERSGD if isinstance(codec, PowerSGD) else _TOPK
        self._layers: dict[str, Any] = {}            # name -> codec state
        self._pending: dict[str, Any] = {}           # this step: name -> exchange in flight
        self._results: dict[str, torch.Tensor] = {}  # this step: name -> decompressed gradient
        self._sent: dict[str, int] = {}              # cumulative floats sent, per layer
        self._dense: dict[str, int] = {}             # cumulative floats a dense allreduce sends
        self.steps = 0
        self._config_checked = False

    @classmethod
    def default_instance(cls) -> "AccordionCompressor":
        if cls.__dict__.get("_default") is None:
            cls._default = cls()
        return cls._default

    def __repr__(self) -> str:
        return f"AccordionCompressor({self.codec!r}, eta={self.eta}, interval={self.interval})"

    @property
    def channel(self):
        if self._channel is None:
            from .comm.horovod import HorovodChannel
            self._channel = HorovodChannel()
        return self._channel

    # --- the Horovod Compressor interface -----------------------------------------------------
    @_DefaultInstanceMethod
    def compress(self, tensor: torch.Tensor):
        """Called by Horovod for each gradient; returns (tensor to allreduce, context)."""
        return self.compress_named(_horovod_parameter_name(), tensor)

    @_DefaultInstanceMethod
    def decompress(self, tensor: torch.Tensor, ctx):
        """Called by Horovod with the allreduced tensor; returns the averaged gradient."""
        kind, name = ctx
        if kind == _DENSE:
            return tensor
        if self._pending:
            self._exchange()
        try:
            return self._results.pop(name)
        except KeyError:
            raise RuntimeError(f"AccordionCompressor: no result for {name!r}: decompress called twice, "
                               f"or without compress, in this step") from None

    # --- the same, with the parameter named explicitly (tests, other front ends) -------------
    @torch.no_grad()
    def compress_named(self, name: str, tensor: torch.Tensor):
        """``compress`` for the parameter ``name``. The gradient is consumed: it is folded into
        the error feedback, and a PowerSGD layer's result is written into its memory (what
        Horovod does with the result anyway). Pass a copy to keep the gradient."""
        self._check_config_once()
        if name in self._pending or name in self._results:
            raise RuntimeError(f"AccordionCompressor: {name!r} compressed twice in one step")
        dense_floats = tensor.numel()
        self._dense[name] = self._dense.get(name, 0) + dense_floats
        if not self.codec.compressible(tensor.shape) or not tensor.is_floating_point():
            self._sent[name] = self._sent.get(name, 0) + dense_floats
            return tensor, (_DENSE, name)
        state = self._layers.get(name)
        if state is None:
            state = self._layers[name] = self.codec.init_state(name, tensor, NORMAL)
        elif state.shape != tensor.shape:
            raise ValueError(f"AccordionCompressor: gradient of {name!r} changed shape from "
                             f"{tuple(state.shape)} to {tuple(tensor.shape)}")
        if self._kind == _TOPK and self.codec.sends_dense(state):
            self._sent[name] = self._sent.get(name, 0) + dense_floats
            return self.codec.flush_dense(state, tensor), (_DENSE, name)
        if self._kind == _POWERSGD:
            p = self.codec.start(state, tensor)
            handle = self.channel.allreduce_mean_async([p], name=f"acc.P.{name}")
            self._pending[name] = (handle, tensor)
        else:
            self._pending[name] = (self.codec.encode(state, tensor), tensor)
        self._sent[name] = self._sent.get(name, 0) + self.codec.floats_sent(state)
        return tensor.new_empty(0), (self._kind, name)

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        policy = "accordion" if self.policy is None else getattr(self.policy, "name", type(self.policy).__name__)
        return {**self.codec.config(), "eta": self.eta, "interval": self.interval, "policy": policy}

    def _check_config_once(self) -> None:
        """At the first compress, compare every rank's settings (one blocking allgather).

        Ranks started with different settings would issue collectives that never pair (a
        hang) or pair wrong tensors; instead every rank raises the same ValueError naming the
        settings that differ and which ranks have which value."""
        if self._config_checked:
            return
        mine = json.dumps(self.config(), sort_keys=True, default=repr).encode()
        if len(mine) > _CONFIG_BYTES:  # never in practice; still compared exactly
            mine = json.dumps({"config_sha256": hashlib.sha256(mine).hexdigest()}).encode()
        buffer = torch.zeros(_CONFIG_BYTES, dtype=torch.uint8)
        buffer[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
        gathered = self.channel.wait(self.channel.allgather_async(buffer, name="acc.config"))
        configs = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in gathered.view(-1, _CONFIG_BYTES)]
        if any(c != configs[0] for c in configs):
            raise ValueError(_config_mismatch_message(configs))
        self._config_checked = True

    @torch.no_grad()
    def _exchange(self) -> None:
        """Finish this step's exchange for every pending layer at once."""
        names = sorted(self._pending)
        pending, self._pending = self._pending, {}
        states = [self._layers[n] for n in names]
        if self._kind == _POWERSGD:
            p_avgs = [self.channel.wait(pending[n][0])[0] for n in names]
            qs = self.codec.middle(states, p_avgs)
            q_avg = self.channel.wait(self.channel.allreduce_mean_async(qs, name=f"acc.Q.{len(names)}"))
            for n, s, q in zip(names, states, q_avg):
                self._results[n] = self.codec.finish(s, q, pending[n][1])
        else:
            self._exchange_topk(names, states, pending)
        self.steps += 1

    def _exchange_topk(self, names, states, pending) -> None:
        # One allgather: every layer's values and int32 indices as bytes, in name order. Every
        # rank sends the same layout (k is a function of the level, equal on all ranks).
        parts = []
        for n in names:
            values, indices = pending[n][0]
            parts += [values.reshape(-1).view(torch.uint8), indices.view(torch.uint8)]
        packed = torch.cat(parts)
        gathered = self.channel.wait(self.channel.allgather_async(packed, name=f"acc.topk.{len(names)}"))
        size = self.channel.size
        per_rank = gathered.view(size, packed.numel())
        offset = 0
        for n, s in zip(names, states):
            v_bytes = s.k * s.residual.element_size()
            values = per_rank[:, offset:offset + v_bytes].contiguous().view(s.residual.dtype).reshape(-1)
            indices = per_rank[:, offset + v_bytes:offset + v_bytes + 4 * s.k].contiguous().view(torch.int32).reshape(-1)
            offset += v_bytes + 4 * s.k
            self._results[n] = self.codec.decode(s, values, indices, size, pending[n][1].dtype)

    # --- levels, statistics, state ------------------------------------------------------------
    def set_level(self, name: str, level: str) -> None:
        """Switch one compressed layer to the codec's 'normal' or 'critical' level."""
        if name not in self._layers:
            raise KeyError(f"AccordionCompressor: no compressed layer named {name!r} (known: {sorted(self._layers)})")
        if self._pending:
            raise RuntimeError("AccordionCompressor: levels can only change between steps")
        self.codec.set_level(self._layers[name], level)

    @_DefaultInstanceMethod
    def stats(self) -> dict:
        """Cumulative floats sent by this rank and what dense would have sent, with each
        compressed layer's current level."""
        return {
            "floats_sent": sum(self._sent.values()),
            "floats_dense": sum(self._dense.values()),
            "steps": self.steps,
            "layers": {n: {"floats_sent": self._sent[n], "floats_dense": self._dense[n],
                           "level": self._layers[n].level if n in self._layers else "dense"}
                       for n in sorted(self._dense)},
        }


def _config_mismatch_message(configs: list[dict]) -> str:
    """Which settings differ, and which ranks have which value (the same text on every rank)."""
    differences = []
    for key in sorted({k for c in configs for k in c}):
        values = [repr(c[key]) if key in c else "(not set)" for c in configs]
        if len(set(values)) == 1:
            continue
        ranks_by_value: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            ranks_by_value.setdefault(value, []).append(rank)
        differences.append(f"{key!r}: " + " vs ".join(
            f"{value} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            for value, ranks in ranks_by_value.items()))
    return ("AccordionCompressor: ranks were started with different compressor settings; every rank "
            "must create AccordionCompressor with the same codec and arguments. Differing: "
            + "; ".join(differences) + ".")


def _horovod_parameter_name(max_depth: int = 6) -> str:
    """The name of the parameter whose gradient Horovod is compressing (see module doc)."""
    frame = sys._getframe(2)  # skip this function and compress()
    param = None
    for _ in range(max_depth):
        if frame is None:
            break
        local = frame.f_locals
        if param is None and isinstance(local.get("p"), torch.Tensor):
            param = local["p"]
        owner = local.get("self")
        if param is not None and owner is not None and hasattr(owner, "_parameter_names"):
            name = owner._parameter_names.get(param)
            if name is not None:
                return name
        frame = frame.f_back
    raise RuntimeError(
        "AccordionCompressor.compress() must be called by horovod.torch.DistributedOptimizer "
        "(pass it as compression=...): it could not find which parameter this gradient belongs to. "
        "Use compress_named(name, tensor) to call it directly.")
