"""Worker run by tests/test_hsdp.py under torchrun (Gloo, 4 ranks): what ``compress_hsdp``
refuses, each with a clear error naming what is wrong, the same on every rank, never a hang.
Prints one line per case: ``CASE: ExceptionType: message``.

Usage: hsdp_bad_input_check.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import accordion_hvd as acc
from worker_util import leave_torch_distributed, say

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))


def model(shard_mesh=None, **kwargs):
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    if shard_mesh is not None:
        fully_shard(net, mesh=shard_mesh, **kwargs)
    return net


def case(name, action):
    try:
        action()
    except (TypeError, ValueError, RuntimeError) as exc:
        say(f"rank {rank}: {name}: {type(exc).__name__}: {exc}")
    else:
        say(f"rank {rank}: {name}: accepted")


case("not-sharded", lambda: acc.compress_hsdp(model(), acc.AccordionCompressor(), mesh))
case("one-dim-mesh", lambda: acc.compress_hsdp(model(mesh["shard"]), acc.AccordionCompressor(), mesh["shard"]))
case("native-hsdp", lambda: acc.compress_hsdp(model(mesh), acc.AccordionCompressor(), mesh))
case("reduce-dtype", lambda: acc.compress_hsdp(
    model(mesh["shard"], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16)), acc.AccordionCompressor(), mesh))
case("not-a-compressor", lambda: acc.compress_hsdp(model(mesh["shard"]), "powersgd", mesh))
shared = acc.AccordionCompressor()
acc.compress_hsdp(model(mesh["shard"]), shared, mesh)
case("bound-elsewhere", lambda: acc.compress_hsdp(model(mesh["shard"]), shared, mesh))
case("settings-differ", lambda: acc.compress_hsdp(
    model(mesh["shard"]), acc.AccordionCompressor(acc.PowerSGD(rank=2 if rank == 3 else 1)), mesh))
leave_torch_distributed(dist)
