"""Worker run by tests/test_diloco.py under torchrun (Gloo, 2 ranks): a rank that dies during
DiLoCo's rounds. Rounds every 3 inner steps with the default compressor; rank 1 exits
(os._exit, as a crash or an OOM kill would) after inner step DIE_AT, before its ``step()``,
while rank 0 goes on into the round's collectives (without overlap: the round due at that
step; with it: the landing of the round rank 1 launched and left in flight), where it waits
for rank 1. It must not hang: the test asserts the job ends within the collective timeout
(ACCORDION_COLLECTIVE_TIMEOUT, set short by the test) with the dead rank named.

Usage: diloco_dead_rank_check.py DIE_AT [overlap]
"""

import os
import sys

import torch
import torch.distributed as dist

import accordion_hvd as acc
from worker_util import say

die_at, overlap = int(sys.argv[1]), sys.argv[2:] == ["overlap"]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
diloco = acc.DiLoCo(model, opt, sync_every=3, overlap=overlap)
for t in range(1, die_at + 7):
    g = torch.Generator().manual_seed(100 * t + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if t == die_at and rank == 1:
        say(f"rank {rank}: dying after inner step {t}, {diloco.syncs} rounds launched")
        os._exit(17)
    if diloco.step():
        say(f"rank {rank}: round {diloco.syncs} done at inner step {t}")
say(f"rank {rank}: FINISHED (the dead rank was never noticed)")
