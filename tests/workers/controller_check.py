"""Worker run by tests/test_controller_horovod.py under horovodrun, on every rank.

Trains with AccordionCompressor (PowerSGD rank 1 <-> 4, a detection every 3 steps) inside
the stock hvd.DistributedOptimizer, with a local gradient norm that depends on the rank:
rank 1's loss is scaled by 1.6 on every other window, so rank 1 alone would see +60%/-37%
changes (critical at eta 0.5) where rank 0 alone sees none; the mean over ranks changes by
about 30% (normal). A rank deciding from its local norms would disagree; ours may not. And a
learning-rate drop
made through the optimizer's param_groups only (the controller must see it by itself).
After every step all ranks compare the levels they will use next: they must be identical,
and the run must have used both levels. Prints which control plane the controller used.
Usage: controller_check.py STEPS
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

steps = int(sys.argv[1])
hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 4))
compression = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=3)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

gen = torch.Generator().manual_seed(rank)
x = torch.randn(64, 32, generator=gen)
y = x[:, :4].argmax(1)
codes = {"normal": 0.0, "critical": 1.0, "dense": 2.0}
seen = set()
lr_drop = steps // 2
for step in range(steps):
    if step == lr_drop:
        for group in opt.param_groups:
            group["lr"] *= 0.1
    opt.zero_grad()
    scale = 1.6 if rank == 1 and (step // 3) % 2 else 1.0
    (scale * F.cross_entropy(model(x), y)).backward()
    opt.step()
    layers = compression.stats()["layers"]
    mine = torch.tensor([[codes[layers[n]["level"]] for n in sorted(layers)]], dtype=torch.float64)
    everyone = hvd.allgather(mine, name=f"check.levels.{step}")
    check(all(torch.equal(everyone[0], everyone[r]) for r in range(size)),
          f"step {step}: ranks use different levels next: {everyone.tolist()}")
    seen.update(layers[n]["level"] for n in layers)
    if step == lr_drop:  # the drop is seen at the end of the step it happened in
        check(all(layers[n]["level"] in ("critical", "dense") for n in layers),
              f"the lr drop did not make every layer critical: {layers}")

check({"normal", "critical"} <= seen, f"the levels never switched: {seen}")
say(f"rank {rank}: OK control plane {compression.control.kind}, windows {compression.controller.windows}, "
    f"levels seen {sorted(seen)}")
