"""The ways the CLI trains data-parallel: Horovod (``horovodrun``, the default), PyTorch DDP
(``torchrun``, ``--launcher ddp``) and FSDP2 as HSDP (``torchrun``, ``--launcher fsdp``). The
loop (cli/train.py) sees only this face: ``name``, ``label`` (for the log), ``rank``, ``size``,
``local_rank``, ``wrap`` (the model and optimizer with the compression on), ``step`` (apply the
averaged gradients unless the compression skipped the step), ``sum`` (a small reduction for the
evaluation), ``close``; and, for the periodic ones (cli/periodic.py, ``--sync``), what they
change: ``evaluating()`` (the model every rank evaluates), ``settle()`` (nothing left in
flight), ``record()`` (steps.csv's extra columns), ``sync_state()``/``load_sync_state()``
(their part of a checkpoint), ``resumed()``."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from ..compressor import Compressor

LAUNCHERS = ("horovod", "ddp", "fsdp")


class FrontEnd:
    """What every front end shares: the face's parts only the periodic ones change."""

    sync = "every-step"  # the CLI's --sync it runs (checkpoints refuse another's)

    def evaluating(self):
        """A context in which the model is the one every rank evaluates (here: as it is)."""
        return contextlib.nullcontext()

    def settle(self) -> None:
        """Finish what is in flight between steps, on every rank (DiLoCo --overlap: the round
        in flight lands), before the compressor's epoch_end(). Here: nothing is."""

    def record(self) -> dict:
        """Extra columns of this step's steps.csv row."""
        return {}

    def sync_state(self):
        """The front end's own part of a checkpoint (None: nothing)."""
        return None

    def load_sync_state(self, state) -> None:
        pass

    def resumed(self) -> None:
        """Called once a checkpoint is loaded, everything in place."""


class HorovodFrontEnd(FrontEnd):
    """``hvd.DistributedOptimizer`` with the compression as its ``compression=``."""

    name = "horovod"
    label = name  # as the run's log says it

    def __init__(self, quiet_cycle: bool = False) -> None:
        import horovod.torch as hvd

        from ..horovod.patches import quiet_horovod_cycle

        self.hvd = hvd
        if quiet_cycle:  # only for our compressor: a Horovod baseline runs at Horovod's own default
            quiet_horovod_cycle()
        hvd.init()
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        """Returns (the module to run forward on, the optimizer to step)."""
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt = self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        return model, opt

    def step(self, opt, compression) -> None:
        opt.synchronize()
        if not compression.step_skipped:  # a non-finite gradient: skip exactly
            with opt.skip_synchronize():
                opt.step()

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        from ..comm.horovod import polite_synchronize

        return polite_synchronize(self.hvd.allreduce_async(values, op=self.hvd.Sum, name=name))

    def close(self) -> None:
        pass


class DDPFrontEnd(FrontEnd):
    """``DistributedDataParallel`` with the compression as its comm hook (Gloo for CPU
    training, NCCL for GPUs)."""

    name = "ddp"
    label = name  # as the run's log says it

    def __init__(self, device_type: str = "cpu") -> None:
        import torch.distributed as dist

        if "RANK" not in os.environ:
            raise SystemExit("--launcher ddp: start the job with torchrun (no RANK in the environment)")
        self.dist = dist
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel

        # Broadcasts rank 0's parameters; DDP's default buckets.
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if isinstance(compression, Compressor):
            from ..ddp import register_ddp_hook
            register_ddp_hook(ddp, compression, optimizer=opt)
        else:
            ddp.register_comm_hook(None, compression.ddp_hook())
        return ddp, opt

    def step(self, opt, compression) -> None:
        if not compression.step_skipped:  # the hook has averaged the gradients during backward
            opt.step()

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        reduced = values.cuda() if self.dist.get_backend() == "nccl" else values  # NCCL reduces GPU tensors only
        self.dist.all_reduce(reduced)
        return reduced.to(values.device)

    def close(self) -> None:
        # Every rank done before any tears its groups down (ours included): a rank that exits
        # while another still holds open Gloo pairs to it can abort that one (SIGABRT).
        self.dist.barrier()
        self.dist.destroy_process_group()


class FSDPFrontEnd(DDPFrontEnd):
    """FSDP2 as HSDP on a ("replicate", "shard") mesh of ``nodes`` x ranks per node: each of
    the model's ``blocks`` (if it has them) and the model sharded within a node. With our
    compression, sharded over the ``shard`` dimension and our compressed all-reduce across
    nodes (accordion_hvd/hsdp.py); otherwise PyTorch's own HSDP over the 2-D mesh, its
    all-reduce in float32 (``--codec none``) or in bfloat16 (``--codec bf16``:
    ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``)."""

    name = "fsdp"
    label = name  # as the run's log says it

    def __init__(self, device_type: str = "cpu", nodes: int | None = None, reduce_dtype: str | None = None) -> None:
        super().__init__(device_type)
        self.reduce_dtype = reduce_dtype  # ours: FSDP's reduce-scatter's dtype inside a node (None: the parameters')
        self.device_type = device_type
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
        self.nodes = nodes if nodes is not None else self.size // per_node
        if self.nodes < 1 or self.size % self.nodes:
            raise SystemExit(f"--nodes {self.nodes} does not divide the {self.size} ranks")
        self.hook = None  # our compressed all-reduce's hook (checkpoints), once wrapped

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        ours = isinstance(compression, Compressor)
        model, opt, mesh = self.shard(model, opt, compression, within_nodes=ours)
        if ours:
            from ..hsdp import compress_hsdp
            self.hook = compress_hsdp(model, compression, mesh, optimizer=opt)
        return model, opt

    def shard(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, within_nodes: bool):
        """(the model sharded with ``fully_shard``, the optimizer over its sharded parameters,
        the mesh): over ``mesh["shard"]`` alone (``within_nodes``: what crosses the nodes is
        ours to send) or over the whole 2-D mesh (PyTorch's HSDP)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 warns (once a rank) when the root returns a view (the language models' logits
        # are one: a Linear over (batch, time, dim)), lest an in-place op on it drop its hook;
        # the loop only reads the logits (loss_of), so the warning says nothing here.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)

        mesh = init_device_mesh(self.device_type, (self.nodes, self.size // self.nodes),
                                mesh_dim_names=("replicate", "shard"))
        kwargs = {"mesh": mesh["shard"] if within_nodes else mesh}
        if getattr(compression, "name", None) == "bf16" or (within_nodes and self.reduce_dtype == "bfloat16"):
            kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
            self.label = f"{self.label}, reduce in bfloat16"
        names = {id(p): n for n, p in model.named_parameters()}
        for block in getattr(model, "blocks", ()):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        # FSDP replaced the parameters by sharded ones: the same optimizer, over those
        sharded = dict(model.named_parameters())
        opt = type(opt)([{**{k: v for k, v in group.items() if k != "params"},
                          "params": [sharded[names[id(p)]] for p in group["params"]]} for group in opt.param_groups])
        self.shard_floats = sum(p.to_local().numel() for p in sharded.values() if p.requires_grad)
        return model, opt, mesh

    def step(self, opt, compression) -> None:
        if not isinstance(compression, Compressor):
            compression.count(self.shard_floats)  # FSDP's all-reduce across nodes: this rank's shards
        super().step(opt, compression)
