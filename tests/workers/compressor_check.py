"""Worker run by tests/test_compressor_horovod.py under horovodrun, on every rank.

Trains a model with the stock hvd.DistributedOptimizer and AccordionCompressor, in a way
built to expose the adapter's weak points:
  * the two branches run in a rank-dependent order, so gradient hooks fire in a different
    order on different ranks;
  * one layer gets no gradient on odd steps on rank 1 only (Horovod zero-fills it);
  * torch 2.x's zero_grad sets grads to None every step.
Then checks: identical parameters on all ranks, identical floats counts on all ranks equal
to the codec's formula, the loss went down.
Usage: compressor_check.py CODEC STEPS [MODE]   (CODEC: powersgd | topk)
MODE: "frame" (default: names from Horovod's calling frame), "class" (the class itself as
compression=), "named" (named_parameters= given to the compressor; the frame lookup is
disabled), "groups" (DistributedOptimizer(groups=2): Horovod's grouped allreduce path),
"named-groups" (both).
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, steps = sys.argv[1], int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "frame"
use_class = mode == "class"
hvd.init()
rank, size = hvd.rank(), hvd.size()

check = checker(rank)


WIDTH = 128 if use_class else 48  # the default codec (Quantize) compresses layers of 1024 entries or more


class TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, WIDTH)
        self.b = torch.nn.Linear(32, WIDTH)
        self.sometimes = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x, step):
        first, second = (self.a, self.b) if rank % 2 == 0 else (self.b, self.a)
        h = torch.relu(first(x)) + torch.relu(second(x))
        # (Not with groups=: Horovod itself pairs a group's grouped allreduce on one rank with
        # single allreduces on a rank where a member has no gradient, and hangs, dense or not.)
        if not (rank == 1 and step % 2 == 1 and not mode.endswith("groups")):
            h = h + torch.relu(self.sometimes(h))
        return self.head(h)


torch.manual_seed(0)
model = TwoBranch()
if use_class:
    compression = acc.AccordionCompressor
    codec = compression.default_instance().codec
else:
    codec = acc.PowerSGD(rank=2) if codec_name == "powersgd" else acc.TopK(ratio=0.1)
    named = model.named_parameters() if mode.startswith("named") else None
    compression = acc.AccordionCompressor(codec, named_parameters=named)
if mode.startswith("named"):
    def no_frames():
        raise AssertionError("named_parameters were given: the frame lookup must not run")
    acc.horovod.compressor.horovod_parameter = no_frames
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression,
                               groups=2 if mode.endswith("groups") else None)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

gen = torch.Generator().manual_seed(rank)
x_all = torch.randn(64, 32, generator=gen)
y_all = (x_all[:, :4].argmax(1))  # a learnable target
losses = []
for step in range(steps):
    opt.zero_grad()
    loss = F.cross_entropy(model(x_all, step), y_all)
    loss.backward()
    opt.step()
    losses.append(loss.item())

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="check.params")
check(all(torch.equal(everyone[0], everyone[r]) for r in range(size)), "parameters differ across ranks")

stats = compression.stats()
instance = compression.default_instance() if use_class else compression
check(instance.engine.lrs.current() == [0.05], f"the learning rates were not found: {instance.engine.lrs.current()}")
counts = hvd.allgather(torch.tensor([[stats["floats_sent"], stats["floats_dense"]]], dtype=torch.float64),
                       name="check.stats")
check(all(torch.equal(counts[0], counts[r]) for r in range(size)), f"floats counts differ across ranks: {counts}")
expected_sent = 0
for name, p in model.named_parameters():
    layer = stats["layers"][name]
    check(layer["floats_dense"] == p.numel() * steps, f"{name}: floats_dense {layer['floats_dense']}")
    if codec.compressible(p.shape):
        # The class's default configuration starts with the link gate's compressed trial (its
        # first window, 100 steps, is longer than this run): every layer at the codec's normal
        # level, 8 bits in sparse chunks, whose count per step the data decides. The others are static.
        level = acc.levels.NORMAL
        check(layer["level"] == str(level), f"{name} level {layer['level']}")
        if use_class:
            check(0 < layer["floats_sent"] <= p.numel() * steps, f"{name}: floats_sent {layer['floats_sent']}")
            expected_sent += layer["floats_sent"]
            continue
        per_step = ((p.shape[0] + p.shape[1]) * codec.level_rank(level, p.shape) if isinstance(codec, acc.PowerSGD)
                    else 2 * codec.level_k(level, p.numel()))
    else:
        check(layer["level"] == "dense", f"{name} should be dense")
        per_step = p.numel()
    check(layer["floats_sent"] == per_step * steps, f"{name}: floats_sent {layer['floats_sent']} != {per_step * steps}")
    expected_sent += per_step * steps
check(stats["floats_sent"] == expected_sent, "total floats_sent")
check(use_class or stats["floats_sent"] < stats["floats_dense"], "compression sent no less than dense")
check(not use_class or any(layer["level"] == "normal" for layer in stats["layers"].values()),
      "the default configuration compressed nothing: this run checks none of its layers")
check(losses[-1] < 0.8 * losses[0], f"loss did not go down: {losses[0]:.3f} -> {losses[-1]:.3f}")
say(f"rank {rank}: OK {codec!r} sent {stats['floats_sent']} of {stats['floats_dense']} floats, "
      f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({mode} {codec_name})")
