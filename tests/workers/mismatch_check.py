"""Worker run by tests/test_collective_safety.py under horovodrun: ranks that disagree must
fail with our message, never hang.

Every rank trains a small model with the stock hvd.DistributedOptimizer and
AccordionCompressor, but the ranks differ on purpose:
  rank   : rank 0 uses PowerSGD(rank=2), rank 1 PowerSGD(rank=4)  -> configuration error
  codec  : rank 0 uses PowerSGD, rank 1 TopK                       -> configuration error
  ratio, eta, policy, interval: one setting differs                 -> configuration error
  layers : rank 0 has an extra compressed layer the others lack     -> every rank names the layer
A rank that gets our error prints "rank R: <ExceptionType>: <message>" and exits 1.
Usage: mismatch_check.py MODE
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import say

mode = sys.argv[1]
hvd.init()
rank = hvd.rank()


class Model(torch.nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(48, 4)
        # Used first in forward, so its gradient is ready last: Horovod's own (uncompressed)
        # allreduce of its bias, which only this rank submits, comes after the compressed layers
        # in step() and the hang happens in our exchange, where the timeout is.
        self.extra = torch.nn.Linear(32, 32) if extra else None

    def forward(self, x):
        if self.extra is not None:
            x = x + self.extra(x)
        return self.head(torch.relu(self.a(x)))


if mode == "rank":
    codec = acc.PowerSGD(rank=2 if rank == 0 else 4)
elif mode == "codec":
    codec = acc.PowerSGD(rank=2) if rank == 0 else acc.TopK(ratio=0.1)
elif mode == "ratio":
    codec = acc.TopK(ratio=0.05 if rank == 0 else 0.1, critical_ratio=0.5)
elif mode == "layers":
    codec = acc.PowerSGD(rank=2)
elif mode in ("eta", "policy", "interval"):
    codec = acc.PowerSGD(rank=1, critical_rank=2)
else:
    raise SystemExit(f"MODE must be rank, codec, ratio, eta, policy, interval or layers, got {mode!r}")
settings = {"eta": {"eta": 0.5 if rank == 0 else 0.3},
            "policy": {"policy": "accordion" if rank == 0 else "static"},
            "interval": {"interval": 100 if rank == 0 else None}}.get(mode, {})

model = Model(extra=(mode == "layers" and rank == 0))
compression = acc.AccordionCompressor(codec, **settings)
# No broadcast_parameters: with different models it would be a mismatch of its own.
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), compression=compression)
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
hvd.allreduce(torch.zeros(1), name="ready")  # start together: the timeout is for our exchange only
try:
    for step in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
except (ValueError, TimeoutError) as exc:
    say(f"rank {rank}: {type(exc).__name__}: {exc}")
    sys.exit(1)
say(f"rank {rank}: no error")
