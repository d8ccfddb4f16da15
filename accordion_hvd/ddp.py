"""The DDP front end: ``AccordionCompressor`` as a ``torch.distributed`` DDP comm hook.

    model = DistributedDataParallel(net)
    compression = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4))
    acc.register_ddp_hook(model, compression, optimizer=opt)

The same compressor object as under Horovod, with the same codecs, exchange, policies,
controller, non-finite skip, ``stats()`` and ``state_dict()``; only the front end differs.
Each gradient reaches the compressor as soon as autograd has accumulated it, from a hook on the
parameter (``register_post_accumulate_grad_hook``), under the parameter's name, so the codec's
exchange cuts its own buckets and starts their rounds during backward exactly as under Horovod.
DDP's buckets are too coarse for that: with its defaults the last one holds the gradients of a
model's first layers, a large share of the whole, and reaches the hook only when backward is
over (measured: docs/design.md, "Measured reasons"). DDP still calls the hook once per bucket
of its own, in bucket order; a parameter that has not reached the compressor by then (one
without a gradient this step, one not known at registration) is handed over there, from DDP's
bucket. The early hooks act only after a forward of the DDP model that will synchronize
gradients (not under ``no_sync``, not without grad mode), so DDP's comm hook always ends the
step they start.

The layers the compressor does not compress (or sends whole this step) go in one averaging
collective per DDP bucket and dtype (a DENSE16 layer's float16 apart, so that it is not
promoted to float32). DDP waits for the hooks' futures only at the end of backward, so the
last bucket's hook finishes the step: it waits for the exchange, runs ``decompress`` for
every layer (the compressor's end of step: skip or settle, the levels of the next step),
writes the results into DDP's buckets and completes every future. A PowerSGD layer that came
early has its result written straight into DDP's bucket (``write_result_into``), which saves
a pass over it. Once the policy has settled every layer at 16-bit dense for good (the
default's link gate, where compression does not pay), each bucket goes to the engine whole
instead (engine/whole.py): one float16 average per bucket, with the bucket's own error
feedback. (DDP still copies each gradient into its bucket and, unless the model was
built with ``gradient_as_bucket_view=True``, the bucket back into ``.grad``: a hook cannot
spare it those copies, DDP asserts that a ``.grad`` it did not make is no view of its bucket.)

Communication: new process groups of the model's ranks, made at registration (every rank
registers): one with the model group's backend for the compressed data and one for PowerSGD's
Q rounds (comm/process_group.py), and a Gloo one for the controller's reductions
(comm/control.py). They carry nothing of DDP's own traffic, so the order in which ranks pair
collectives never mixes ours with DDP's.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .comm.channel import collective_timeout
from .binding import bind_planes
from .comm.process_group import ProcessGroupChannel
from .buffered_step import BufferedStep
from .compressor import Compressor

log = logging.getLogger("accordion_hvd.ddp")


def register_ddp_hook(ddp_model, compressor: Compressor, *, optimizer=None, process_group=None,
                      timeout: float | None = None) -> "DDPHook":
    """Register ``compressor`` as ``ddp_model``'s comm hook; returns the hook.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model, before its first
            backward.
        compressor: an ``acc.Compressor`` (or ``acc.AccordionCompressor``, the same with Horovod's
            interface) not used by any other model.
        optimizer: the model's optimizer, whose learning rates policies that react to them
            read (else call ``compressor.report_lr``).
        process_group: the group to communicate in; default (and only allowed value): the
            model's own group's ranks.
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"ddp_model must be a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__} (wrap the model in DDP first)")
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be an acc.Compressor (or acc.AccordionCompressor), got {type(compressor).__name__}")
    if any(p.grad is not None for p in ddp_model.module.parameters()):
        # A backward has run: DDP has averaged that step its own way, and a hook registered now
        # would start mid-training with no error feedback. (Checked before any collective:
        # every rank of a job that trains alike refuses here.)
        raise RuntimeError("register_ddp_hook must be called before the model's first backward (its parameters "
                           "already have gradients): register the hook right after wrapping the model in DDP")
    group = ddp_model.process_group
    ranks = dist.get_process_group_ranks(group)
    if process_group is not None and dist.get_process_group_ranks(process_group) != ranks:
        raise ValueError(f"process_group has ranks {dist.get_process_group_ranks(process_group)}, but the model "
                         f"communicates in ranks {ranks}; pass the model's own group or none")
    timeout = collective_timeout(timeout)
    # New groups are collective calls: every rank makes them here, in the same order.
    channel = bind_planes(compressor, ddp_model, ranks, timeout, lanes=("q",), backend=dist.get_backend(group),
                          optimizer=optimizer)
    hook = DDPHook(compressor, channel, {p: n for n, p in ddp_model.module.named_parameters()})
    ddp_model.register_comm_hook(None, hook)
    hook.attach(ddp_model)
    return hook


class DDPHook:
    """The comm hook (see module doc). ``hook(state, bucket)`` -> a future of the bucket's
    averaged gradients."""

    def __init__(self, compressor: Compressor, channel: ProcessGroupChannel, names: dict) -> None:
        self.compressor, self.engine, self.channel = compressor, compressor.engine, channel
        self.step = BufferedStep(self.engine, "acc.ddp")
        self.__name__ = self.__qualname__ = "accordion_hook"  # DDP logs its hooks by name
        self._names = {id(p): (weakref.ref(p), n) for p, n in names.items()}  # no reference kept to the model
        self._unknown_warned: set[tuple] = set()
        self._futures: list = []  # this step, per bucket: (future, buffer)
        self._early: dict[int, tuple] = {}  # this step: id(param) -> the engine's (out, route) for it
        self._armed = False  # a forward that synchronizes ran: DDP will call the hook this backward
        self._handles: list = []

    def attach(self, ddp_model) -> None:
        """Hand each gradient to the compressor as soon as it is accumulated (module doc)."""
        def arm(module, args):
            self._armed = torch.is_grad_enabled() and module.require_backward_grad_sync

        self._handles.append(ddp_model.register_forward_pre_hook(arm))
        for param in ddp_model.module.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._accumulated))

    def remove(self) -> None:
        """Remove the early hooks (DDP's comm hook itself cannot be unregistered)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _accumulated(self, param: torch.Tensor) -> None:
        ref, name = self._names.get(id(param), (None, None))
        if not self._armed or ref is None or ref() is not param or id(param) in self._early:
            return  # DDP's bucket brings it to the comm hook
        if self.engine.settled_dense:
            return  # the bucket goes whole (_whole_bucket)
        self._early[id(param)] = self.engine.add(name, param.grad)  # (out, route): the bucket's step.took

    def __call__(self, state, bucket):  # no annotations: DDP compares them to its own types
        future: torch.futures.Future = torch.futures.Future()
        if self.engine.settled_dense and not self._early:  # (the same on every rank, all step long)
            self._whole_bucket(bucket)
        else:
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                ref, name = self._names.get(id(param), (None, None))
                if ref is None or ref() is not param:  # not the model's at registration: averaged as it is
                    self._warn_unknown(bucket.index(), param)
                    self.step.add_as_is(grad, grad)
                elif id(param) not in self._early:  # no accumulated gradient this step, or not armed
                    self.step.add(name, grad, grad)
                else:  # came early: its result straight into DDP's bucket if the codec can, not copied there
                    self.engine.write_result_into(name, grad)  # in finish (the values there are not read)
                    self.step.took(name, *self._early[id(param)], grad)
            self.step.send(f"b{bucket.index()}")
        self._futures.append((future, bucket.buffer()))
        if bucket.is_last():
            self._finish_step()
        return future

    def _whole_bucket(self, bucket) -> None:
        """Once the policy settled every layer at 16-bit dense for good (the default's link
        gate, where compression does not pay): DDP's bucket whole, one float16 average with
        the bucket's own error feedback (engine/whole.py), none of the per-layer host work."""
        layers = []
        for i, (param, grad) in enumerate(zip(bucket.parameters(), bucket.gradients())):
            ref, name = self._names.get(id(param), (None, None))
            if ref is None or ref() is not param:
                self._warn_unknown(bucket.index(), param)
                name = f"<bucket {bucket.index()} parameter {i}>"
            layers.append((name, grad.numel()))
        key = f"ddp:bucket{bucket.index()}"
        self.step.send_whole(key, bucket.buffer(), self.engine.add_whole(key, bucket.buffer(), layers), None)

    def _finish_step(self) -> None:
        """Every bucket is in: finish the step (buffered_step.py), then write the results into
        DDP's buckets and complete every future."""
        futures, self._futures = self._futures, []
        self._early, self._armed = {}, False
        results, _ = self.step.finish()
        for grad, result in results:  # after end_step: a skipped step zeroed its results
            if result.data_ptr() != grad.data_ptr():
                grad.copy_(result.view_as(grad))
        for future, buffer in futures:
            future.set_result(buffer)

    def _warn_unknown(self, index: int, param: torch.Tensor) -> None:
        key = (index, tuple(param.shape))
        if key not in self._unknown_warned:
            self._unknown_warned.add(key)
            log.warning("DDP bucket %d holds a parameter of shape %s that the model did not have when the hook "
                        "was registered; it is averaged uncompressed", index, list(param.shape))
