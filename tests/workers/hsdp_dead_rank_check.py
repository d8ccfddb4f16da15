"""Worker run by tests/test_hsdp.py under torchrun (Gloo, 4 ranks: 2 nodes of 2): a rank that
dies in the middle of a step. The HSDP front end trains with PowerSGD; in step DIE_AT, rank 3
exits (os._exit, as a crash or an OOM kill would) after its forward pass, while the others go
on into backward, FSDP's reduce-scatter and our compressed all-reduce across nodes, where they
wait for it. They must not hang: the test asserts the job ends within the collective timeout
(ACCORDION_COLLECTIVE_TIMEOUT, set short by the test) with the dead rank named.

Usage: hsdp_dead_rank_check.py DIE_AT
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import accordion_hvd as acc
from worker_util import say

die_at = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
fully_shard(model, mesh=mesh["shard"])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
acc.compress_hsdp(model, acc.AccordionCompressor(acc.PowerSGD(rank=2)), mesh, optimizer=opt)
for t in range(die_at + 5):
    g = torch.Generator().manual_seed(100 * t + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if t == die_at and rank == 3:
        say(f"rank {rank}: dying in step {t}, after the forward pass")
        os._exit(17)
    loss.backward()
    opt.step()
    say(f"rank {rank}: step {t} done")
say(f"rank {rank}: FINISHED (the dead rank was never noticed)")
