"""Worker run by tests/test_horovod_contracts.py under horovodrun: rank SHORT runs 3 optimizer
steps and exits normally, the other ranks run 4 and must fail in their step 4 with an error
that says rank SHORT has exited (not that it froze or its link is down).

Usage: uneven_steps_check.py SHORT
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import say

short = int(sys.argv[1])
hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
compression = acc.AccordionCompressor(acc.PowerSGD(rank=2), named_parameters=model.named_parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                               compression=compression)
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
steps = 3 if rank == short else 4
try:
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
except Exception as exc:  # noqa: BLE001 - the error a user would read
    say(f"rank {rank}: FAILED AS EXPECTED: {type(exc).__name__}: {exc}")
    sys.exit(1)
say(f"rank {rank}: finished {steps} steps")
