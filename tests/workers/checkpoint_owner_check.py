"""Worker run by tests/test_horovod_contracts.py under horovodrun, on every rank: the usual
Horovod checkpoint habit (rank 0 saves, every rank loads) with the compressor's state.

Usage: checkpoint_owner_check.py CODEC DIR
1. Train 4 steps; rank 0 saves ``compression.state_dict()`` to DIR/rank0.pt; every rank
   loads it: rank 0 takes it, every other rank gets a ValueError naming rank 0 and itself,
   and its error feedback is unchanged.
2. ``gather_state_dict()`` on every rank, rank 0 saves the world state to DIR/world.pt, and
   every rank, after zeroing its error feedback, loads that file: each has its own back.
3. Two more steps: parameters identical on every rank (nothing diverged).
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, folder = sys.argv[1], Path(sys.argv[2])
hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
codec = acc.PowerSGD(rank=2) if codec_name == "powersgd" else acc.TopK(ratio=0.1)
compression = acc.AccordionCompressor(codec, named_parameters=model.named_parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                               compression=compression)
gen = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def residuals():
    return {n: s.residual.clone() for n, s in compression.engine.layers.items()}


train(4)
own = residuals()
if rank == 0:
    torch.save(compression.state_dict(), folder / "rank0.pt")
hvd.barrier()
try:
    compression.load_state_dict(torch.load(folder / "rank0.pt", weights_only=True))
    check(rank == 0, "rank 0's checkpoint was loaded on another rank without a word")
except ValueError as exc:
    check(rank != 0 and f"rank 0's, loaded on rank {rank}" in str(exc), f"unexpected refusal: {exc}")
check(all(torch.equal(own[n], r) for n, r in residuals().items()), "the error feedback changed")

world = compression.gather_state_dict()
check((world is not None) == (rank == 0), f"gather_state_dict() gave {type(world).__name__} on rank {rank}")
if rank == 0:
    torch.save(world, folder / "world.pt")
hvd.barrier()
for state in compression.engine.layers.values():
    state.residual.zero_()
compression.load_state_dict(torch.load(folder / "world.pt", weights_only=True))
check(all(torch.equal(own[n], r) for n, r in residuals().items()), "the world file did not give back my error feedback")

train(2)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
check(torch.equal(hvd.broadcast(flat, root_rank=0, name="final"), flat), "parameters differ between ranks")
say(f"rank {rank}: OK checkpoint owner {codec_name}")
