"""The Horovod adapter: ``AccordionCompressor``, a Horovod ``Compressor``.

Horovod's ``DistributedOptimizer`` calls ``compress(grad)`` for every parameter as its
gradient becomes ready (during backward) and allreduces what it returns; in ``step()`` it
calls ``decompress(result, ctx)`` for each and sets the parameter's gradient to the output.
We use that contract as follows:

* a compressed layer returns a placeholder (an empty tensor) to Horovod and goes into its
  codec's exchange (accordion_hvd/exchange/) on our own data plane (comm/gloo.py): by
  buckets of layers in the order their gradients become ready, each bucket's collectives
  starting as soon as the bucket is complete, overlapping with the rest of backward
  (PowerSGD: a P and a Q allreduce per bucket; TopK: a packed allgather of values and
  indices per bucket);
* layers that do not gain from compression (< 2 dims, small: biases, normalization layers)
  are averaged uncompressed, on the same data plane, by buckets too (``dense_round``,
  a lane of their own); they also return a placeholder. No gradient then reaches Horovod:
  its optimizer gets a handle that is its own result for a placeholder (horovod_seam.py),
  so a step costs no Horovod negotiation and no wait for its background loop's cycle.
  When Horovod's optimizer does not average over all ranks (``op`` other than
  ``hvd.Average``, a process set), those layers go through Horovod's allreduce instead;
  so do sparse and integer gradients, and a TopK layer at a level that sends it dense;
* the step's first ``decompress`` waits for what is left of the step's rounds. Results are
  handed out by name, never by hook order, which differs between ranks.

The adapter does not know the codec's rounds: it drives the exchange object with ``add``,
``results`` and ``end_step`` (commit, or roll back a skipped step), and keeps the Horovod
protocol and the step's bookkeeping.

Which parameter a ``compress(tensor)`` call is about: Horovod passes only the tensor, and
with torch 2.x gradients are new tensors every step. With ``named_parameters=`` (the same as
Horovod's optimizer gets) it is the parameter whose ``.grad`` is the tensor; without, it is
read from Horovod's calling frame (accordion_hvd/horovod_seam.py has both).

Levels: a regime controller (accordion_hvd/controller.py) watches each compressed layer's raw
gradient and the optimizer's learning rates; at the end of every step (when the step's last
``decompress`` has run) it lets the policy decide, from numbers reduced over all ranks, and
the new levels apply from the next step on every rank alike.

Nothing may hang: at the first ``compress`` every rank allgathers its settings and all ranks
raise the same ``ValueError`` if they differ; every wait on the channel has a timeout.

Non-finite gradients (NaN, Inf) skip the step on every rank, as AMP's GradScaler does: a
rank whose gradient of a compressed layer is not finite leaves that layer's error feedback
alone and sends NaN in its place, so the fault is in the exchanged data that every rank
reads (a dense layer's NaN is in Horovod's average anyway). A step with a fault ends with
every decompressed gradient zero on every rank, and ``step_skipped`` True; each layer's
gradient of that step stays in its error feedback (nothing is lost, nothing is poisoned).
All of it is decided on the device with 0-d bool flags (step_faults.py): the compressor
never reads a tensor on the host inside a step; reading ``step_skipped`` does.
Zero gradients still let momentum and weight decay move the parameters; for an exact skip,
step the optimizer only when ``step_skipped`` is False (README: "Non-finite gradients").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import weakref
from typing import Any

import torch

from . import checkpoint, ops
from .checkpoint import current_world
from .codecs import Codec, check_codec, default_codec
from .codecs.base import NETWORK, residual_dtype
from .flags import finite_flag
from .controller import RegimeController
from .comm.horovod import check_wait, install_polite_wait
from .comm.link import LinkMeasurement, describe, measure_link
from .exchange import BUCKET_BYTES, FIRST_BUCKET_BYTES, Round1, exchange_for, lane, make_exchange
from .horovod_seam import (GradientNames, bypass_allowed, find_optimizer, horovod_op_name, horovod_parameter,
                           install_bypass, placeholder, reduction_scale)
from .levels import DENSE, Level, check_level, positive_number
from .log import announce, levels_log
from .network_probe import NetworkProbe
from .policies import make_policy
from .step_faults import StepFaults


# Who carries a layer this step: Horovod's allreduce, our exchange, or our uncompressed round.
_DENSE, _COMPRESSED, _UNCOMPRESSED = "dense", "compressed", "uncompressed"
_CONFIG_BYTES = 1024  # the settings' canonical JSON, zero-padded: one fixed-size allgather
_STATE_FORMAT = "accordion_hvd.AccordionCompressor/2"  # /2: levels as [kind, factor], not strings
DATA_PLANE_ENV = "ACCORDION_DATA_PLANE"

log = logging.getLogger("accordion_hvd.compressor")

try:  # what hvd.DistributedOptimizer(compression=...) and code that checks for it expect
    from horovod.torch.compression import Compressor as HorovodCompressor
except ImportError:  # no Horovod: the DDP front end and the simulated world need none
    class HorovodCompressor:
        """Horovod's ``Compressor`` interface (``horovod.torch.compression``), when Horovod is
        not installed."""

        @staticmethod
        def compress(tensor):
            raise NotImplementedError

        @staticmethod
        def decompress(tensor, ctx):
            raise NotImplementedError


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


class AccordionCompressor(HorovodCompressor):
    """Adaptive gradient compression for ``hvd.DistributedOptimizer(..., compression=...)``: a
    Horovod ``Compressor`` whose ``compress``/``decompress`` are instance methods (the class
    itself also works as ``compression=``: it then uses one default instance).

    Args:
        codec: ``acc.PowerSGD(...)``, ``acc.TopK(...)``, or any codec of the protocol in
            accordion_hvd/codecs/base.py with a registered exchange; default ``PowerSGD(rank=16,
            critical_rank=32)`` (with ``policy=None``: the default configuration, below).
        eta: Accordion threshold on the relative change of a layer's gradient norm.
        interval: detection period in optimizer steps; ``None``: at each ``epoch_end()``.
        policy: ``None``: with the default codec, "link-gate" (16-bit dense where the job's
            own measured steps say compression does not pay, Accordion where it does:
            policies/link_gate.py); with a codec you give, Accordion when it has two levels,
            else static. Or "accordion", "static", "gravac", "network-aware", "link-gate", or an
            ``acc.policies.Policy``.
        accumulate: detect on the norm of each layer's gradient accumulated over the window
            (the paper; one float32 buffer per compressed layer) or, if False, on its
            per-step norms (no buffer).
        channel: the data plane (default: our own Gloo group over Horovod's ranks for CPU
            gradients, Horovod's collectives for GPU ones; see ``channel``); tests pass a
            simulated one.
        control: the control plane for the controller's reductions (default: MPI when its
            world is Horovod's, else the data plane's own Gloo group, else Horovod; see
            accordion_hvd/comm/control.py).
        bucket_cap_mb: megabytes of gradient per bucket of the first round (DDP's default,
            25; the first bucket closes at 1 MB or this, whichever is smaller, and the last
            layers up to that size form a bucket of their own: exchange/buckets.py). A bucket's
            collective starts as soon as all its layers are encoded (accordion_hvd/exchange/).
        named_parameters: the model's ``named_parameters()``, as given to
            ``hvd.DistributedOptimizer``: each gradient's name is then that of the parameter
            whose ``.grad`` it is. Without it, names are read from Horovod's calling frame
            (the one-line usage; accordion_hvd/horovod_seam.py).
        wait: how Horovod's optimizer waits for its collectives, installed process-wide when
            Horovod first calls ``compress``: "sleep" (default: poll with growing sleeps, at
            most 1 ms late, leaving the CPU to ranks still in backward) or "spin" (Horovod's
            own busy wait). $ACCORDION_HOROVOD_WAIT overrides it.
    """

    _default = None

    def __init__(self, codec: Codec | None = None, *, eta: float = 0.5, interval: int | None = 100,
                 policy: Any = None, accumulate: bool = True, channel: Any = None, control: Any = None,
                 bucket_cap_mb: float = BUCKET_BYTES / 2**20, named_parameters=None, wait: str = "sleep") -> None:
        if codec is None:
            codec = default_codec()
            policy = "link-gate" if policy is None else policy
        check_codec(codec)  # the engine's protocol, and an exchange registered for it
        exchange_for(codec)
        self.codec = codec
        self.eta = float(positive_number("eta", eta))
        self.interval = None if interval is None else positive_number("interval", interval, integer=True)
        self.policy = make_policy(policy, eta=self.eta, codec_adaptive=codec.adaptive)
        if self.policy.needs_two_levels and not codec.adaptive:
            raise ValueError(f"policy {self.policy!r} switches each layer between the codec's two levels, but {codec!r} "
                             f"has one; give the codec a gentler critical level (PowerSGD(rank=1, critical_rank=4), "
                             f"TopK(ratio=0.01, critical_ratio=0.1)) or pass policy='static'")
        if self.policy.per_step and not codec.measures_gain:
            raise ValueError(f"policy {self.policy!r} needs the TopK codec: it chooses a level every step from the "
                             f"compression gain, which only TopK measures; got {codec!r}")
        self.bucket_cap = int(positive_number("bucket_cap_mb", bucket_cap_mb) * 2**20)
        self.controller = RegimeController(self.policy, self.interval, accumulate=accumulate)
        self._probe = None                           # a network-aware policy's measurements
        if self.policy.uses_network:
            lacking = [name for name in NETWORK if not hasattr(codec, name)]
            if lacking:
                raise TypeError(f"policy {self.policy!r} measures the network, which needs the codec's "
                                f"{', '.join(NETWORK)} (accordion_hvd/codecs/base.py): {type(codec).__name__} lacks "
                                f"{', '.join(lacking)}")
            if not accumulate:
                raise ValueError(f"policy {self.policy!r} needs accumulate=True: it measures each level's error on "
                                 f"the layer's gradient accumulated over the window")
            self._probe = self.controller.probe = NetworkProbe(
                codec, states=lambda: self._layers, buckets=lambda: [b.names for b in (self.round1.buckets or [])],
                measure_link=self._window_link, dense_level=self.policy.dense_level,
                math_s=lambda: self.seconds["compress"])
        self._names = None if named_parameters is None else GradientNames(named_parameters)
        self.wait = check_wait(wait)
        self._met_horovod = False                    # compress() was called by Horovod: wait installed
        self._result_scale = 1.0                     # our averages times this: Horovod's op (size for Sum)
        self._front_end: dict = {}                   # the front end's settings every rank must share (Horovod's op)
        self._bypass = False                         # uncompressed layers travel on our data plane too
        self._channel = channel
        self._channel_given = channel is not None
        self._control = control
        self._control_given = control is not None
        self._optimizer = None                       # weakref to Horovod's optimizer, once seen
        self._owner = None                           # weakref to the model of a front end that bound it
        self._reported_lrs: list[float] | None = None
        self._in_step: set[str] = set()              # this step: layers compressed, not yet decompressed
        self.seconds = {"compress": 0.0, "comm": 0.0}  # cumulative: codec math, waiting on collectives
        self._link: LinkMeasurement | None = None    # the last measure_link() that found a link
        self._layers: dict[str, Any] = {}            # name -> codec state
        self._exchange = None                        # the codec's exchange (accordion_hvd/exchange/)
        self._dense_round = None                     # the uncompressed layers' round, when Horovod is bypassed
        self._device_type = "cpu"                    # of the first compressed gradient: picks the data plane
        self._sent: dict[str, int] = {}              # cumulative floats sent, per layer
        self._dense: dict[str, int] = {}             # cumulative floats a dense allreduce sends
        self._bytes: dict[str, int] = {}             # cumulative bytes on the wire, per layer (codec.wire)
        self._bytes_dense: dict[str, int] = {}       # cumulative bytes of the gradients themselves
        self._wire_cache: dict[tuple[str, str], int] = {}  # (layer, level) -> bytes per step (codec.wire)
        self.steps = 0
        self._faults = StepFaults()                  # non-finite gradients, on the device
        self._config_checked = False
        self._loaded_owner = None                    # (rank, world size) of a state loaded before both were known
        self._said_unused: frozenset[str] = frozenset()  # the unused layers last logged
        self._said_at_window = 0                     # the detection window they were looked at
        self._new_step()

    def _new_step(self) -> None:
        """What one step keeps until its end, to settle it or to skip it."""
        self._outputs: list[torch.Tensor] = []  # every gradient returned to Horovod
        self._results: dict[str, torch.Tensor] | None = None  # the step's rounds', once waited for
        self._rounds: set[str] = set()           # which of our rounds carry layers this step
        self._dtypes: dict[str, torch.dtype] = {}  # an uncompressed layer's gradient dtype (its round may promote)
        self._lr_gather = None                   # every rank's learning rates, in flight

    @classmethod
    def default_instance(cls) -> "AccordionCompressor":
        if cls.__dict__.get("_default") is None:
            cls._default = cls()
        return cls._default

    def __repr__(self) -> str:
        return f"AccordionCompressor({self.codec!r}, policy={self.policy!r}, interval={self.interval})"

    @property
    def channel(self):
        """The data plane: what the compressor was given, else our own Gloo group over
        Horovod's ranks for CPU gradients (no negotiation cycle: comm/gloo.py) and Horovod's
        collectives for GPU ones; $ACCORDION_DATA_PLANE ("gloo" or "horovod") overrides."""
        if self._channel is None:
            choice = os.environ.get(DATA_PLANE_ENV, "auto").strip().lower() or "auto"
            if choice not in ("auto", "gloo", "horovod"):
                raise ValueError(f"{DATA_PLANE_ENV} must be 'auto', 'gloo' or 'horovod', got {choice!r}")
            if choice == "gloo" or (choice == "auto" and self._device_type == "cpu"):
                from .comm.gloo import GlooChannel
                self._channel = GlooChannel()
            else:
                from .comm.horovod import HorovodChannel
                self._channel = HorovodChannel()
        return self._channel

    @property
    def exchange(self):
        """The codec's exchange on the data plane (built at the first compressed layer)."""
        if self._exchange is None:
            self._exchange = make_exchange(self.codec, self.channel, first_cap=min(FIRST_BUCKET_BYTES, self.bucket_cap),
                                           cap=self.bucket_cap, before_last=self._gather_learning_rates,
                                           seconds=self.seconds, control=lambda: self.control,
                                           per_step=self.controller if self.policy.per_step else None,
                                           sent=self._sent)
        return self._exchange

    @property
    def dense_round(self) -> Round1:
        """The round of the uncompressed layers, when Horovod is bypassed: one averaging
        allreduce per bucket, on the data plane's "dense" lane (its buckets fill at other
        times than the compressed layers' ones; their layout is agreed separately)."""
        if self._dense_round is None:
            self._dense_round = Round1(lane(self.channel, "dense"), "allreduce", "acc.D",
                                       first_cap=min(FIRST_BUCKET_BYTES, self.bucket_cap), cap=self.bucket_cap,
                                       layers="uncompressed")
        return self._dense_round

    @property
    def round1(self) -> Round1:
        """The exchange's first round (its agreed bucket layout)."""
        return self.exchange.round1

    @property
    def control(self):
        if self._control is None:
            make = getattr(self.channel, "control_plane", None)  # the simulated world has its own
            if make is not None:
                self._control = make()
            else:
                from .comm.control import control_plane
                self._control = control_plane("auto")
        return self._control

    def bind(self, owner, *, channel, control, optimizer=None) -> None:
        """Attach this compressor to a front end other than Horovod's optimizer (the DDP hook:
        accordion_hvd/ddp.py): its data plane, control plane and, if given, the optimizer
        whose learning rates the policy reads. One compressor serves one model."""
        bound = self._owner() if self._owner is not None else None
        if bound is not None and bound is not owner:
            raise ValueError("AccordionCompressor: this compressor is already bound to another model; create one "
                             "compressor per model (its error feedback and levels belong to that model's layers)")
        if self._layers or self._in_step:
            raise ValueError("AccordionCompressor: bind it before its first step (it has compressed layers already)")
        self._owner = weakref.ref(owner)
        self._channel, self._channel_given = channel, True
        self._control, self._control_given = control, True
        self._exchange = self._dense_round = None
        if optimizer is not None:
            self._optimizer = weakref.ref(optimizer)

    # --- the Horovod Compressor interface -----------------------------------------------------
    @_DefaultInstanceMethod
    def compress(self, tensor: torch.Tensor):
        """Called by Horovod for each gradient; returns (tensor to allreduce, context)."""
        optimizer = None
        if self._names is None:  # from Horovod's frames; raises when not called by Horovod's optimizer
            name, optimizer = horovod_parameter()
        if not self._met_horovod:  # an op we cannot honour is refused before the gradient is looked at
            if self._names is not None:
                optimizer = find_optimizer()
            if isinstance(tensor, torch.Tensor) and not self._config_checked:
                self._device_type = tensor.device.type  # picks the data plane the check runs on
            self._meet_horovod(optimizer)
        if self._names is not None:
            name = self._names.name_of(tensor)
        if self._optimizer is None and optimizer is not None:
            self._optimizer = weakref.ref(optimizer)
        elif self._optimizer is None and self.policy.reacts_to_lr and self._reported_lrs is None and self.steps == 0 \
                and not self._in_step:
            log.warning("AccordionCompressor: Horovod's optimizer was not found in the calling frames, so the policy "
                        "does not see learning-rate decreases; call compression.report_lr(lr) after each change")
        return self._compress(name, tensor, bypass=self._bypass)

    def _meet_horovod(self, optimizer) -> None:
        """The first ``compress`` from Horovod's optimizer: honour its ``op`` or refuse it
        (horovod_seam.reduction_scale: before any collective, so a refusal never leaves a
        rank waiting), agree on the settings, Horovod's op among them, with every rank, and
        take the uncompressed gradients off Horovod."""
        self._result_scale = reduction_scale(optimizer)
        # Kept: every later check (a world re-formed by Elastic) compares it again, also with a
        # worker that joined and meets Horovod for the first time.
        self._front_end = {"horovod_op": None if optimizer is None else horovod_op_name(optimizer)}
        self._check_config_once()
        install_polite_wait(self.wait)  # first: it also makes Horovod's optimizer read bypass handles
        install_bypass()
        why_not = bypass_allowed(optimizer)
        self._bypass = why_not is None
        if why_not:
            log.info("AccordionCompressor: uncompressed gradients go through Horovod's allreduce: %s", why_not)
        self._met_horovod = True

    @_DefaultInstanceMethod
    def decompress(self, tensor: torch.Tensor, ctx):
        """Called by Horovod with the allreduced tensor; returns the averaged gradient."""
        if ctx is None:  # a sparse gradient that Horovod reduced itself (sparse_as_dense=False): never ours
            return tensor
        kind, name = ctx
        if name not in self._in_step:
            raise RuntimeError(f"AccordionCompressor: no result for {name!r}: decompress called twice, "
                               f"or without compress, in this step")
        if kind != _DENSE:
            if self._results is None:  # the step's first: wait for the step's rounds
                self._results = self._collect()
            tensor = self._results.pop(name)
        elif name in self._dtypes:  # a layer sent whole in 16 bits
            tensor = tensor.to(self._dtypes[name])
        if kind != _DENSE and self._result_scale != 1.0 and tensor.is_floating_point():
            # op=hvd.Sum: our rounds average. A new tensor: PowerSGD's settling reads the
            # average it wrote (the error feedback is M - M_hat, whatever the op).
            tensor = tensor * self._result_scale
        if kind != _COMPRESSED and tensor.is_floating_point():
            self._faults.seen(~finite_flag(tensor))  # an average: the same on every rank
        self._outputs.append(tensor)
        state = self._layers.get(name)  # (a compressed layer's, whole at DENSE16 or not)
        if state is not None:  # its level is final now (a per-step policy chose it before the results)
            self._bytes[name] = self._bytes.get(name, 0) + self._wire_bytes(state)
        self._in_step.discard(name)
        if not self._in_step:  # the step's last layer: the step is over on this rank
            self._end_step()
        return tensor

    def _wire_bytes(self, state) -> int:
        """Bytes a compressed layer puts on the wire per step at its level (``codec.wire``),
        worked out once per layer and level: not every step."""
        key = (state.name, str(state.level))
        if key not in self._wire_cache:
            wire = self.codec.wire(state.shape, state.level, state.residual.element_size())
            self._wire_cache[key] = sum(nbytes for _, nbytes in wire)
        return self._wire_cache[key]

    def _collect(self) -> dict[str, torch.Tensor]:
        """Wait for the step's rounds, in the same order on every rank (the first layer that
        Horovod decompresses differs between ranks; a round's first step agrees on its layout
        with blocking collectives, which must pair)."""
        results: dict[str, torch.Tensor] = {}
        if _UNCOMPRESSED in self._rounds:
            for name, (average,) in self.dense_round.results().items():
                dtype = self._dtypes[name]
                results[name] = average if average.dtype == dtype else average.to(dtype)
        if _COMPRESSED in self._rounds:
            results.update(self.exchange.results())
            self._faults.seen(self.exchange.fault)
            for flag, message in self.exchange.errors:
                self._faults.error(flag, message)
        return results

    # --- the same, with the parameter named explicitly (tests, other front ends) -------------
    def compress_named(self, name: str, tensor: torch.Tensor):
        """``compress`` for the parameter ``name``. The gradient is consumed: it is folded into
        the error feedback, and a PowerSGD layer's result is written into its memory (what
        Horovod does with the result anyway). Pass a copy to keep the gradient. An
        uncompressed layer is returned as it is, for the caller to average."""
        return self._compress(name, tensor, bypass=False)

    def write_result_into(self, name: str, target: torch.Tensor) -> bool:
        """Ask that ``name``'s result this step be written into ``target`` (same shape and
        dtype as the gradient given to ``compress_named``; its values are not read): a
        front end whose framework wants the result in another buffer saves the copy. Returns
        whether the codec's exchange took it (PowerSGD's does, for a layer it compresses this
        step). The result may still come in another tensor where the codec does not write it
        into the gradient's memory: copy it unless it is ``target``."""
        write = getattr(self._exchange, "write_into", None)
        if write is None or name not in self._in_step:
            return False
        return write(name, target)

    @torch.no_grad()
    def _compress(self, name: str, tensor: torch.Tensor, bypass: bool):
        """``compress_named``; with ``bypass``, uncompressed floating-point layers go into
        ``dense_round`` and return a placeholder too (see module doc)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"AccordionCompressor: the gradient of {name!r} must be a torch.Tensor, "
                            f"got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"AccordionCompressor: the gradient of {name!r} is on device {tensor.device}; "
                             f"expected a CPU or CUDA tensor")
        if not self._config_checked:
            self._device_type = tensor.device.type
        self._check_config_once()
        if name in self._in_step:
            raise RuntimeError(f"AccordionCompressor: {name!r} compressed twice in one step")
        compressed = (tensor.layout == torch.strided and tensor.is_floating_point()
                      and self.codec.compressible(tensor.shape))  # else (sparse, integer, complex, small) as it is
        state = self._layers.get(name) if compressed else None
        if state is not None:
            _check_same_layer(name, state, tensor)
        self._in_step.add(name)
        dense_floats = tensor.numel()
        self._dense[name] = self._dense.get(name, 0) + dense_floats
        whole = dense_floats * tensor.element_size()
        self._bytes_dense[name] = self._bytes_dense.get(name, 0) + whole
        if not compressed:
            self._sent[name] = self._sent.get(name, 0) + dense_floats
            self._bytes[name] = self._bytes.get(name, 0) + whole
            if not (bypass and tensor.layout == torch.strided and tensor.is_floating_point()):
                return tensor, (_DENSE, name)
            self._rounds.add(_UNCOMPRESSED)
            self._dtypes[name] = tensor.dtype
            self.dense_round.ready(name, [tensor], tensor)  # starts its bucket's allreduce once the bucket is full
            return placeholder(tensor), (_UNCOMPRESSED, name)
        started = time.perf_counter()
        if state is None:
            state = self._layers[name] = self.codec.init_state(name, tensor, self.controller.level_of(name))
        if self._probe is not None:
            self._probe.mark(name)
        finite = finite_flag(tensor)  # on the device: masks, never read here
        self.controller.observe(name, tensor, finite=finite)  # before the codec consumes the gradient
        self._faults.local(name, finite)
        self.seconds["compress"] += time.perf_counter() - started  # the exchange counts its own
        dense = self.exchange.add(name, state, tensor, finite)  # starts its bucket's round once the bucket is full
        self._sent[name] = self._sent.get(name, 0) + (dense_floats if dense is not None
                                                      else self.codec.floats_sent(state))
        if dense is not None:  # sent whole this step (TopK keeping half or more, DENSE16): Horovod carries it
            if dense.dtype != tensor.dtype:  # in 16 bits: back to the gradient's dtype in decompress
                self._dtypes[name] = tensor.dtype
            return dense, (_DENSE, name)
        self._rounds.add(_COMPRESSED)
        return placeholder(tensor), (_COMPRESSED, name)

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        return {**self.codec.config(), "eta": self.eta, **self.controller.config(),
                "bucket_cap_mb": self.bucket_cap / 2**20}  # every rank must cut the same buckets

    def _check_config_once(self) -> None:
        """At the first compress, compare every rank's settings (one blocking allgather), with
        the front end's own (``_front_end``: Horovod's ``op``), which must agree too.

        Ranks started with different settings would issue collectives that never pair (a
        hang) or pair wrong tensors; instead every rank raises the same ValueError naming the
        settings that differ and which ranks have which value."""
        if self._config_checked:
            return
        self._check_loaded_owner()
        mine = json.dumps({**self.config(), **self._front_end}, sort_keys=True, default=repr).encode()
        if len(mine) > _CONFIG_BYTES:  # never in practice; still compared exactly
            mine = json.dumps({"config_sha256": hashlib.sha256(mine).hexdigest()}).encode()
        buffer = torch.zeros(_CONFIG_BYTES, dtype=torch.uint8)
        buffer[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
        gathered = self.channel.wait(self.channel.allgather_async(buffer, name="acc.config"))
        configs = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in gathered.view(-1, _CONFIG_BYTES)]
        if any(c != configs[0] for c in configs):
            raise ValueError(_config_mismatch_message(configs))
        self._config_checked = True

    def _check_loaded_owner(self) -> None:
        """A state loaded before this process knew its rank: whose it is, now that it does."""
        owner, self._loaded_owner = self._loaded_owner, None
        if owner is None:
            return
        # The same rule as at load time (checkpoint.own_part): raises for another rank's state.
        _, keep = checkpoint.own_part({"rank": owner[0], "world_size": owner[1]},
                                      (self.channel.rank, self.channel.size), error_feedback=True)
        if not keep:
            for layer in self._layers.values():
                layer.residual.zero_()

    def _wait(self, handle):
        started = time.perf_counter()
        try:
            return self.channel.wait(handle)
        finally:
            self.seconds["comm"] += time.perf_counter() - started

    def _end_step(self) -> None:
        """Every rank, once per optimizer step, after the step's last decompress: skip or
        settle the step, count it and let the controller switch levels for the next one."""
        self._faults.rank = self.channel.rank
        device = self._outputs[0].device if self._outputs else torch.device("cpu")
        skipped = self._faults.settle(self.steps + 1, device)  # 0-d bool; the host reads it later, if at all
        if self._exchange is not None:  # before the zeroing: PowerSGD's settling reads its results
            self._exchange.end_step(skipped=skipped)
        # A skipped step's results are zero (they may hold NaN), decided on the device.
        ops.fill_if_([out for out in self._outputs if out.layout == torch.strided], skipped)
        sparse = [out for out in self._outputs if out.layout != torch.strided]
        if sparse and bool(skipped):  # a sparse gradient (passed through as it is): the one host read, for it alone
            for out in sparse:
                out.zero_()
        lr_gather = self._lr_gather
        self._new_step()
        if self._names is not None:
            self._names.end_step()
        self.steps += 1
        note_step = getattr(self._channel, "note_step", None)  # where this rank is, for a failure's diagnosis
        if note_step is not None:
            note_step(self.steps)
        if self._probe is not None:
            self._probe.end_step()
        lrs = self._learning_rates()
        gathered = None if lr_gather is None else self._wait(lr_gather).view(self.channel.size, -1).numpy()
        changed = self.controller.end_step(self.control, sorted(self._layers), lrs, gathered=gathered)
        self._apply_levels(changed)
        # Read the outcomes the device is done with (on the CPU: this step's): log skipped steps,
        # and fail on an error flag; on a GPU a later step reads this one's, never waiting.
        self._faults.poll(wait=False)

    def _gather_learning_rates(self) -> None:
        """Start gathering every rank's learning rates for the controller's per-step check,
        right before the step's last collective, in flight together with it, so the check
        costs no round trip of its own (else it is one control collective at the end of the
        step, as in steps without an exchange). It is issued after every round-1 bucket, so
        every rank issues its collectives in the same order."""
        lrs = self._learning_rates() if self.policy.reacts_to_lr else None
        if lrs is not None:
            self._lr_gather = self.channel.allgather_async(torch.tensor(lrs, dtype=torch.float64),
                                                           name=f"acc.lrs.{len(lrs)}")

    def _learning_rates(self) -> list[float] | None:
        if self._reported_lrs is not None:
            return self._reported_lrs
        optimizer = self._optimizer() if self._optimizer is not None else None
        return None if optimizer is None else [float(g["lr"]) for g in optimizer.param_groups]

    def _apply_levels(self, changed: dict[str, Level] | None) -> None:
        applied: dict[str, list[str]] = {}
        for name, level in (changed or {}).items():
            if name in self._layers:
                self.codec.set_level(self._layers[name], level)
                applied.setdefault(str(level), []).append(name)
        if applied and self.channel.rank == 0:  # every rank switches alike: one line for the job
            unused = self.controller.unused()
            parts = []
            for level, names in sorted(applied.items()):
                names = [n for n in names if n not in unused]  # a layer with no gradient: said once, below
                if names:
                    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                    parts.append(f"{len(names)} layer{'s' if len(names) > 1 else ''} to {level} ({shown})")
            if parts:
                announce(levels_log, "after step %d: %s", self.steps, "; ".join(parts))
        self._say_unused()

    def _say_unused(self) -> None:
        """Once per new set: the layers that have had no gradient on any rank in any window
        (looked at once per detection window, when the window norms change)."""
        if self.controller.windows == self._said_at_window:
            return
        self._said_at_window = self.controller.windows
        unused = self.controller.unused()
        if unused and unused != self._said_unused and self.channel.rank == 0:
            announce(levels_log, "after step %d: %d layer%s had no gradient on any rank in any detection window so far "
                     "(%s); stats() marks them unused", self.steps, len(unused), "s" if len(unused) > 1 else "",
                     ", ".join(sorted(unused)[:4]) + (" ..." if len(unused) > 4 else ""))
        self._said_unused = unused

    # --- what users call between steps ---------------------------------------------------------
    @_DefaultInstanceMethod
    def epoch_end(self) -> None:
        """An explicit detection point, on every rank at the same point (used when the
        compressor was created with ``interval=None``; otherwise ignored with a warning)."""
        self._between_steps("epoch_end")
        self._apply_levels(self.controller.epoch_end(self.control, sorted(self._layers)))

    @_DefaultInstanceMethod
    def report_lr(self, lr) -> None:
        """Tell the controller the learning rate(s) (a number or one per param group), for
        front ends where it cannot read them from Horovod's optimizer; overrides that."""
        values = [lr] if not isinstance(lr, (list, tuple)) else list(lr)
        for v in values:
            positive_number("lr", v)
        self._reported_lrs = [float(v) for v in values]

    @_DefaultInstanceMethod
    def measure_link(self) -> LinkMeasurement:
        """The network's latency and bandwidth, fitted to the times of this compressor's own
        collectives since the last call (comm/link.py), the same on every rank. A collective
        of the control plane: call it on every rank, between steps. A window that determines
        no link (nothing exchanged, one message size) returns ``link`` None and the reason,
        and the last link stays in ``stats()["link"]``."""
        self._between_steps("measure_link")
        measured = measure_link(self.channel, self.control)
        if measured.link is None:
            log.info("rank %d: no link measured at step %d: %s", self.channel.rank, self.steps, measured.reason)
        else:
            log.info("rank %d: link at step %d: %s (%d collectives)", self.channel.rank, self.steps,
                     describe(measured.link), measured.collectives)
            self._link = measured
        return measured

    def _window_link(self):
        """For the network-aware policy at a window's end: this window's link, else the last
        one measured (every rank holds the same)."""
        measured = self.measure_link()
        if measured.link is not None:
            return measured.link
        return self._link.link if self._link is not None else None

    def abort_step(self) -> None:
        """Drop the step in flight, as when Horovod Elastic interrupts a step because a worker
        failed (its exchanges will never complete). Some layers may have folded this step's
        gradient into their error feedback already: restore a ``state_dict()`` taken between
        steps next, as ``accordion_hvd.elastic`` does."""
        self._in_step.clear()
        if self._exchange is not None:
            self._exchange.abort()
        if self._dense_round is not None:
            self._dense_round.begin_step()
        if self._names is not None:
            self._names.forget_step()
        if self._probe is not None:
            self._probe.forget_step()
        self._faults.forget()
        self._new_step()

    def world_changed(self) -> None:
        """Horovod re-formed the world (Elastic): forget collectives in flight, rebuild the
        control plane for the new ranks, and compare every rank's settings again at the next
        compress (a worker that joined has not been checked yet)."""
        self._config_checked = False
        self._exchange = self._dense_round = None  # layouts are agreed again by the new world, on its channel
        if not self._control_given:
            self._control = None
        if not self._channel_given:  # ours is a group of the old world's ranks
            close = getattr(self._channel, "close", None)
            if close is not None:
                close()
            self._channel = None
        forget = getattr(self._channel, "forget_handles", None)
        if forget is not None:
            forget()

    def _between_steps(self, what: str) -> None:
        if self._in_step:
            raise RuntimeError(f"AccordionCompressor: {what} must be called between optimizer steps "
                               f"(layers still in flight: {sorted(self._in_step)[:3]})")

    # --- levels, statistics, state ------------------------------------------------------------
    def set_level(self, name: str, level: Level) -> None:
        """Switch one compressed layer to a level (``acc.levels.NORMAL``, ``CRITICAL``, ...)."""
        check_level("level", level)
        if name not in self._layers:
            raise KeyError(f"AccordionCompressor: no compressed layer named {name!r} (known: {sorted(self._layers)})")
        self._between_steps("set_level")
        self.codec.set_level(self._layers[name], level)
        self.controller.levels[name] = level

    @property
    def step_skipped(self) -> bool:
        """Whether the last step was skipped: some rank's gradient was not finite, so every
        result of the step is zero and the error feedback kept its gradient. Step the
        optimizer only when it is False. Reading it waits for the device (on a GPU, one small
        copy), as a GradScaler's skip check does; the compressor itself never waits."""
        return self._faults.last_skipped

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reading it waits for the device)."""
        return self._faults.count

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._faults.count = value

    @_DefaultInstanceMethod
    def stats(self) -> dict:
        """Cumulative floats sent by this rank and what dense would have sent, the same in
        bytes on the wire (``bytes_sent``: what each layer's collectives carried per rank at
        its level, ``codec.wire``; ``bytes_dense``: the gradients' own bytes), with each
        layer's current level ("dense" for a layer never compressed) and whether it is
        ``unused`` (no gradient on any rank in any detection window so far: known to the
        policies that measure norms, Accordion's and the network-aware one), and the last
        link ``measure_link`` measured."""
        unused = self.controller.unused()
        return {
            "floats_sent": sum(self._sent.values()),
            "floats_dense": sum(self._dense.values()),
            "bytes_sent": sum(self._bytes.values()),
            "bytes_dense": sum(self._bytes_dense.values()),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "layers": {n: {"floats_sent": self._sent[n], "floats_dense": self._dense[n],
                           "bytes_sent": self._bytes.get(n, 0), "bytes_dense": self._bytes_dense.get(n, 0),
                           "level": str(self._layers[n].level if n in self._layers else DENSE),
                           "unused": n in unused}
                       for n in sorted(self._dense)},
            "link": None if self._link is None else {
                "latency_s": self._link.link.alpha, "bytes_per_s": 1.0 / self._link.link.beta,
                "collectives": self._link.collectives},
        }

    # --- checkpoints ------------------------------------------------------------------------
    @_DefaultInstanceMethod
    def state_dict(self) -> dict:
        """Everything needed to resume bit for bit: each layer's codec state (error feedback,
        warm-start Q, level), the controller's and policy's state, the counters. Plain Python
        values and tensors (picklable, ``torch.save``-able). Call it between steps."""
        self._between_steps("state_dict")
        world = current_world(self._channel)
        return {"format": _STATE_FORMAT, "config": self.config(), "steps": self.steps,
                "rank": None if world is None else world[0], "world_size": None if world is None else world[1],
                "skipped_steps": self.skipped_steps,
                "sent": dict(self._sent), "dense": dict(self._dense), "seconds": dict(self.seconds),
                "bytes": dict(self._bytes), "bytes_dense": dict(self._bytes_dense),
                "reported_lrs": self._reported_lrs,
                "layers": {n: self.codec.state_to_dict(s) for n, s in sorted(self._layers.items())},
                "controller": self.controller.state_dict()}

    @_DefaultInstanceMethod
    def gather_state_dict(self) -> dict | None:
        """Every rank's ``state_dict()`` at rank 0, as one *world state* for one checkpoint
        file (None on the other ranks). Collective: call it on every rank, between steps.
        Every rank then loads the saved file with ``load_state_dict`` and takes its own part
        (accordion_hvd/checkpoint.py)."""
        return checkpoint.gather(self.channel, self.state_dict())

    @_DefaultInstanceMethod
    def load_state_dict(self, state: dict, error_feedback: bool = True) -> None:
        """Restore a ``state_dict()`` taken from a compressor with the same settings (else a
        ValueError naming the settings that differ; nothing is changed then), or this rank's
        part of a ``gather_state_dict()``.

        A state records whose it is: another rank's state (same number of ranks) is refused
        with a ValueError naming both ranks, since its error feedback is that rank's own
        unsent gradient; a state of a job with another number of ranks loads with the error
        feedback from zero, and a warning. With ``error_feedback=False`` every layer's error
        feedback starts from zero, whoever saved it."""
        self._between_steps("load_state_dict")
        world = current_world(self._channel)
        state, error_feedback = checkpoint.own_part(state, world, error_feedback)
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else None
            raise ValueError(f"AccordionCompressor.load_state_dict: not an AccordionCompressor state_dict of this "
                             f"version (expected a dict with format={_STATE_FORMAT!r}, got format={found!r})")
        mine = self.config()
        theirs = state.get("config")
        if not isinstance(theirs, dict):
            raise ValueError("AccordionCompressor.load_state_dict: the state_dict has no 'config' dict (corrupted?)")
        if json.dumps(theirs, sort_keys=True, default=repr) != json.dumps(mine, sort_keys=True, default=repr):
            differing = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError("AccordionCompressor.load_state_dict: the checkpoint was made with different settings: "
                             + "; ".join(f"{k}: checkpoint {theirs.get(k)!r}, this compressor {mine.get(k)!r}"
                                         for k in differing))
        # Read everything before changing anything: a malformed state_dict leaves this
        # compressor as it was.
        before = self.controller.state_dict()
        try:
            layers = {str(n): self.codec.state_from_dict(str(n), d) for n, d in state["layers"].items()}
            for n, layer in layers.items():
                if not bool(torch.isfinite(layer.residual).all()):
                    raise ValueError(f"the error feedback of {n!r} is not finite")
            counters = (int(state["steps"]), int(state.get("skipped_steps", 0)),
                        {str(k): int(v) for k, v in state["sent"].items()},
                        {str(k): int(v) for k, v in state["dense"].items()},
                        {str(k): float(v) for k, v in state["seconds"].items()},
                        {str(k): int(v) for k, v in state.get("bytes", {}).items()},  # absent before they existed
                        {str(k): int(v) for k, v in state.get("bytes_dense", {}).items()})
            reported = state["reported_lrs"]
            self.controller.load_state_dict(state["controller"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            self.controller.load_state_dict(before)
            what = f"missing entry {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"AccordionCompressor.load_state_dict: malformed state_dict ({what}); "
                             f"nothing was loaded") from exc
        if not error_feedback:
            for layer in layers.values():
                layer.residual.zero_()
        self._layers = layers
        steps, skipped, sent, dense, seconds, nbytes, bytes_dense = counters
        self.steps, self.skipped_steps = steps, skipped
        # In place: an exchange built before this load holds these very dicts and counts into them.
        for live, loaded in ((self._sent, sent), (self._dense, dense), (self.seconds, seconds), (self._bytes, nbytes),
                             (self._bytes_dense, bytes_dense)):
            live.clear()
            live.update(loaded)
        self._reported_lrs = reported
        # Whose error feedback this is, checked against the data plane's rank at the first
        # step when no world was known at load time (loaded before hvd.init()).
        self._loaded_owner = (state.get("rank"), state.get("world_size")) if error_feedback and world is None else None


def _check_same_layer(name: str, state, tensor: torch.Tensor) -> None:
    """A layer keeps its shape, device and dtype from step to step (its state was made for them)."""
    if state.shape != tensor.shape:
        raise ValueError(f"AccordionCompressor: gradient of {name!r} changed shape from "
                         f"{tuple(state.shape)} to {tuple(tensor.shape)}")
    if state.residual.device != tensor.device or state.residual.dtype != residual_dtype(tensor.dtype):
        raise ValueError(f"AccordionCompressor: gradient of {name!r} moved from {state.residual.device} "
                         f"({state.residual.dtype} error feedback) to {tensor.device} ({tensor.dtype}); "
                         f"a layer must keep its device and dtype")


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

