"""Worker run by tests/test_link_gate.py under horovodrun (FRONT horovod) or torchrun (FRONT
ddp), on every rank.

Trains an MLP with ``acc.AccordionCompressor()`` as a user gets it (the default codec and the
link-gate policy), detection every INTERVAL steps, through the stock hvd.DistributedOptimizer
or as a DDP comm hook. Checks: the first window sends every compressed layer at the codec's
aggressive level, the next ``trial_steps`` steps whole in float16, and from then on the gate has decided
(every layer dense16, or the inner Accordion's levels); every rank took the same decision from
the same timings and holds the same parameters; the loss fell.
Usage: default_check.py [FRONT]   (FRONT: horovod (default) | ddp)
"""

import sys

import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say

front = sys.argv[1] if len(sys.argv) > 1 else "horovod"
INTERVAL, STEPS = 4, 14

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 8))
compression = acc.AccordionCompressor(interval=INTERVAL, named_parameters=model.named_parameters())
if front == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gather = hvd.allgather_object
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(model)
    acc.register_ddp_hook(model, compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
check = checker(rank)

gen = torch.Generator().manual_seed(rank)
x = torch.randn(256, 64, generator=gen)
y = x[:, :8].argmax(1)
levels, losses = [], []
for step in range(STEPS):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    levels.append(sorted({str(level) for level in compression.controller.levels.values()}))

gate = compression.policy.state_dict()
check(isinstance(compression.policy, acc.policies.LinkGate), f"the default policy is {compression.policy!r}")
TRIAL = min(INTERVAL, compression.policy.trial_steps)  # the dense trial's steps (levels[i]: for step i + 2)
check(all(lv == ["normal"] for lv in levels[:INTERVAL - 1]), f"first window not normal: {levels[:INTERVAL]}")
check(all(lv == ["dense16"] for lv in levels[INTERVAL - 1:INTERVAL - 1 + TRIAL]), f"no dense trial: {levels}")
check(gate["phase"] in ("dense", "compressed") and gate["dense_s"] > 0 and gate["compressed_s"] > 0,
      f"no decision after the trials: {gate}")
after = levels[INTERVAL + TRIAL:]
check(all(lv == ["dense16"] for lv in after) if gate["phase"] == "dense" else "dense16" not in sum(after, []),
      f"levels after the decision ({gate['phase']}): {after}")
params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = gather((gate, levels, params))
check(all(e[0] == gate and e[1] == levels for e in everyone), f"ranks decided differently: {[e[0] for e in everyone]}")
check(all(torch.equal(e[2], params) for e in everyone), "ranks hold different parameters")
check(losses[-1] < losses[0], f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
say(f"rank {rank}: OK default ({front}): {gate['phase']}, dense {gate['dense_s']:.4f} s, "
    f"compressed {gate['compressed_s']:.4f} s per step")
if front == "ddp":
    leave_torch_distributed(dist)
