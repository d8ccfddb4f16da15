"""The step engine: what every front end (Horovod, DDP, Elastic) drives, knowing no codec.

One step, numbered as the engine sees it:

1. ``add(name, grad)`` for each gradient as it becomes ready: the layer is routed (its codec
   compresses it; too small or not a float: averaged uncompressed on our data plane, or
   handed back for the front end to average), its raw gradient shown to the controller, and
   it enters its codec's exchange, whose buckets start their rounds as soon as they are
   complete (accordion_hvd/exchange/). Once every first-round bucket is issued, the engine
   issues its learning-rate gather on the same lane, in flight with the rest of the step.
2. ``finish(route, name, tensor)`` for each layer: the first one waits for the step's rounds
   (in the same order on every rank); the result is scaled (Horovod's ``op=Sum``), checked
   for non-finite values and counted.
3. ``end_step()`` once no layer is in flight (``in_flight`` is empty): the step is settled
   or skipped (a rank's non-finite gradient: every result zero, on the device), counted,
   and the controller sets the levels of the next step on every rank alike.

Once the policy has settled every layer at 16-bit dense for good, a front end whose gradients
come in flat buffers may send each buffer whole instead: ``add_whole``/``finish_whole``
(engine/whole.py, a part of the engine like planes.py), in place of steps 1 and 2.

``abort()`` drops a step in flight (Horovod Elastic). Two parts of the engine have files of
their own: its planes and exchanges (engine/planes.py) and what it does between steps
(engine/between_steps.py: settings, levels, the link). Settings are agreed across ranks once,
before the first collective that depends on them (engine/settings.py); checkpoints are
engine/state.py; the counters (accordion_hvd/counters.py) are one object the exchanges
count into. Lower layers get values and read-only views, never a call back into the engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import ops
from ..codecs import Codec
from ..comm.link import LinkMeasurement
from ..controller import RegimeController
from ..counters import Counters
from ..exchange import BUCKET_BYTES
from ..flags import finite_flag
from ..levels import positive_number
from ..network_probe import NetworkProbe
from ..step_faults import StepFaults
from . import announce, checks
from .between_steps import BetweenSteps
from .planes import Planes
from .learning_rates import LearningRates
from .whole import WholeBuffers, WholeRoute

# Who carries a layer this step: the front end (Horovod's allreduce, DDP's bucket collective),
# our codec's exchange, or our uncompressed round.
DENSE, COMPRESSED, UNCOMPRESSED = "dense", "compressed", "uncompressed"


class StepEngine(Planes, BetweenSteps, WholeRoute):
    """See the module doc; ``AccordionCompressor`` (accordion_hvd/horovod/compressor.py)
    documents the arguments."""

    def __init__(self, codec: Codec | None = None, *, eta: float = 0.5, interval: int | None = 100,
                 policy: Any = None, accumulate: bool = True, channel: Any = None, control: Any = None,
                 bucket_cap_mb: float = BUCKET_BYTES / 2**20) -> None:
        self.codec, self.policy, self.eta, self.interval = checks.resolve(codec, policy, eta, interval)
        self.bucket_cap = int(positive_number("bucket_cap_mb", bucket_cap_mb) * 2**20)
        self.controller = RegimeController(self.policy, self.interval, accumulate=accumulate)
        self.layers: dict[str, Any] = {}      # name -> codec state (changed in place only)
        self.whole = WholeBuffers(self.layers)  # flat buffers sent whole once settled (engine/whole.py)
        self.counters = Counters()
        self.probe = None                     # a network-aware policy's measurements
        if self.policy.uses_network:
            checks.check_network(self.policy, self.codec, accumulate)
            self.probe = self.controller.probe = NetworkProbe(self.codec, self.layers, dense_level=self.policy.dense_level,
                                                              seconds=self.counters.seconds)
        self.front_end: dict = {}             # a front end's settings every rank must share (Horovod's op)
        self.result_scale = 1.0               # our averages times this (Horovod's op=Sum: the world size)
        self._channel, self._channel_given = channel, channel is not None
        self._control, self._control_given = control, control is not None
        self.device_type = "cpu"              # of the first gradient: picks the default data plane
        self.lrs = LearningRates()
        self.link: LinkMeasurement | None = None  # the last measure_link() that found a link
        self.faults = StepFaults()            # non-finite gradients, on the device
        self.settings_agreed = False
        self.loaded_owner = None              # (rank, world size) of a state loaded before both were known
        self.announcer = announce.LevelAnnouncer()
        self.speaks_for_job: bool | None = None  # a front end's choice of the rank that logs (HSDP: global rank 0)
        self.in_flight: set[str] = set()      # this step: layers added, not finished yet
        self._exchange = None                 # the codec's exchange (accordion_hvd/exchange/)
        self._dense_round = None              # the uncompressed layers' round
        self._wire_cache: dict[tuple[str, str], int] = {}  # (layer, level) -> bytes per step (codec.wire)
        self._new_step()

    def _new_step(self) -> None:
        """Everything one step keeps until its end, to settle it or to skip it: the one reset."""
        self.in_flight.clear()
        self._outputs: list[torch.Tensor] = []  # every result handed out
        self._results: dict[str, torch.Tensor] | None = None  # the step's rounds', once waited for
        self._rounds: set[str] = set()           # which of our rounds carry layers this step
        self._dtypes: dict[str, torch.dtype] = {}  # a layer's gradient dtype where its round may change it
        self._step_planned = False               # a per-step policy's levels handed to the exchange

    # --- 1. add ------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, name: str, tensor: torch.Tensor, *, uncompressed_here: bool = False):
        """Route layer ``name``'s gradient; returns ``(tensor, route)``. The gradient is
        consumed (folded into the error feedback; PowerSGD writes its result into it). A
        compressed layer returns None (the engine carries it); so does an uncompressed one
        with ``uncompressed_here`` (averaged on our data plane). Otherwise (sparse, integer, a
        layer sent whole this step: route DENSE) the tensor returned is for the front end to
        average."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"AccordionCompressor: the gradient of {name!r} must be a torch.Tensor, "
                            f"got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"AccordionCompressor: the gradient of {name!r} is on device {tensor.device}; "
                             f"expected a CPU or CUDA tensor")
        if not self.settings_agreed:
            self.device_type = tensor.device.type
        self.agree_settings()
        if name in self.in_flight:
            raise RuntimeError(f"AccordionCompressor: {name!r} compressed twice in one step")
        floating = tensor.layout == torch.strided and tensor.is_floating_point()
        compressed = floating and self.codec.compressible(tensor.shape)  # else as it is
        layer = self.layers.get(name) if compressed else None
        if layer is not None:
            checks.same_layer(name, layer, tensor)
        self.in_flight.add(name)
        whole = tensor.numel() * tensor.element_size()
        self.counters.gradient(name, tensor.numel(), whole)
        if not compressed:
            self.counters.floats(name, tensor.numel())
            self.counters.wire(name, whole)
            if not (uncompressed_here and floating):
                return tensor, DENSE
            self._rounds.add(UNCOMPRESSED)
            self._dtypes[name] = tensor.dtype
            self.dense_round.ready(name, [tensor], tensor)  # starts its bucket's allreduce once the bucket is full
            return None, UNCOMPRESSED
        started = time.perf_counter()
        if layer is None:
            layer = self.layers[name] = self.codec.init_state(name, tensor, self.controller.level_of(name))
        if self.probe is not None:
            self.probe.mark(name)
        finite = finite_flag(tensor)  # on the device: masks, never read here
        self.controller.observe(name, tensor, finite=finite)  # before the codec consumes the gradient
        self.faults.local(name, finite)
        self.counters.seconds["compress"] += time.perf_counter() - started  # the exchange counts its own
        if self.policy.per_step and not self._step_planned:  # the levels whose gains the policy needs this step
            self.exchange.plan_step(self.controller.step_levels())
            self._step_planned = True
        dense = self.exchange.add(name, layer, tensor, finite)  # starts its bucket's round once the bucket is full
        self.counters.floats(name, tensor.numel() if dense is not None else self.codec.floats_sent(layer))
        if self.exchange.round1.all_issued and self.policy.reacts_to_lr:
            self.lrs.gather(self.channel)  # after every first-round bucket: the same order on every rank
        if dense is not None:  # sent whole this step (TopK keeping half or more, DENSE16): the front end carries it
            if dense.dtype != tensor.dtype:  # in 16 bits: back to the gradient's dtype in finish
                self._dtypes[name] = tensor.dtype
            return dense, DENSE
        self._rounds.add(COMPRESSED)
        return None, COMPRESSED

    def write_result_into(self, name: str, target: torch.Tensor) -> bool:
        """Ask that ``name``'s result this step be written into ``target`` (same shape and
        dtype as its gradient; its values are not read). Returns whether the codec's exchange
        took it (PowerSGD's does, for a layer it compresses this step)."""
        if self._exchange is None or name not in self.in_flight:
            return False
        return self._exchange.write_into(name, target)

    # --- 2. finish ---------------------------------------------------------------------------
    def finish(self, route: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Layer ``name``'s result: ``tensor`` is what the front end averaged for a DENSE
        route (ignored otherwise). Call ``end_step`` once ``in_flight`` is empty."""
        if name not in self.in_flight:
            raise RuntimeError(f"AccordionCompressor: no result for {name!r}: decompress called twice, "
                               f"or without compress, in this step")
        if route != DENSE:
            if self._results is None:  # the step's first: wait for the step's rounds
                self._results = self._collect()
            tensor = self._results.pop(name)
        elif name in self._dtypes:  # a layer sent whole in 16 bits
            tensor = tensor.to(self._dtypes[name])
        if route != DENSE and self.result_scale != 1.0 and tensor.is_floating_point():
            # op=hvd.Sum: our rounds average. A new tensor: PowerSGD's settling reads the
            # average it wrote (the error feedback is M - M_hat, whatever the op).
            tensor = tensor * self.result_scale
        if route != COMPRESSED and tensor.is_floating_point():
            self.faults.seen(~finite_flag(tensor))  # an average: the same on every rank
        self._outputs.append(tensor)
        layer = self.layers.get(name)  # (a compressed layer's, whole at DENSE16 or not)
        if layer is not None:  # its level is final now (a per-step policy chose it before the results)
            self.counters.wire(name, self._wire_bytes(layer))
        self.in_flight.discard(name)
        return tensor

    def _wire_bytes(self, layer) -> int:
        """Bytes a compressed layer put on the wire this step: the codec's ``bytes_sent`` where
        it has one (a payload whose size changes from step to step), else ``codec.wire`` at its
        level, worked out once per layer and level: not every step."""
        bytes_sent = getattr(self.codec, "bytes_sent", None)  # optional in the codec protocol (codecs/base.py)
        if bytes_sent is not None:
            return bytes_sent(layer)
        key = (layer.name, str(layer.level))
        if key not in self._wire_cache:
            wire = self.codec.wire(layer.shape, layer.level, layer.residual.element_size())
            self._wire_cache[key] = sum(nbytes for _, nbytes in wire)
        return self._wire_cache[key]

    def _collect(self) -> dict[str, torch.Tensor]:
        """Wait for the step's rounds, in the same order on every rank (the first layer that
        a front end finishes differs between ranks; a round's first step agrees on its
        layout with blocking collectives, which must pair)."""
        results: dict[str, torch.Tensor] = {}
        if UNCOMPRESSED in self._rounds:
            for name, (average,) in self.dense_round.results().items():
                dtype = self._dtypes[name]
                results[name] = average if average.dtype == dtype else average.to(dtype)
        if COMPRESSED in self._rounds:
            if self.policy.per_step:  # its choice, from every rank's gains (one control collective)
                gains = self.exchange.gains()
                results.update(self.exchange.results(self.controller.choose_step(self.control, gains[0], gains[1:])))
            else:
                results.update(self.exchange.results())
            if self.policy.reacts_to_lr:  # (the first step agrees on its layout here: after it)
                self.lrs.gather(self.channel)
            self.faults.seen(self.exchange.fault)
            for flag, message in self.exchange.errors:
                self.faults.error(flag, message)
        return results

    # --- 3. end_step -------------------------------------------------------------------------
    def end_step(self) -> None:
        """Every rank, once per step, after its last ``finish``: skip or settle the step, count
        it and let the controller switch levels for the next one."""
        if self.in_flight:
            raise RuntimeError(f"AccordionCompressor: end_step with layers still in flight: {sorted(self.in_flight)[:3]}")
        self.faults.rank = self.channel.rank
        device = self._outputs[0].device if self._outputs else torch.device("cpu")
        skipped = self.faults.settle(self.counters.steps + 1, device)  # 0-d bool; the host reads it later, if at all
        if self._exchange is not None:  # before the zeroing: PowerSGD's settling reads its results
            self._exchange.end_step(skipped=skipped)
        self.whole.settle(~skipped)
        # A skipped step's results are zero (they may hold NaN), decided on the device.
        ops.fill_if_([out for out in self._outputs if out.layout == torch.strided], skipped)
        sparse = [out for out in self._outputs if out.layout != torch.strided]
        if sparse and bool(skipped):  # a sparse gradient (passed through as it is): the one host read, for it alone
            for out in sparse:
                out.zero_()
        lr_gather = self.lrs.take()
        self._new_step()
        self.counters.steps += 1
        note_step = getattr(self._channel, "note_step", None)  # where this rank is, for a failure's diagnosis
        if note_step is not None:
            note_step(self.counters.steps)
        if self.probe is not None:
            self.probe.end_step()
        lrs = self.lrs.current()
        gathered = None if lr_gather is None else self._wait(lr_gather).view(self.channel.size, -1).numpy()
        self._probe_window()
        self.apply_levels(self.controller.end_step(self.control, sorted(self.layers), lrs, gathered=gathered))
        # Read the outcomes the device is done with (on the CPU: this step's): log skipped steps,
        # and fail on an error flag; on a GPU a later step reads this one's, never waiting.
        self.faults.poll(wait=False)

    # --- faults a front end agrees on itself (HSDP: inside the node, not across it) -----------
    def local_fault(self) -> torch.Tensor | None:
        """Whether any of this rank's own gradients so far this step was not finite (0-d bool
        on the device), or None if none was checked."""
        return self.faults.local_bad()

    def step_fault(self) -> torch.Tensor | None:
        """Whether this step's exchanged data showed a fault so far (0-d bool), or None."""
        return self.faults.bad

    def saw_fault(self, bad: torch.Tensor) -> None:
        """A fault the front end learned of (0-d bool): the step is skipped if it is set."""
        self.faults.seen(bad)

    def _wait(self, handle):
        started = time.perf_counter()
        try:
            return self.channel.wait(handle)
        finally:
            self.counters.seconds["comm"] += time.perf_counter() - started

    def abort(self) -> None:
        """Drop the step in flight (its collectives will never complete): Elastic."""
        if self._exchange is not None:
            self._exchange.abort()
        if self._dense_round is not None:
            self._dense_round.begin_step()
        if self.probe is not None:
            self.probe.forget_step()
        self.faults.forget()
        self.whole.forget_step()
        self.lrs.take()
        self._new_step()
