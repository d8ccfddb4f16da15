"""Worker for the soak run (tests/test_reliability_horovod.py short, benchmarks/reliability.py
long): STEPS steps of a small MLP under the stock hvd.DistributedOptimizer with
AccordionCompressor and a detection window of 4 steps. Rank 1's loss is scaled by 1.6 in
every other pair of windows, so the averaged norms change by about 30% every second window:
levels switch every few windows all run long. Measures RSS and open file descriptors after
a warm-up and at the end, and checks that every rank sent exactly the same floats.
Prints one line per rank: "rank R: SOAK steps=.. switches=.. rss_start_kb=.. rss_end_kb=..
fds_start=.. fds_end=.. floats_sent=.. (equal on all ranks)".
Usage: soak_check.py CODEC STEPS   (CODEC: powersgd|topk)
"""

import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, steps = sys.argv[1], int(sys.argv[2])
WARMUP, INTERVAL = min(500, steps // 4), 4
hvd.init()
rank = hvd.rank()
check = checker(rank)


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 96), torch.nn.ReLU(),
                            torch.nn.Linear(96, 10))
codec = acc.PowerSGD(rank=1, critical_rank=4) if codec_name == "powersgd" else acc.TopK(0.02, critical_ratio=0.2)
compression = acc.AccordionCompressor(codec, interval=INTERVAL, eta=0.2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(rank)
x = torch.randn(256, 64, generator=gen)
y = x[:, :10].argmax(1)
levels, switches = None, 0
for step in range(steps):
    if step == WARMUP:
        rss_start, fds_start = rss_kb(), open_fds()
    batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
    scale = 1.6 if rank == 1 and (step // (2 * INTERVAL)) % 2 else 1.0
    opt.zero_grad()
    (scale * F.cross_entropy(model(x[batch]), y[batch])).backward()
    opt.step()
    now = {n: layer["level"] for n, layer in compression.stats()["layers"].items()}
    switches += levels is not None and now != levels
    levels = now
rss_end, fds_end = rss_kb(), open_fds()
sent = compression.stats()["floats_sent"]
everyone = hvd.allgather(torch.tensor([sent], dtype=torch.int64), name="soak.floats_sent")
check(all(int(v) == sent for v in everyone), f"floats_sent differs between ranks: {everyone.tolist()}")
check(switches >= steps // (8 * INTERVAL), f"only {switches} level switches in {steps} steps")
say(f"rank {rank}: SOAK steps={steps} switches={switches} rss_start_kb={rss_start} rss_end_kb={rss_end} "
    f"fds_start={fds_start} fds_end={fds_end} floats_sent={sent} (equal on all ranks)")
