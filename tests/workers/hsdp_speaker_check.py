"""Worker run by tests/test_hsdp.py under torchrun (4 ranks, 2 nodes x 2): a plain script with no
logging configured, as a user writes it; the level lines of compress_hsdp are said once for the
job (by global rank 0), not once per shard group."""

import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import accordion_hvd as acc
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
hook = acc.compress_hsdp(model, acc.AccordionCompressor(acc.PowerSGD(1, 4), interval=2), mesh, optimizer=opt)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(6):
    opt.zero_grad()
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    opt.step()
from worker_util import leave_torch_distributed, say
say(f"rank {dist.get_rank()}: OK speaker")
leave_torch_distributed(dist)
