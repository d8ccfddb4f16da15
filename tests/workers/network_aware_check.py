"""Worker run by tests/test_network_aware.py under horovodrun, on every rank.

Trains an MLP with layers of very different sizes through the stock hvd.DistributedOptimizer
and AccordionCompressor(codec, policy=NetworkAware()), detection every 4 steps, then checks:
where the real Gloo data plane's own collectives determined a link the policy predicted
steps with it or the clock had settled the window's levels (else it kept the gentle level,
saying why), every rank holds the same levels after every step
and the same decision figures, the error never exceeded the budget, and the parameters are
identical on every rank, as are the steps the policy measured to check its choices.
Usage: network_aware_check.py CODEC STEPS   (CODEC: powersgd | topk)
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, steps = sys.argv[1], int(sys.argv[2])
hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
codec = acc.PowerSGD(rank=1, critical_rank=4) if codec_name == "powersgd" else acc.TopK(0.01, 0.1)
policy = acc.policies.NetworkAware(warmup=0)  # a 24-step run: searching from the first window
compression = acc.AccordionCompressor(codec, policy=policy, interval=4, named_parameters=model.named_parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

gen = torch.Generator().manual_seed(rank)
x = torch.randn(128, 64, generator=gen)
y = x[:, :8].argmax(1)
levels, decisions = [], []
for step in range(steps):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    levels.append({name: str(level) for name, level in sorted(compression.controller.levels.items())})
    if (step + 1) % 4 == 0:
        decisions.append(dict(policy.last))

measured = policy.state_dict()["measured"]  # steps timed by the probe, averaged over ranks
everyone = hvd.allgather_object((levels, decisions, compression.stats()["link"], measured), name="check.levels")
check(all(e[0] == levels for e in everyone), "ranks hold different levels")
check(all(e[1] == decisions for e in everyone), f"ranks decided differently: {[e[1] for e in everyone]}")
check(all(e[2] == everyone[0][2] for e in everyone), "ranks measured different links")
check(all(e[3] == measured for e in everyone), "ranks hold different measured steps")
check(len(measured) > 0 and all(seconds > 0 for _, seconds in measured.values()), f"no step measured: {measured}")
predicted = [d for d in decisions if "predicted_s" in d]
kept = [d for d in decisions if "kept" in d]
# a window whose levels the clock decided (Accordion's: not timed yet, or timed faster) searches nothing
settled = [d for d in decisions if "predicted_s" not in d and "Accordion's levels" in d.get("verified", "")]
check(len(predicted) + len(kept) + len(settled) == len(decisions),
      f"a window neither predicted, fell back nor was settled by the clock: {decisions}")
# On loopback, small messages are latency-bound and a window may determine no bandwidth; the
# policy then puts every layer at the gentle level and says so. Once some window measured a link, the
# windows after it use it (the last link is kept).
check(all("no link" in d["kept"] for d in kept), f"fell back for another reason: {kept}")
if compression.stats()["link"] is not None:
    first = next((i for i, d in enumerate(decisions) if "kept" not in d), len(decisions))
    check(not any("kept" in d for d in decisions[first:]), f"a window after the first link fell back: {decisions}")
check(all(d["error"] <= d["budget"] * (1 + 1e-9) for d in predicted), f"over the error budget: {predicted}")
check(all(d["predicted_s"] <= d["accordion_s"] * (1 + 1e-9) for d in predicted), f"slower than Accordion: {predicted}")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
params = hvd.allgather(flat.unsqueeze(0), name="check.params")
check(all(torch.equal(params[0], params[r]) for r in range(size)), "parameters differ across ranks")
seen = sorted({level for step in levels for level in step.values()})
say(f"rank {rank}: OK network-aware {codec_name}: {len(predicted)} of {len(decisions)} windows predicted, "
    f"link {compression.stats()['link']}, levels seen {seen}, last {decisions[-1]}")
