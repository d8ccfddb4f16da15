"""``acc.Compressor``: the compressor every front end takes, whatever framework drives it (the
DDP hook, HSDP, DiLoCo, OneBitAdam; Horovod takes ``acc.AccordionCompressor``, this class with
Horovod's ``compress``/``decompress``).

It holds the step engine (accordion_hvd/engine/) and what a user does with a compressor
between steps: its settings, statistics and state, explicit detection points, the learning
rate for policies that react to it, and the one model (or optimizer) it serves. The front
ends add only their framework's plumbing: Horovod's ``Compressor`` interface
(``acc.AccordionCompressor``, accordion_hvd/horovod/compressor.py, which users create for
every front end: it is this class plus ``compress``/``decompress``), DDP's comm hook
(accordion_hvd/ddp.py) and FSDP2's all-reduce hook (accordion_hvd/hsdp.py), which ``bind`` a
compressor to their model and planes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .codecs import Codec
from .comm.link import LinkMeasurement
from .engine import StepEngine, state
from .exchange import BUCKET_BYTES
from .levels import Level


class Compressor:
    """Args:
        codec: ``acc.PowerSGD(...)``, ``acc.TopK(...)``, ``acc.Quantize(...)``, or any codec of
            the protocol in accordion_hvd/codecs/base.py with a registered exchange
            (``acc.codecs``); default ``acc.codecs.default_codec()`` (with ``policy=None``: the
            default configuration, below; docs/time-to-quality.md says what it is and why).
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
        channel: the data plane (default: the front end's; under Horovod our own Gloo group
            over Horovod's ranks for CPU gradients, Horovod's collectives for GPU ones:
            comm/planes.py); tests pass a simulated one.
        control: the control plane for the controller's reductions (default: the front end's;
            under Horovod MPI when its world is Horovod's, else the data plane's own Gloo
            group, else Horovod; see accordion_hvd/comm/control.py).
        bucket_cap_mb: megabytes of gradient per bucket of the first round (DDP's default,
            25; the first bucket closes at 1 MB or this, whichever is smaller, and the last
            layers up to that size form a bucket of their own: exchange/buckets.py). A bucket's
            collective starts as soon as all its layers are encoded (accordion_hvd/exchange/).
    """

    def __init__(self, codec: Codec | None = None, *, eta: float = 0.5, interval: int | None = 100,
                 policy: Any = None, accumulate: bool = True, channel: Any = None, control: Any = None,
                 bucket_cap_mb: float = BUCKET_BYTES / 2**20) -> None:
        self.engine = StepEngine(codec, eta=eta, interval=interval, policy=policy, accumulate=accumulate,
                                 channel=channel, control=control, bucket_cap_mb=bucket_cap_mb)
        self._owner = None  # weakref to the one model (or Horovod optimizer) this compressor serves

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.codec!r}, policy={self.policy!r}, interval={self.interval})"

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

    # --- a front end takes it ------------------------------------------------------------------
    def serve(self, owner) -> None:
        """Take ``owner`` (a model, or Horovod's optimizer) as the one this compressor serves:
        its error feedback and levels belong to that model's layers. Another owner while the
        first is alive is refused."""
        served = self._owner() if self._owner is not None else None
        if served is not None and served is not owner:
            what = "hvd.DistributedOptimizer" if hasattr(served, "_parameter_names") else f"model ({type(served).__name__})"
            raise ValueError(f"AccordionCompressor: this compressor is already bound to another {what}; create one "
                             f"compressor per model and optimizer (its error feedback and levels belong to that "
                             f"model's layers)")
        self._owner = weakref.ref(owner)

    def bind(self, owner, *, channel, control, optimizer=None, speaks: bool | None = None,
             front_end: str = "AccordionCompressor", settings: dict | None = None,
             device_type: str | None = None, start: tuple[str, str] | None = None) -> None:
        """Attach this compressor to a front end (the DDP and HSDP hooks, DiLoCo, OneBitAdam):
        ``owner`` (``serve``), its data plane and control plane (None: the default planes,
        Horovod's world), the optimizer whose learning rates the policy reads (if given), and
        what the front end declares to the engine (``StepEngine.declare``): whether this rank
        logs for the job (``speaks``; default: rank 0 of the data plane), its name, its settings
        every rank must share, its gradients' device type and its start check."""
        self.serve(owner)
        if channel is not None:  # else the default planes (comm/planes.py: Horovod's world)
            self.engine.use_planes(channel, control)
        self.engine.declare(front_end, settings=settings, device_type=device_type, speaks=speaks, start=start)
        if optimizer is not None:
            self.engine.lrs.watch(optimizer)

    def count_local_step(self, gradients) -> None:
        """A step whose gradients did not cross the network (an inner step of ``acc.DiLoCo``
        between rounds): ``gradients``, (name, tensor) pairs, count in ``floats_dense`` and
        ``bytes_dense`` as a dense step would have sent them, and nothing in ``floats_sent``,
        so that ``stats()`` compares a periodic method with per-step dense training."""
        for name, tensor in gradients:
            self.engine.counters.gradient(name, tensor.numel(), tensor.numel() * tensor.element_size())

    # --- one layer at a time, named (tests, front ends that know the names) ---------------------
    def compress_named(self, name: str, tensor: torch.Tensor):
        """Hand layer ``name``'s gradient to the engine; returns (tensor, context) as Horovod's
        ``compress`` does. The gradient is consumed: it is folded into the error feedback, and
        a PowerSGD layer's result is written into its memory. Pass a copy to keep the
        gradient. An uncompressed layer is returned as it is, for the caller to average."""
        out, route = self.engine.add(name, tensor)
        return (tensor.new_empty(0) if out is None else out), (route, name)

    def write_result_into(self, name: str, target: torch.Tensor) -> bool:
        """Ask that ``name``'s result this step be written into ``target`` (engine docs)."""
        return self.engine.write_result_into(name, target)

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        return self.engine.config()

    # --- what users call between steps ---------------------------------------------------------
    def epoch_end(self) -> None:
        """An explicit detection point, on every rank at the same point (used when the
        compressor was created with ``interval=None``; otherwise ignored with a warning)."""
        self.engine.between.epoch_end()

    def report_lr(self, lr) -> None:
        """Tell the controller the learning rate(s) (a number or one per param group), for
        front ends where it cannot read them from the optimizer; overrides that."""
        self.engine.lrs.report(lr)

    def measure_link(self) -> LinkMeasurement:
        """The network's latency and bandwidth, fitted to the times of this compressor's own
        collectives since the last call (comm/link.py), the same on every rank. A collective
        of the control plane: call it on every rank, between steps. A window that determines
        no link (nothing exchanged, one message size) returns ``link`` None and the reason,
        and the last link stays in ``stats()["link"]``."""
        return self.engine.between.measure_link()

    def abort_step(self) -> None:
        """Drop the step in flight, as when Horovod Elastic interrupts a step because a worker
        failed (its exchanges will never complete). Some layers may have folded this step's
        gradient into their error feedback already: restore a ``state_dict()`` taken between
        steps next, as ``accordion_hvd.elastic`` does."""
        self.engine.abort()

    def world_changed(self) -> None:
        """The world was re-formed (Horovod Elastic): forget collectives in flight, rebuild the
        planes for the new ranks, and compare every rank's settings again at the next step (a
        worker that joined has not been checked yet)."""
        self.engine.world_changed()

    # --- levels, statistics, state ------------------------------------------------------------
    def set_level(self, name: str, level: Level) -> None:
        """Switch one compressed layer to a level (``acc.levels.NORMAL``, ``CRITICAL``, ...)."""
        self.engine.between.set_level(name, level)

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

    def stats(self) -> dict:
        """Cumulative floats sent by this rank and what dense would have sent, the same in
        bytes on the wire (``bytes_sent``: what each layer's collectives carried per rank at
        its level, ``codec.wire``; ``bytes_dense``: the gradients' own bytes), with each
        layer's current level ("dense" for a layer never compressed) and whether it is
        ``unused`` (no gradient on any rank in any detection window so far: known to the
        policies that measure norms, Accordion's and the network-aware one), the last link
        ``measure_link`` measured, and the link gate's verdict (``gate``; None for other
        policies)."""
        return state.stats(self.engine)

    def state_dict(self) -> dict:
        """Everything needed to resume bit for bit: each layer's codec state (error feedback,
        warm-start Q, level), the controller's and policy's state, the counters. Plain Python
        values and tensors (picklable, ``torch.save``-able). Call it between steps."""
        return state.state_dict(self.engine)

    def gather_state_dict(self) -> dict | None:
        """Every rank's ``state_dict()`` at rank 0, as one *world state* for one checkpoint
        file (None on the other ranks). Collective: call it on every rank, between steps.
        Every rank then loads the saved file with ``load_state_dict`` and takes its own part
        (accordion_hvd/checkpoint.py)."""
        from . import checkpoint
        return checkpoint.gather(self.engine.channel, self.state_dict())

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


__all__ = ["Compressor"]
