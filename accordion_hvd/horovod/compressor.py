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

Everything else a compressor is (settings, statistics, state, binding to a model) is the
front-end-neutral ``Compressor`` (accordion_hvd/compressor.py) this class extends, so the same
object serves the DDP and HSDP front ends and Horovod Elastic; the work is the engine's
(accordion_hvd/engine/).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..codecs import Codec
from ..compressor import Compressor
from ..engine.settings import parameters_digest
from ..exchange import BUCKET_BYTES
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


class AccordionCompressor(Compressor, HorovodCompressor):
    """Adaptive gradient compression for ``hvd.DistributedOptimizer(..., compression=...)``: a
    Horovod ``Compressor`` whose ``compress``/``decompress`` are instance methods (the class
    itself also works as ``compression=``: it then uses one default instance). The same
    object is what ``acc.register_ddp_hook`` and ``acc.compress_hsdp`` take.

    Args: those of ``Compressor`` (accordion_hvd/compressor.py: codec, eta, interval, policy,
    accumulate, channel, control, bucket_cap_mb), and for Horovod:
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
        super().__init__(codec, eta=eta, interval=interval, policy=policy, accumulate=accumulate, channel=channel,
                         control=control, bucket_cap_mb=bucket_cap_mb)
        self._names = None if named_parameters is None else GradientNames(named_parameters)
        self.wait = check_wait(wait)
        self._met_horovod = False   # compress() was called by Horovod: its op checked, patches installed
        self._bypass = False        # uncompressed layers travel on our data plane too
        install_construction_check(_built_with)  # refusals at hvd.DistributedOptimizer(...), on every rank

    @classmethod
    def default_instance(cls) -> "AccordionCompressor":
        if cls.__dict__.get("_default") is None:
            cls._default = cls()
        return cls._default

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
            self._meet_horovod(optimizer, tensor.device.type if isinstance(tensor, torch.Tensor) else None)
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

    def _meet_horovod(self, optimizer, device_type: str | None) -> None:
        """The first ``compress`` from Horovod's optimizer: honour its ``op`` or refuse it
        (seam.reduction_scale: before any collective, so a refusal never leaves a rank
        waiting), agree on the settings, Horovod's op among them, and on the parameters the
        optimizer starts from, with every rank, and take the uncompressed gradients off Horovod."""
        scale = reduction_scale(optimizer)
        start = None
        if optimizer is not None and self.engine.counters.steps == 0:  # (a joiner of Elastic: not compared)
            start = (parameters_digest(p for group in optimizer.param_groups for p in group["params"]),
                     "broadcast rank 0's before the first step: hvd.broadcast_parameters(model.state_dict(), "
                     "root_rank=0), as Horovod's examples do")
        # The settings are kept: every later check (a world re-formed by Elastic) compares them
        # again, also with a worker that joined and meets Horovod for the first time.
        self.engine.declare("AccordionCompressor", device_type=device_type, result_scale=scale, start=start,
                            settings={"horovod_op": None if optimizer is None else horovod_op_name(optimizer)})
        self.engine.agree_settings()
        if optimizer is not None:  # (also checked as Horovod built it, where the wrapper was in place)
            self.serve(optimizer)
        install_polite_wait(self.wait)  # first: it also makes Horovod's optimizer read bypass handles
        install_bypass()
        why_not = bypass_allowed(optimizer)
        self._bypass = why_not is None
        if why_not:
            log.info("AccordionCompressor: uncompressed gradients go through Horovod's allreduce: %s", why_not)
        if self._bypass and self.engine.between.speaks:  # none of the steps' data goes through Horovod's loop
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

    def abort_step(self) -> None:
        if self._names is not None:
            self._names.forget_step()
        super().abort_step()

    abort_step.__doc__ = Compressor.abort_step.__doc__


# What users call between steps works on the class too (its default instance), as compress does.
for _name in ("epoch_end", "report_lr", "measure_link", "stats", "state_dict", "gather_state_dict", "load_state_dict"):
    setattr(AccordionCompressor, _name, _DefaultInstanceMethod(getattr(Compressor, _name)))


_cycle_hinted = False  # the hint about Horovod's cycle is given once per process


def _hint_cycle() -> None:
    """Once per process, where Horovod's loop carries nothing of the steps and still wakes
    every 1 ms: its cycle then only costs CPU (patches.cycle_hint)."""
    global _cycle_hinted
    hint = None if _cycle_hinted else cycle_hint()
    if hint:
        log.warning(hint)
        _cycle_hinted = True


def _built_with(compression, optimizer) -> None:
    """``hvd.DistributedOptimizer`` has just built ``optimizer`` with ``compression``
    (patches.install_construction_check): if it is ours, refuse here, on every rank that built
    it, an op or a process set it cannot honour and a second optimizer for one compressor."""
    if isinstance(compression, Codec) or isinstance(compression, type) and issubclass(compression, Codec):
        compression.compress()  # raises: a codec is not a compressor (codecs/base.py)
    if isinstance(compression, type) and issubclass(compression, AccordionCompressor):
        compression = compression.default_instance()
    if isinstance(compression, AccordionCompressor):
        reduction_scale(optimizer)  # raises naming op= or process_set=
        compression.serve(optimizer)


install_construction_check(_built_with)  # for the class form too, where horovod.torch came first

__all__ = ["AccordionCompressor", "HorovodCompressor"]
