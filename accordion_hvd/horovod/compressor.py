"""The Horovod front end: ``AccordionCompressor``, a Horovod ``Compressor`` over the step engine.

Horovod's ``DistributedOptimizer`` calls ``compress(grad)`` for every parameter as its
gradient becomes ready (during backward) and allreduces what it returns; in ``step()`` it
calls ``decompress(result, ctx)`` for each and sets the parameter's gradient to the output.
This front end translates that contract and nothing more:

* ``compress``: which parameter the tensor is (horovod/seam.py: by identity with
  ``named_parameters=``, else from Horovod's calling frame), then ``engine.add``. A layer
  the engine carries (compressed, or averaged uncompressed on our data plane) goes back to
  Horovod as a placeholder, which Horovod's patched ``allreduce_async_`` hands back as a
  finished handle (horovod/patches.py): no negotiation, no wait for Horovod's cycle. What
  the engine hands back (sparse and integer gradients, a layer sent whole this step) Horovod
  averages as usual.
* ``decompress``: ``engine.finish``; after the step's last layer, ``engine.end_step``.
* At the first ``compress``: Horovod's ``op`` honoured (a sum is the average times the world
  size) or refused before any collective, and agreed with every rank's settings; Horovod's
  patches installed (the polite wait, the bypass).

The same compressor object serves the DDP front end (accordion_hvd/ddp.py, ``bind``) and
Horovod Elastic (accordion_hvd/elastic.py); the work is the engine's (accordion_hvd/engine/).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ..codecs import Codec
from ..comm.link import LinkMeasurement
from ..engine import StepEngine, state
from ..exchange import BUCKET_BYTES
from ..levels import Level
from .patches import check_wait, cycle_hint, install_bypass, install_construction_check, install_polite_wait, placeholder
from .seam import GradientNames, bypass_allowed, find_optimizer, horovod_op_name, horovod_parameter, reduction_scale

log = logging.getLogger("accordion_hvd.horovod")

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
    to one default instance of it (created on first use, with the default configuration)."""

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
            accordion_hvd/codecs/base.py with a registered exchange (``acc.codecs``); default
            ``acc.codecs.default_codec()`` (with ``policy=None``: the default configuration,
            below; docs/time-to-quality.md says what it is and why).
        eta: Accordion threshold on the relative change of a layer's gradient norm.
        interval: detection period in optimizer steps; ``None``: at each ``epoch_end()``.
        policy: ``None``: with the default codec, "link-gate" (16-bit dense where the job's
            own measured steps say compression does not pay, the codec where it does:
            policies/link_gate.py); with a codec you give, Accordion when it has two levels,
            else static. Or "accordion", "static", "gravac", "network-aware", "link-gate", or an
            ``acc.policies.Policy``.
        accumulate: detect on the norm of each layer's gradient accumulated over the window
            (the paper; one float32 buffer per compressed layer) or, if False, on its
            per-step norms (no buffer).
        channel: the data plane (default: our own Gloo group over Horovod's ranks for CPU
            gradients, Horovod's collectives for GPU ones: comm/planes.py); tests pass a
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
            (the one-line usage; accordion_hvd/horovod/seam.py).
        wait: how Horovod's optimizer waits for its collectives, installed process-wide when
            Horovod first calls ``compress``: "sleep" (default: poll with growing sleeps, at
            most 1 ms late, leaving the CPU to ranks still in backward) or "spin" (Horovod's
            own busy wait). $ACCORDION_HOROVOD_WAIT overrides it.
    """

    _default = None

    def __init__(self, codec: Codec | None = None, *, eta: float = 0.5, interval: int | None = 100,
                 policy: Any = None, accumulate: bool = True, channel: Any = None, control: Any = None,
                 bucket_cap_mb: float = BUCKET_BYTES / 2**20, named_parameters=None, wait: str = "sleep") -> None:
        self.engine = StepEngine(codec, eta=eta, interval=interval, policy=policy, accumulate=accumulate,
                                 channel=channel, control=control, bucket_cap_mb=bucket_cap_mb)
        self._names = None if named_parameters is None else GradientNames(named_parameters)
        self.wait = check_wait(wait)
        self._met_horovod = False   # compress() was called by Horovod: its op checked, patches installed
        self._bypass = False        # uncompressed layers travel on our data plane too
        self._owner = None          # weakref to the optimizer or model this compressor serves (one)
        install_construction_check(_built_with)  # refusals at hvd.DistributedOptimizer(...), on every rank

    @classmethod
    def default_instance(cls) -> "AccordionCompressor":
        if cls.__dict__.get("_default") is None:
            cls._default = cls()
        return cls._default

    def __repr__(self) -> str:
        return f"AccordionCompressor({self.codec!r}, policy={self.policy!r}, interval={self.interval})"

    # What the engine was built with, read-only.
    codec = property(lambda self: self.engine.codec)
    policy = property(lambda self: self.engine.policy)
    eta = property(lambda self: self.engine.eta)
    interval = property(lambda self: self.engine.interval)
    controller = property(lambda self: self.engine.controller)
    channel = property(lambda self: self.engine.channel, doc="The data plane (comm/planes.py).")
    control = property(lambda self: self.engine.control, doc="The control plane.")
    exchange = property(lambda self: self.engine.exchange, doc="The codec's exchange (accordion_hvd/exchange/).")
    dense_round = property(lambda self: self.engine.dense_round, doc="The uncompressed layers' round.")
    round1 = property(lambda self: self.engine.exchange.round1, doc="The exchange's first round (its buckets).")
    seconds = property(lambda self: self.engine.counters.seconds, doc="Cumulative seconds of math and waits.")
    steps = property(lambda self: self.engine.counters.steps, doc="Steps taken (skipped ones included).")

    def bind(self, owner, *, channel, control, optimizer=None, speaks: bool | None = None) -> None:
        """Attach this compressor to a front end other than Horovod's optimizer (the DDP hook:
        accordion_hvd/ddp.py): its data plane, control plane and, if given, the optimizer
        whose learning rates the policy reads, and whether this rank logs for the job
        (``speaks``; default: rank 0 of the data plane). One compressor serves one model."""
        _serve(self, owner)
        self.engine.use_planes(channel, control)
        self.engine.speaks_for_job = speaks
        if optimizer is not None:
            self.engine.lrs.watch(optimizer)

    # --- the Horovod Compressor interface -----------------------------------------------------
    @_DefaultInstanceMethod
    def compress(self, tensor: torch.Tensor):
        """Called by Horovod for each gradient; returns (tensor to allreduce, context)."""
        engine, optimizer = self.engine, None
        if self._names is None:  # from Horovod's frames; raises when not called by Horovod's optimizer
            name, optimizer = horovod_parameter()
        if not self._met_horovod:  # an op we cannot honour is refused before the gradient is looked at
            if self._names is not None:
                optimizer = find_optimizer()
            if isinstance(tensor, torch.Tensor) and not engine.settings_agreed:
                engine.device_type = tensor.device.type  # picks the data plane the check runs on
            self._meet_horovod(optimizer)
        if self._names is not None:
            name = self._names.name_of(tensor)
        if not engine.lrs.watching and optimizer is not None:
            engine.lrs.watch(optimizer)
        elif not engine.lrs.watching and engine.policy.reacts_to_lr and engine.lrs.reported is None \
                and engine.counters.steps == 0 and not engine.in_flight:
            log.warning("AccordionCompressor: Horovod's optimizer was not found in the calling frames, so the policy "
                        "does not see learning-rate decreases; call compression.report_lr(lr) after each change")
        out, route = engine.add(name, tensor, uncompressed_here=self._bypass)
        return (placeholder(tensor) if out is None else out), (route, name)

    def _meet_horovod(self, optimizer) -> None:
        """The first ``compress`` from Horovod's optimizer: honour its ``op`` or refuse it
        (seam.reduction_scale: before any collective, so a refusal never leaves a rank
        waiting), agree on the settings, Horovod's op among them, with every rank, and take
        the uncompressed gradients off Horovod."""
        self.engine.result_scale = reduction_scale(optimizer)
        # Kept: every later check (a world re-formed by Elastic) compares it again, also with a
        # worker that joined and meets Horovod for the first time.
        self.engine.front_end = {"horovod_op": None if optimizer is None else horovod_op_name(optimizer)}
        self.engine.agree_settings()
        if optimizer is not None:  # (also checked as Horovod built it, where the wrapper was in place)
            _serve(self, optimizer)
        install_polite_wait(self.wait)  # first: it also makes Horovod's optimizer read bypass handles
        install_bypass()
        why_not = bypass_allowed(optimizer)
        self._bypass = why_not is None
        if why_not:
            log.info("AccordionCompressor: uncompressed gradients go through Horovod's allreduce: %s", why_not)
        if self._bypass and self.engine.speaks:  # none of the steps' data goes through Horovod's loop
            _hint_cycle()
        self._met_horovod = True

    @_DefaultInstanceMethod
    def decompress(self, tensor: torch.Tensor, ctx):
        """Called by Horovod with the allreduced tensor; returns the averaged gradient."""
        if ctx is None:  # a sparse gradient that Horovod reduced itself (sparse_as_dense=False): never ours
            return tensor
        route, name = ctx
        out = self.engine.finish(route, name, tensor)
        if not self.engine.in_flight:  # the step's last layer: the step is over on this rank
            if self._names is not None:
                self._names.end_step()
            self.engine.end_step()
        return out

    # --- the same, with the parameter named explicitly (tests, other front ends) -------------
    def compress_named(self, name: str, tensor: torch.Tensor):
        """``compress`` for the parameter ``name``. The gradient is consumed: it is folded into
        the error feedback, and a PowerSGD layer's result is written into its memory (what
        Horovod does with the result anyway). Pass a copy to keep the gradient. An
        uncompressed layer is returned as it is, for the caller to average."""
        out, route = self.engine.add(name, tensor)
        return (tensor.new_empty(0) if out is None else out), (route, name)

    def write_result_into(self, name: str, target: torch.Tensor) -> bool:
        """Ask that ``name``'s result this step be written into ``target`` (engine docs)."""
        return self.engine.write_result_into(name, target)

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        return self.engine.config()

    # --- what users call between steps ---------------------------------------------------------
    @_DefaultInstanceMethod
    def epoch_end(self) -> None:
        """An explicit detection point, on every rank at the same point (used when the
        compressor was created with ``interval=None``; otherwise ignored with a warning)."""
        self.engine.epoch_end()

    @_DefaultInstanceMethod
    def report_lr(self, lr) -> None:
        """Tell the controller the learning rate(s) (a number or one per param group), for
        front ends where it cannot read them from Horovod's optimizer; overrides that."""
        self.engine.lrs.report(lr)

    @_DefaultInstanceMethod
    def measure_link(self) -> LinkMeasurement:
        """The network's latency and bandwidth, fitted to the times of this compressor's own
        collectives since the last call (comm/link.py), the same on every rank. A collective
        of the control plane: call it on every rank, between steps. A window that determines
        no link (nothing exchanged, one message size) returns ``link`` None and the reason,
        and the last link stays in ``stats()["link"]``."""
        return self.engine.measure_link()

    def abort_step(self) -> None:
        """Drop the step in flight, as when Horovod Elastic interrupts a step because a worker
        failed (its exchanges will never complete). Some layers may have folded this step's
        gradient into their error feedback already: restore a ``state_dict()`` taken between
        steps next, as ``accordion_hvd.elastic`` does."""
        if self._names is not None:
            self._names.forget_step()
        self.engine.abort()

    def world_changed(self) -> None:
        """Horovod re-formed the world (Elastic): forget collectives in flight, rebuild the
        planes for the new ranks, and compare every rank's settings again at the next
        compress (a worker that joined has not been checked yet)."""
        self.engine.world_changed()

    # --- levels, statistics, state ------------------------------------------------------------
    def set_level(self, name: str, level: Level) -> None:
        """Switch one compressed layer to a level (``acc.levels.NORMAL``, ``CRITICAL``, ...)."""
        self.engine.set_level(name, level)

    @property
    def step_skipped(self) -> bool:
        """Whether the last step was skipped: some rank's gradient was not finite, so every
        result of the step is zero and the error feedback kept its gradient. Step the
        optimizer only when it is False. Reading it waits for the device (on a GPU, one small
        copy), as a GradScaler's skip check does; the compressor itself never waits."""
        return self.engine.faults.last_skipped

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reading it waits for the device)."""
        return self.engine.faults.count

    @_DefaultInstanceMethod
    def stats(self) -> dict:
        """Cumulative floats sent by this rank and what dense would have sent, the same in
        bytes on the wire (``bytes_sent``: what each layer's collectives carried per rank at
        its level, ``codec.wire``; ``bytes_dense``: the gradients' own bytes), with each
        layer's current level ("dense" for a layer never compressed) and whether it is
        ``unused`` (no gradient on any rank in any detection window so far: known to the
        policies that measure norms, Accordion's and the network-aware one), and the last
        link ``measure_link`` measured."""
        return state.stats(self.engine)

    @_DefaultInstanceMethod
    def state_dict(self) -> dict:
        """Everything needed to resume bit for bit: each layer's codec state (error feedback,
        warm-start Q, level), the controller's and policy's state, the counters. Plain Python
        values and tensors (picklable, ``torch.save``-able). Call it between steps."""
        return state.state_dict(self.engine)

    @_DefaultInstanceMethod
    def gather_state_dict(self) -> dict | None:
        """Every rank's ``state_dict()`` at rank 0, as one *world state* for one checkpoint
        file (None on the other ranks). Collective: call it on every rank, between steps.
        Every rank then loads the saved file with ``load_state_dict`` and takes its own part
        (accordion_hvd/checkpoint.py)."""
        from .. import checkpoint
        return checkpoint.gather(self.engine.channel, self.state_dict())

    @_DefaultInstanceMethod
    def load_state_dict(self, state_dict: dict, error_feedback: bool = True) -> None:
        """Restore a ``state_dict()`` taken from a compressor with the same settings (else a
        ValueError naming the settings that differ; nothing is changed then), or this rank's
        part of a ``gather_state_dict()``.

        A state records whose it is: another rank's state (same number of ranks) is refused
        with a ValueError naming both ranks, since its error feedback is that rank's own
        unsent gradient; a state of a job with another number of ranks loads with the error
        feedback from zero, and a warning. With ``error_feedback=False`` every layer's error
        feedback starts from zero, whoever saved it."""
        state.load_state_dict(self.engine, state_dict, error_feedback)


_cycle_hinted = False  # the hint about Horovod's cycle is given once per process


def _hint_cycle() -> None:
    """Once per process, where Horovod's loop carries nothing of the steps and still wakes
    every 1 ms: its cycle then only costs CPU (patches.cycle_hint)."""
    global _cycle_hinted
    hint = None if _cycle_hinted else cycle_hint()
    if hint:
        log.warning(hint)
        _cycle_hinted = True


def _serve(compressor: AccordionCompressor, owner) -> None:
    """Take ``owner`` (a model, or Horovod's optimizer) as the one ``compressor`` serves."""
    served = compressor._owner() if compressor._owner is not None else None
    if served is not None and served is not owner:
        what = "hvd.DistributedOptimizer" if hasattr(served, "_parameter_names") else f"model ({type(served).__name__})"
        raise ValueError(f"AccordionCompressor: this compressor is already bound to another {what}; create one "
                         f"compressor per model and optimizer (its error feedback and levels belong to that model's "
                         f"layers)")
    compressor._owner = weakref.ref(owner)


def _built_with(compression, optimizer) -> None:
    """``hvd.DistributedOptimizer`` has just built ``optimizer`` with ``compression``
    (patches.install_construction_check): if it is ours, refuse here, on every rank that built
    it, an op or a process set it cannot honour and a second optimizer for one compressor."""
    if isinstance(compression, type) and issubclass(compression, AccordionCompressor):
        compression = compression.default_instance()
    if isinstance(compression, AccordionCompressor):
        reduction_scale(optimizer)  # raises naming op= or process_set=
        _serve(compression, optimizer)


install_construction_check(_built_with)  # for the class form too, where horovod.torch came first

__all__ = ["AccordionCompressor", "HorovodCompressor"]
