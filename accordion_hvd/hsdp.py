"""The FSDP2 front end: our compressed all-reduce across nodes for HSDP.

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    hook = acc.compress_hsdp(model, acc.AccordionCompressor(), mesh, optimizer=opt)

HSDP shards a model within a node over the fast links and all-reduces the shards across
nodes over the slow network. PyTorch compresses nothing there. Sharded over the ``shard``
dimension alone, FSDP2 reduce-scatters each module's gradients within the node and hands the
flat reduce-scatter output to the module's all-reduce hook (``set_all_reduce_hook``) before
it makes the gradients views of that buffer. Our hook is that all-reduce, across the
``replicate`` dimension, through the same engine, codecs, policies and kernels as the Horovod
and DDP front ends:

1. **In the hook** (during backward, module by module): each parameter's local shard is a
   layer, under the parameter's name, with the shard's padded shape. The padding (FSDP pads
   dim 0 to a multiple of the ranks per node) is zero, so every rank of a layer sees the same
   shape, however unevenly the rows divide, and the codecs' results there are zero. The
   engine routes it and its exchange starts the rounds while backward goes on. Layers the
   engine hands back (sent whole this step) are averaged on our data plane, one collective
   per module and dtype. Once the policy has settled every layer at 16-bit dense for good
   (the default's link gate, where compression does not pay), the module's buffer goes to the
   engine whole instead (engine/whole.py): one float16 average per module, its rounding kept
   in error feedback, without the per-layer route's host work for every parameter.
2. **At the end of backward** (an autograd final callback, queued at the first hook): the
   step's results are collected, and one flag, reduced inside the node, says whether any
   rank's results were not finite (a non-finite gradient skips the step on every rank, in
   every shard group: the shard groups are separate worlds for the data). On the settled
   route that flag is reduced earlier, in the hook of the step's last buffer (this node's
   own gradients' flags, as its ranks leave that buffer's reduce-scatter), and goes across
   nodes inside that buffer (NaN if set): every rank reads every fault in its own averages,
   and the end of the step waits for no other rank of the node. The engine ends
   the step, and the results are written into FSDP's buffer, which its sharded gradients view,
   or, where FSDP reduces in a dtype other than the parameters' (``MixedPrecisionPolicy(
   reduce_dtype=torch.bfloat16)`` with float32 parameters: the reduce-scatter inside the node
   in half the bytes), into the gradients themselves, which FSDP cast from the buffer after
   the hook returned.

Communication: the data plane is the replicate group of this rank's shard (the ranks that
hold the same shard on every node), made at registration, with more groups of the same ranks
for PowerSGD's Q rounds and the uncompressed layers; the node's shard group carries the
step's fault flag; the control plane (window norms, learning rates) is a Gloo group of every
rank, so levels are decided alike on every rank of the job.

What FSDP must leave alone for the results to land: a reduce dtype of float32 or bfloat16
(FSDP divides others after the hook), no CPU offload, and gradients set to None before each
backward (``zero_grad()``'s default), since FSDP adds a new gradient into an existing one at
once. Registration refuses the rest with a clear error, the same on every rank.

Checkpoints: ``hook.state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol), for
``torch.distributed.checkpoint`` beside the model and optimizer: every rank's own state
under a key of its rank and the mesh. On the same mesh a resumed run continues bit for bit;
on another mesh (load with ``DefaultLoadPlanner(allow_partial_load=True)``) the compressor
starts again from zero error feedback, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging

import torch

from . import ops
from .comm.channel import collective_timeout
from .comm.control import ProcessGroupControlPlane
from .binding import bind_planes
from .comm.mesh import check_mesh, node_channel
from .comm.process_group import ProcessGroupChannel, timeout_delta
from .engine import settings
from .buffered_step import BufferedStep
from .compressor import Compressor

log = logging.getLogger("accordion_hvd.hsdp")

FLOAT_REDUCE = (torch.float32, torch.bfloat16)  # FSDP divides other reduce dtypes after the hook


class HookedModule:
    """What the hook knows of one FSDP module: ``layout``, (name, FSDPParam) of each parameter
    FSDP reduces, in the order of its reduce-scatter buffer; ``cast``: whether FSDP casts that
    buffer into new gradients after the hook (reduce dtype other than the parameters'), so
    that the results go into the gradients rather than into the buffer."""

    def __init__(self, layout: list[tuple], cast: bool) -> None:
        self.layout, self.cast = layout, cast
        self.key = f"hsdp:{layout[0][0]}" if layout else None  # its buffer, on the settled route
        # (name, elements) of each padded shard in the buffer: fixed, as FSDP's layout is
        self.sizes = [(name, fsdp_param.padded_sharded_param_size.numel()) for name, fsdp_param in layout]
        self.numel = sum(numel for _, numel in self.sizes)


def compress_hsdp(model, compressor: Compressor, mesh, *, optimizer=None,
                  timeout: float | None = None) -> "HSDPHook":
    """Compress ``model``'s cross-node all-reduce with ``compressor``; returns the hook.

    Args:
        model: the root module, after ``fully_shard(..., mesh=mesh["shard"])`` of it and of
            any submodules, before its first backward.
        compressor: an ``acc.Compressor`` (or ``acc.AccordionCompressor``, the same with Horovod's
            interface) not bound to another model.
        mesh: the 2-D ``DeviceMesh`` with dimensions ("replicate", "shard") whose ``shard``
            dimension the model was sharded over.
        optimizer: the model's optimizer, whose learning rates policies read (else call
            ``compressor.report_lr``).
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """
    import torch.distributed as dist

    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be an acc.Compressor (or acc.AccordionCompressor), got {type(compressor).__name__}")
    check_mesh(mesh)
    world = dist.get_world_size()
    if mesh.mesh.numel() != world:
        raise ValueError(f"mesh must span every rank of the job ({world}), got {mesh.mesh.numel()} ranks")
    groups = _fsdp_groups(model, mesh)
    timeout = collective_timeout(timeout)
    # Every rank makes every group, in the same order (new_group is collective).
    control_group = dist.new_group(list(range(world)), timeout=timeout_delta(timeout), backend="gloo")
    control = ProcessGroupControlPlane(control_group, dist.get_rank(), world, timeout)
    _agree(control_group, model, compressor, mesh, timeout)
    # the data, PowerSGD's Q rounds and the uncompressed layers' round: lanes that pair apart
    channel = bind_planes(compressor, model, list(range(world)), timeout, lanes=("q", "dense"), mesh=mesh,
                          control=control, optimizer=optimizer,
                          speaks=dist.get_rank() == 0)  # each shard group's data plane has a rank 0: one speaks
    node_faults = node_channel(mesh, timeout)  # the step's fault flag, inside the node
    hook = HSDPHook(compressor, channel, node_faults, mesh, buffers=sum(1 for _, known in groups if known.layout))
    for module, known in groups:
        module.set_reduce_scatter_unused_params(True, recurse=False)  # a fixed buffer layout every step
        module.set_all_reduce_hook(hook.for_module(known))
    return hook


def _fsdp_groups(model, mesh) -> list[tuple]:
    """(module, HookedModule) of every FSDP2 module of ``model``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import DDPMeshInfo

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError(f"model must be sharded with FSDP2's fully_shard(module, mesh=mesh['shard']); no module of "
                        f"the {type(model).__name__} given is an FSDPModule")
    names = {id(p): n for n, p in model.named_parameters()}
    shard_ranks = mesh["shard"].mesh.tolist()
    out = []
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            where = type(module).__name__
            if isinstance(group.mesh_info, DDPMeshInfo):
                raise ValueError(f"{where} was sharded over the 2-D mesh: FSDP would all-reduce it across nodes "
                                 f"itself, uncompressed; shard with fully_shard(module, mesh=mesh['shard'])")
            if group.mesh_info.mesh.mesh.tolist() != shard_ranks:
                raise ValueError(f"{where} was sharded over ranks {group.mesh_info.mesh.mesh.tolist()}, not over "
                                 f"the mesh's shard dimension {shard_ranks}")
            layout, casts = [], set()
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                name = names.get(id(param))
                if name is None:
                    raise ValueError(f"a parameter of {where} is not one of the model's named parameters")
                cast = _check_param(name, fsdp_param, group.mp_policy)
                if param.requires_grad:
                    casts.add(cast)
                    layout.append((name, fsdp_param))
            if len(casts) > 1:
                raise ValueError(f"{where}: FSDP would cast the reduced gradients of some of its parameters and not "
                                 f"of others (parameters of more than one dtype); give its parameters one dtype")
            out.append((module, HookedModule(layout, casts == {True})))
    return out


def _check_param(name: str, fsdp_param, mp_policy) -> bool:
    """Refuses what the hook cannot serve; returns whether FSDP casts the reduced gradient
    into the parameter's dtype after the hook."""
    dtype = mp_policy.param_dtype or fsdp_param.sharded_param.dtype
    reduce = mp_policy.reduce_dtype or dtype
    if reduce not in FLOAT_REDUCE:
        raise ValueError(f"{name}: reduce dtype {reduce}; the compressed all-reduce needs float32 or bfloat16 "
                         f"(MixedPrecisionPolicy(reduce_dtype=...)): FSDP divides other dtypes after the hook")
    if fsdp_param.offload_to_cpu:
        raise ValueError(f"{name}: CPU offload (CPUOffloadPolicy) is not supported: FSDP copies the reduced "
                         f"gradient to the host before the compressed all-reduce ends")
    if fsdp_param.fsdp_placement.dim != 0:
        raise ValueError(f"{name}: sharded on dim {fsdp_param.fsdp_placement.dim}; only dim 0 (FSDP's default)")
    return reduce != fsdp_param.sharded_param.dtype


def _agree(group, model, compressor, mesh, timeout: float) -> None:
    """Every rank's mesh, parameters and compressor settings compared at registration: the
    same ValueError on every rank if any differ (engine/settings.py)."""
    import torch.distributed as dist

    shapes = settings.canonical([[n, list(p.shape), p.requires_grad] for n, p in model.named_parameters()])
    channel = ProcessGroupChannel(group, dist.get_rank(), dist.get_world_size(), timeout)
    settings.agree(channel, {**compressor.engine.config(), "mesh": list(mesh.shape),
                             "parameters (sha256 of names, shapes, requires_grad)":
                                 hashlib.sha256(shapes.encode()).hexdigest()[:16]})


class HSDPHook:
    """One step of the compressed all-reduce (module doc); ``state_dict``/``load_state_dict``
    for ``torch.distributed.checkpoint``."""

    def __init__(self, compressor: Compressor, channel: ProcessGroupChannel,
                 node_faults: ProcessGroupChannel | None, mesh, buffers: int) -> None:
        import torch.distributed as dist

        self.compressor, self.engine, self.channel = compressor, compressor.engine, channel
        self.step = BufferedStep(self.engine, "acc.hsdp")
        self.node_faults = node_faults  # this node's shard group; None with one shard group
        self.mesh_key = "x".join(map(str, mesh.shape))  # replicate x shard
        self.rank_key = f"accordion.{self.mesh_key}.rank{dist.get_rank()}"
        self._calls = 0  # this step: hook calls so far
        self._whole = False  # this step: settled, the buffers go whole (the same on every rank)
        self._buffers = buffers  # hook calls with parameters to reduce in a step where every module takes part
        self._verdict_sent = False  # this step: the node's fault verdict went out in the last buffer
        self._queued = False

    def for_module(self, module: HookedModule):
        """The all-reduce hook of one FSDP module."""
        return functools.partial(self._reduced, module=module)

    def _reduced(self, reduce_output: torch.Tensor, module: HookedModule) -> None:
        """FSDP's all-reduce hook for one module: every shard into the engine (module doc)."""
        layout = module.layout
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
            self._queued = True
            self._whole = self.engine.settled_dense
        if reduce_output.numel() != module.numel or not reduce_output.is_contiguous():
            raise RuntimeError(f"compress_hsdp: FSDP's reduce-scatter output has {reduce_output.numel()} elements, "
                               f"its parameters {module.numel}: a layout this front end does not know")
        self._check_fresh(reduce_output, layout)
        if self._whole:
            if layout:
                self._send_whole(reduce_output, module)
            return
        for name, fsdp_param, view in self._shards(reduce_output, layout):
            # the result goes into the gradient FSDP casts from the buffer, or into the buffer
            self.step.add(name, view, (view, name, fsdp_param if module.cast else None), uncompressed_here=True)
        self.step.send(str(self._calls))  # every rank of the group: the same averages, in the same order
        self._calls += 1

    @staticmethod
    def _shards(reduce_output: torch.Tensor, layout: list[tuple]):
        """(name, FSDPParam, view) of each parameter's padded shard in FSDP's buffer."""
        offset = 0
        for name, fsdp_param in layout:
            shape = fsdp_param.padded_sharded_param_size
            yield name, fsdp_param, reduce_output[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()

    @staticmethod
    def _check_fresh(reduce_output: torch.Tensor, layout: list[tuple]) -> None:
        """In the hook: a gradient left from an earlier backward refused (FSDP would add into
        it after the hook), and the padding rows zeroed (FSDP pads with zeros; made sure)."""
        offset = 0
        for name, fsdp_param in layout:
            shape = fsdp_param.padded_sharded_param_size
            if fsdp_param.sharded_param.grad is not None:
                raise RuntimeError(f"compress_hsdp: {name} has a gradient from an earlier backward; set gradients "
                                   f"to None before each backward (optimizer.zero_grad() does by default)")
            rows = fsdp_param.sharded_size[0]
            if rows < shape[0]:
                reduce_output[offset:offset + shape.numel()].view(shape)[rows:].zero_()
            offset += shape.numel()

    def _send_whole(self, reduce_output: torch.Tensor, module: HookedModule) -> None:
        """Once the policy settled on 16-bit dense for good: the module's buffer whole, one
        average (engine/whole.py), as FSDP's own all-reduce would send it: a float32 buffer in
        float16 with its rounding kept in error feedback, a bfloat16 one as it is."""
        half = self.engine.add_whole(module.key, reduce_output, module.sizes)
        if self.node_faults is not None and self.step.sent_whole + 1 == self._buffers:
            self._send_node_verdict(half)
        self.step.send_whole(module.key, reduce_output, half, (module, reduce_output))

    def _send_node_verdict(self, half: torch.Tensor) -> None:
        """The step's last buffer carries the node's fault verdict across nodes: NaN if any
        rank of this node had a non-finite gradient this step (one flag reduced inside the
        node, whose ranks have just met in FSDP's reduce-scatter of this very module: little
        waiting). Every rank then finds every rank's fault in its own averages (a NaN from any
        node reaches every rank of each shard group), and the end of the step needs no
        agreement inside the node (``BufferedStep.finish(agree_over=)``). On the settled route only: the
        per-layer route's layers take routes that carry no such poison."""
        bad = self.engine.local_fault()
        flag = torch.zeros((), device=half.device) if bad is None else bad.to(torch.float32)
        node_bad = self.node_faults.wait(self.node_faults.allreduce_mean_async([flag], name="acc.hsdp.fault.node"))[0]
        ops.fill_if_([half], node_bad > 0, float("nan"))
        self._verdict_sent = True

    def _finish_step(self) -> None:
        """The end of backward: finish the step (agreeing on faults inside the node unless the
        last buffer carried them), then write the results (module doc)."""
        agree = self.node_faults is not None and not self._verdict_sent
        self._queued, self._verdict_sent, self._calls, self._whole = False, False, 0, False
        results, wholes = self.step.finish(self.node_faults if agree else None)
        # after end_step: a skipped step zeroed its results
        for (view, name, target), result in results:
            if target is not None:
                self._write_grad(name, target, result.view_as(view))
            elif result.data_ptr() != view.data_ptr():
                view.copy_(result.view_as(view))
        for module, buffer in wholes:
            if module.cast:
                for name, fsdp_param, view in self._shards(buffer, module.layout):
                    self._write_grad(name, fsdp_param, view)

    @staticmethod
    @torch.no_grad()
    def _write_grad(name: str, fsdp_param, result: torch.Tensor) -> None:
        """A result into the gradient FSDP cast from its buffer after the hook (its rows of
        the padded shard; FSDP's gradient holds the shard unpadded)."""
        grad = fsdp_param.sharded_param.grad
        if grad is None:
            raise RuntimeError(f"compress_hsdp: FSDP made no gradient for {name} after its reduce-scatter")
        local = grad.to_local()
        local.copy_(result[:local.shape[0]])

    # --- torch.distributed.checkpoint --------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's compressor state, under a key of its rank and the mesh, as one
        serialized value: DCP loads into the structure this returns, and a fresh compressor's
        has no layers yet, so a nested state would come back without them."""
        buffer = io.BytesIO()
        torch.save(self.compressor.state_dict(), buffer)
        return {"accordion.mesh": self.mesh_key, self.rank_key: buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get(self.rank_key)
        if state.get("accordion.mesh") != self.mesh_key or not isinstance(mine, bytes):
            log.warning("compress_hsdp: the checkpoint's compressor state is of mesh %s, this job's %s: the "
                        "compressor starts again (error feedback from zero)", state.get("accordion.mesh"),
                        self.mesh_key)
            return
        self.compressor.load_state_dict(torch.load(io.BytesIO(mine), weights_only=True))
