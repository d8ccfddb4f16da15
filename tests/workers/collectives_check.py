"""Worker run by tests/test_exchange_horovod.py under horovodrun, on every rank.

Counts the collectives one training step issues on the compressor's data plane and checks
the number the exchange engine promises (accordion_hvd/exchange/): once the layout is
agreed (after the first step), PowerSGD issues a P and a Q allreduce per bucket (the Q rounds
on the channel's second lane); TopK one allgather per bucket; plus one allreduce per bucket
of the uncompressed layers (the biases, on the "dense" lane) and, with Accordion, the one
learning-rate gather. No gradient reaches Horovod: its optimizer submits nothing in a step.
Small buckets (``bucket_cap_mb``) force several of them on a small model, and the hooks fire
in a rank-dependent order, so the buckets fill in a different order on each rank.
Usage: collectives_check.py CODEC POLICY   (CODEC: powersgd | topk; POLICY: static | accordion)
"""

import sys

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer
import torch

import accordion_hvd as acc
from accordion_hvd.exchange import plan_buckets
from worker_util import checker, say

codec_name, policy = sys.argv[1], sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)

torch.manual_seed(0)
layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(6)])


def forward(x):
    # Rank-dependent order of the branches: their gradients become ready in another order.
    order = range(6) if rank % 2 == 0 else reversed(range(6))
    return sum(torch.relu(layers[i](x)) for i in order)


# Count what Horovod's optimizer submits to Horovod (installed before the compressor wraps
# these for its placeholders, so only what goes past the wrapper is counted).
submitted = [0]


def counting(submit):
    def wrapper(tensors, *args, **kwargs):
        submitted[0] += 1
        return submit(tensors, *args, **kwargs)
    return wrapper


hvd_optimizer.allreduce_async_ = counting(hvd_optimizer.allreduce_async_)
hvd_optimizer.grouped_allreduce_async_ = counting(hvd_optimizer.grouped_allreduce_async_)

codec = (acc.PowerSGD(rank=1, critical_rank=2) if codec_name == "powersgd"
         else acc.TopK(ratio=0.05, critical_ratio=0.1))
compression = acc.AccordionCompressor(codec, policy=policy, interval=3, bucket_cap_mb=0.03)  # 2 weights a bucket
opt = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.01),
                               named_parameters=layers.named_parameters(prefix="layers"), compression=compression)
hvd.broadcast_parameters(layers.state_dict(), root_rank=0)
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
counts = []
for step in range(8):
    before = compression.channel.issued if step else 0
    opt.zero_grad()
    forward(x).square().mean().backward()
    opt.step()
    counts.append(compression.channel.issued - before)
buckets = compression.round1.buckets
check(buckets is not None and len(buckets) == 4,  # the last bucket's last layer goes on its own (plan_buckets)
      f"expected 2 buckets of 2 weights and 2 of one, got {buckets}")
nbytes = {n: 64 * 64 * 4 for b in buckets for n in b.names}
check([b.names for b in buckets] == plan_buckets([n for b in buckets for n in b.names], nbytes, 2**20 * 0.03,
                                                 2**20 * 0.03), "the buckets are not the planned cut")
dense_buckets = compression.dense_round.buckets
check(dense_buckets is not None and [sorted(b.names) for b in dense_buckets]
      == [sorted(f"layers.{i}.bias" for i in range(6))], f"expected one bucket of the 6 biases, got {dense_buckets}")
expected = len(buckets) * (2 if codec_name == "powersgd" else 1) + 1 + (1 if policy == "accordion" else 0)
check(all(c == expected for c in counts[1:]), f"collectives per step {counts[1:]}, expected {expected} each")
check(submitted[0] == 0, f"Horovod's optimizer submitted {submitted[0]} collectives to Horovod in 8 steps")
say(f"rank {rank}: OK {codec_name} {policy}: {expected} collectives per step {counts}")
