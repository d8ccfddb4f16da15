"""The two ways the CLI trains data-parallel: Horovod (``horovodrun``, the default) and
PyTorch DDP (``torchrun``, ``--launcher ddp``). The loop (cli/train.py) sees only this face:
``rank``, ``size``, ``local_rank``, ``wrap`` (the model and optimizer with the compression on),
``step`` (apply the averaged gradients unless the compression skipped the step), ``sum``
(a small reduction for the evaluation), ``close``."""

from __future__ import annotations

import os

import torch

from ..horovod.compressor import AccordionCompressor

LAUNCHERS = ("horovod", "ddp")


class HorovodFrontEnd:
    """``hvd.DistributedOptimizer`` with the compression as its ``compression=``."""

    name = "horovod"

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


class DDPFrontEnd:
    """``DistributedDataParallel`` with the compression as its comm hook (Gloo for CPU
    training, NCCL for GPUs)."""

    name = "ddp"

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
        if isinstance(compression, AccordionCompressor):
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


def make_front_end(launcher: str, device_type: str, ours: bool = False):
    """``ours``: the job compresses with AccordionCompressor (no gradient through Horovod's
    loop, so Horovod's cycle is made long: comm/horovod.py ``quiet_horovod_cycle``)."""
    return HorovodFrontEnd(quiet_cycle=ours) if launcher == "horovod" else DDPFrontEnd(device_type)
