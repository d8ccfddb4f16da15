"""Worker run by tests/test_collective_safety.py under horovodrun (and, with FRONT "ddp", by
tests/test_ddp_hook.py under torchrun): ranks that disagree must fail with our message,
never hang.

Every rank trains a small model with the stock hvd.DistributedOptimizer (or DDP with our
comm hook) and AccordionCompressor, but the ranks differ on purpose:
  rank   : rank 0 uses PowerSGD(rank=2), rank 1 PowerSGD(rank=4)  -> configuration error
  codec  : rank 0 uses PowerSGD, rank 1 TopK                       -> configuration error
  ratio, eta, policy, interval: one setting differs                 -> configuration error
  layers : rank 0 has an extra compressed layer the others lack     -> every rank names the layer
  dense-layers: rank 0 has an extra uncompressed layer (a bias)    -> every rank names the layer
             (Horovod only: DDP refuses models of different shapes itself, at construction)
  parameters: the same model, rank 1's weights moved, no broadcast  -> every rank warns, naming
             hvd.broadcast_parameters, and trains on (Horovod only: DDP broadcasts at construction)
  codec-as-compression: a codec passed straight as compression=     -> TypeError on every rank
A rank that gets our error prints "rank R: <ExceptionType>: <message>" and exits 1.
Usage: mismatch_check.py MODE [FRONT]    (FRONT: horovod, the default, or ddp)
"""

import sys

import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import say

mode = sys.argv[1]
front = sys.argv[2] if len(sys.argv) > 2 else "horovod"
if front == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()


class Model(torch.nn.Module):
    def __init__(self, extra: str | None):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(48, 4)
        # Only this rank has it: a compressed weight, or an uncompressed bias (averaged by the
        # compressor's dense round, whose layout the ranks agree on too).
        self.extra = (torch.nn.Linear(32, 32, bias=False) if extra == "weight"
                      else torch.nn.Parameter(torch.zeros(32)) if extra == "bias" else None)

    def forward(self, x):
        if isinstance(self.extra, torch.nn.Module):
            x = x + self.extra(x)
        elif self.extra is not None:
            x = x + self.extra
        return self.head(torch.relu(self.a(x)))


if mode == "rank":
    codec = acc.PowerSGD(rank=2 if rank == 0 else 4)
elif mode == "codec":
    codec = acc.PowerSGD(rank=2) if rank == 0 else acc.TopK(ratio=0.1)
elif mode == "ratio":
    codec = acc.TopK(ratio=0.05 if rank == 0 else 0.1, critical_ratio=0.5)
elif mode in ("layers", "dense-layers", "parameters", "codec-as-compression"):
    codec = acc.PowerSGD(rank=2)
elif mode in ("eta", "policy", "interval"):
    codec = acc.PowerSGD(rank=1, critical_rank=2)
else:
    raise SystemExit(f"MODE must be rank, codec, ratio, eta, policy, interval, layers, dense-layers, parameters or "
                     f"codec-as-compression, got {mode!r}")
settings = {"eta": {"eta": 0.5 if rank == 0 else 0.3},
            "policy": {"policy": "accordion" if rank == 0 else "static"},
            "interval": {"interval": 100 if rank == 0 else None}}.get(mode, {})

model = Model(extra={"layers": "weight", "dense-layers": "bias"}.get(mode) if rank == 0 else None)
if mode == "parameters" and rank == 1:
    with torch.no_grad():
        model.a.weight[0, 0] += 1.0
compression = codec if mode == "codec-as-compression" else acc.AccordionCompressor(codec, **settings)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
if front == "ddp":
    net = DistributedDataParallel(model)
    acc.register_ddp_hook(net, compression, optimizer=opt)
    dist.barrier()  # start together: the timeout is for our exchange only
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
try:
    if front == "horovod":  # (a codec as compression= is refused as the optimizer is built, where it is checked)
        net = model
        # No broadcast_parameters: with different models it would be a mismatch of its own.
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
        hvd.allreduce(torch.zeros(1), name="ready")  # start together: the timeout is for our exchange only
    for step in range(3):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
except (ValueError, TypeError, TimeoutError, RuntimeError) as exc:
    if front == "horovod":
        say(f"rank {rank}: {type(exc).__name__}: {exc}")
    else:  # the hook's error reaches backward() through DDP's reducer, perhaps wrapped: our line of it
        lines = str(exc).strip().splitlines() or [""]
        say(f"rank {rank}: " + next((line for line in lines if "AccordionCompressor" in line), lines[0]))
    sys.exit(1)
say(f"rank {rank}: no error")
