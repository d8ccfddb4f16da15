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
come in flat buffers may send each buffer whole instead: ``add_whole``/``finish_whole``, in
place of steps 1 and 2. ``abort()`` drops a step in flight (Horovod Elastic).

The engine is composed of parts, each with its own state, handed what it needs at
construction (no part reads another's fields): ``planes`` (engine/planes.py: the data and
control planes, the codec's exchange, the uncompressed round), ``between`` (engine/between_steps.py:
levels and the link between steps), ``whole_route`` (engine/whole.py: the settled route) and
``step`` (engine/open_step.py: what the step in flight keeps). Settings are agreed across
ranks once, before the first collective that depends on them (engine/settings.py);
checkpoints are engine/state.py; the counters (accordion_hvd/counters.py) are one object the
exchanges count into. Lower layers get values and read-only views, never a call back into
the engine.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from .. import ops
from ..codecs import Codec
from ..codecs.base import WireBytes
from ..controller import RegimeController
from ..counters import Counters
from ..exchange import BUCKET_BYTES
from ..flags import finite_flag
from ..levels import positive_number
from ..network_probe import NetworkProbe
from ..step_faults import StepFaults
from . import checks, state
from . import settings as agreement
from .between_steps import BetweenSteps
from .learning_rates import LearningRates
from .open_step import OpenStep
from .planes import Planes
from .whole import WholeBuffers, WholeRoute


class Route(str, enum.Enum):
    """Who carries a layer this step. Not a level (levels.py): a layer at level ``DENSE16``
    takes route ``FRONT_END``, and so does one too small to compress."""
    FRONT_END = "front end"   # sent whole, averaged by the front end (Horovod's allreduce, a DDP bucket)
    EXCHANGE = "exchange"     # the codec's exchange (accordion_hvd/exchange/)
    OUR_ROUND = "our round"   # uncompressed, averaged in our own round on the data plane


class StepEngine:
    """See the module doc; ``AccordionCompressor`` (accordion_hvd/compressor.py) documents the
    arguments."""

    def __init__(self, codec: Codec | None = None, *, eta: float = 0.5, interval: int | None = 100,
                 policy: Any = None, accumulate: bool = True, channel: Any = None, control: Any = None,
                 bucket_cap_mb: float = BUCKET_BYTES / 2**20) -> None:
        self.codec, self.policy, self.eta, self.interval = checks.resolve(codec, policy, eta, interval)
        self.bucket_cap = int(positive_number("bucket_cap_mb", bucket_cap_mb) * 2**20)
        self.controller = RegimeController(self.policy, self.interval, accumulate=accumulate)
        self.layers: dict[str, Any] = {}      # name -> codec state (changed in place only)
        self.counters = Counters()
        self.probe = None                     # a network-aware policy's measurements
        if self.policy.uses_network:
            checks.check_network(self.policy, self.codec, accumulate)
            self.probe = self.controller.probe = NetworkProbe(self.codec, self.layers, dense_level=self.policy.dense_level,
                                                              seconds=self.counters.seconds)
        # What the front end declared (``declare``): its name, its settings every rank must share
        # (Horovod's op, DiLoCo's), our averages' scale (Horovod's op=Sum: the world size) and the
        # start check of its parameters (``parameters_digest``, the remedy), for the first agreement.
        self.front_end, self.front_end_settings, self.result_scale, self.start = "AccordionCompressor", {}, 1.0, None
        self.lrs = LearningRates()
        self.faults = StepFaults()            # non-finite gradients, on the device
        self.settings_agreed = False
        self.loaded_owner = None              # (rank, world size) of a state loaded before both were known
        self.step = OpenStep()
        self.planes = Planes(self.codec, self.counters, per_step=self.policy.per_step, bucket_cap=self.bucket_cap,
                             channel=channel, control=control)
        self.between = BetweenSteps(codec=self.codec, policy=self.policy, controller=self.controller,
                                    counters=self.counters, layers=self.layers, in_flight=self.step.in_flight,
                                    planes=self.planes, probe=self.probe)
        self.whole = WholeBuffers(self.layers)  # flat buffers sent whole once settled, their error feedback
        self.whole_route = WholeRoute(self.whole, policy=self.policy, faults=self.faults, counters=self.counters,
                                      step=self.step)
        self.wire_bytes = WireBytes(self.codec)

    channel = property(lambda self: self.planes.channel, doc="The data plane (engine/planes.py).")
    control = property(lambda self: self.planes.control, doc="The control plane.")
    exchange = property(lambda self: self.planes.exchange, doc="The codec's exchange.")
    dense_round = property(lambda self: self.planes.dense_round, doc="The uncompressed layers' round.")
    in_flight = property(lambda self: self.step.in_flight, doc="This step's layers not finished yet.")
    settled_dense = property(lambda self: self.whole_route.settled_dense, doc="add_whole's time (engine/whole.py).")

    def use_planes(self, channel, control=None) -> None:
        """A front end's own planes, before the first step (engine/planes.py ``use``)."""
        if self.step.in_flight:
            raise ValueError("AccordionCompressor: bind it before its first step (it has exchanged gradients already)")
        self.planes.use(channel, control)

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        return {**self.codec.config(), "eta": self.eta, **self.controller.config(),
                "bucket_cap_mb": self.bucket_cap / 2**20}  # every rank must cut the same buckets

    def declare(self, front_end: str, *, settings: dict | None = None, device_type: str | None = None,
                result_scale: float | None = None, speaks: bool | None = None,
                start: tuple[str, str] | None = None) -> None:
        """The one door by which a front end tells the engine what it is, before the settings
        are agreed: its name (``front_end``, the one the user created: refusals name it), its
        ``settings`` every rank must share (compared with the engine's own), the ``device_type``
        of its gradients (picks the default data plane), the ``result_scale`` of our averages,
        whether this rank ``speaks`` for the job in logs (None: rank 0 of the data plane), and
        ``start``: (``settings.parameters_digest`` of its parameters, what to do if they differ),
        compared at the first agreement (engine/settings.py). The other arguments left None keep
        what was declared before."""
        self.front_end = front_end
        if settings is not None:
            self.front_end_settings = dict(settings)
        if device_type is not None and not self.settings_agreed:
            self.planes.device_type = device_type
        if result_scale is not None:
            self.result_scale = float(result_scale)
        self.between.speaks_for_job = speaks
        if start is not None:
            self.start = start

    def agree_settings(self) -> None:
        """Once (again after ``world_changed``): every rank's settings and the front end's
        compared, one blocking allgather (engine/settings.py); the first one compares the
        parameters declared too."""
        if self.settings_agreed:
            return
        state.check_loaded_owner(self)
        agreement.agree(self.channel, {**self.config(), **self.front_end_settings}, self.front_end, self.start)
        self.settings_agreed, self.start = True, None

    def world_changed(self) -> None:
        """The world was re-formed (Elastic): the planes rebuilt, the settings agreed again."""
        self.settings_agreed = False
        self.planes.world_changed()

    # --- 1. add ------------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, name: str, tensor: torch.Tensor, *, uncompressed_here: bool = False):
        """Route layer ``name``'s gradient; returns ``(tensor, route)``. The gradient is
        consumed (folded into the error feedback; PowerSGD writes its result into it). A
        compressed layer returns None (the engine carries it); so does an uncompressed one
        with ``uncompressed_here`` (averaged on our data plane). Otherwise (sparse, integer, a
        layer sent whole this step: ``Route.FRONT_END``) the tensor returned is for the front end to
        average."""
        checks.gradient(name, tensor)
        if not self.settings_agreed:
            self.planes.device_type = tensor.device.type
        self.agree_settings()
        step = self.step
        if name in step.in_flight:
            raise RuntimeError(f"AccordionCompressor: {name!r} compressed twice in one step")
        floating = tensor.layout == torch.strided and tensor.is_floating_point()
        compressed = floating and self.codec.compressible(tensor.shape)  # else as it is
        layer = self.layers.get(name) if compressed else None
        if layer is not None:
            checks.same_layer(name, layer, tensor)
        step.in_flight.add(name)
        whole = tensor.numel() * tensor.element_size()
        self.counters.gradient(name, tensor.numel(), whole)
        if not compressed:
            self.counters.floats(name, tensor.numel())
            self.counters.wire(name, whole)
            if not (uncompressed_here and floating):
                return tensor, Route.FRONT_END
            step.rounds.add(Route.OUR_ROUND)
            step.dtypes[name] = tensor.dtype
            self.dense_round.ready(name, [tensor], tensor)  # starts its bucket's allreduce once the bucket is full
            return None, Route.OUR_ROUND
        started = time.perf_counter()
        if layer is None:
            layer = self.layers[name] = self.codec.init_state(name, tensor, self.controller.level_of(name))
        if self.probe is not None:
            self.probe.mark(name)
        finite = finite_flag(tensor)  # on the device: masks, never read here
        self.controller.observe(name, tensor, finite=finite)  # before the codec consumes the gradient
        self.faults.local(name, finite)
        self.counters.seconds["compress"] += time.perf_counter() - started  # the exchange counts its own
        if self.policy.per_step and not step.planned:  # the levels whose gains the policy needs this step
            self.exchange.plan_step(self.controller.step_levels())
            step.planned = True
        dense = self.exchange.add(name, layer, tensor, finite)  # starts its bucket's round once the bucket is full
        self.counters.floats(name, tensor.numel() if dense is not None else self.codec.floats_sent(layer))
        if self.exchange.round1.all_issued and self.policy.reacts_to_lr:
            self.lrs.gather(self.channel)  # after every first-round bucket: the same order on every rank
        if dense is not None:  # sent whole this step (TopK keeping half or more, DENSE16): the front end carries it
            if dense.dtype != tensor.dtype:  # in 16 bits: back to the gradient's dtype in finish
                step.dtypes[name] = tensor.dtype
            return dense, Route.FRONT_END
        step.rounds.add(Route.EXCHANGE)
        return None, Route.EXCHANGE

    def write_result_into(self, name: str, target: torch.Tensor) -> bool:
        """Ask that ``name``'s result this step be written into ``target`` (same shape and
        dtype as its gradient; its values are not read). Returns whether the codec's exchange
        took it (PowerSGD's does, for a layer it compresses this step)."""
        exchange = self.planes.exchange_if_made
        if exchange is None or name not in self.step.in_flight:
            return False
        return exchange.write_into(name, target)

    # --- 2. finish ---------------------------------------------------------------------------
    def finish(self, route: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Layer ``name``'s result: ``tensor`` is what the front end averaged for a ``Route.FRONT_END``
        route (ignored otherwise). Call ``end_step`` once ``in_flight`` is empty."""
        step = self.step
        if name not in step.in_flight:
            raise RuntimeError(f"AccordionCompressor: no result for {name!r}: decompress called twice, "
                               f"or without compress, in this step")
        if route != Route.FRONT_END:
            if step.results is None:  # the step's first: wait for the step's rounds
                step.results = self._collect()
            tensor = step.results.pop(name)
        elif name in step.dtypes:  # a layer sent whole in 16 bits
            tensor = tensor.to(step.dtypes[name])
        if route != Route.FRONT_END and self.result_scale != 1.0 and tensor.is_floating_point():
            # op=hvd.Sum: our rounds average. A new tensor: PowerSGD's settling reads the
            # average it wrote (the error feedback is M - M_hat, whatever the op).
            tensor = tensor * self.result_scale
        if route != Route.EXCHANGE and tensor.is_floating_point():
            self.faults.seen(~finite_flag(tensor))  # an average: the same on every rank
        step.outputs.append(tensor)
        layer = self.layers.get(name)  # (a compressed layer's, whole at DENSE16 or not)
        if layer is not None:  # its level is final now (a per-step policy chose it before the results)
            self.counters.wire(name, self.wire_bytes(layer))
        step.in_flight.discard(name)
        return tensor

    def _collect(self) -> dict[str, torch.Tensor]:
        """Wait for the step's rounds, in the same order on every rank (the first layer that
        a front end finishes differs between ranks; a round's first step agrees on its
        layout with blocking collectives, which must pair)."""
        results: dict[str, torch.Tensor] = {}
        if Route.OUR_ROUND in self.step.rounds:
            for name, (average,) in self.dense_round.results().items():
                dtype = self.step.dtypes[name]
                results[name] = average if average.dtype == dtype else average.to(dtype)
        if Route.EXCHANGE in self.step.rounds:
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
        step = self.step
        if step.in_flight:
            raise RuntimeError(f"AccordionCompressor: end_step with layers still in flight: {sorted(step.in_flight)[:3]}")
        self.faults.rank = self.channel.rank
        device = step.outputs[0].device if step.outputs else torch.device("cpu")
        skipped = self.faults.settle(self.counters.steps + 1, device)  # 0-d bool; the host reads it later, if at all
        exchange = self.planes.exchange_if_made
        if exchange is not None:  # before the zeroing: PowerSGD's settling reads its results
            exchange.end_step(skipped=skipped)
        self.whole.settle(~skipped)
        # A skipped step's results are zero (they may hold NaN), decided on the device.
        ops.fill_if_([out for out in step.outputs if out.layout == torch.strided], skipped)
        sparse = [out for out in step.outputs if out.layout != torch.strided]
        if sparse and bool(skipped):  # a sparse gradient (passed through as it is): the one host read, for it alone
            for out in sparse:
                out.zero_()
        lr_gather = self.lrs.take()
        step.reset()
        self.counters.steps += 1
        self.planes.note_step(self.counters.steps)  # where this rank is, for a failure's diagnosis
        if self.probe is not None:
            self.probe.end_step()
        gathered = None
        if lr_gather is not None:
            started = time.perf_counter()
            gathered = self.channel.wait(lr_gather).view(self.channel.size, -1).numpy()
            self.counters.seconds["comm"] += time.perf_counter() - started
        self.between.step_ended(self.lrs.current(), gathered)
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

    def abort(self) -> None:
        """Drop the step in flight (its collectives will never complete): Elastic."""
        self.planes.abort()
        if self.probe is not None:
            self.probe.forget_step()
        self.faults.forget()
        self.whole.forget_step()
        self.lrs.take()
        self.step.reset()

    # --- the settled route (engine/whole.py) -------------------------------------------------
    def add_whole(self, key: str, flat: torch.Tensor, layers: list[tuple[str, int]]) -> torch.Tensor:
        """Buffer ``key`` sent whole (engine/whole.py ``WholeRoute.add``), once ``settled_dense``."""
        self.agree_settings()
        return self.whole_route.add(key, flat, layers)

    def finish_whole(self, key: str, flat: torch.Tensor, average: torch.Tensor) -> None:
        self.whole_route.finish(key, flat, average)
