"""Worker run by tests/test_reliability_horovod.py under horovodrun, on every rank.

Trains a small MLP with AccordionCompressor inside the stock hvd.DistributedOptimizer (SGD
with momentum and weight decay, so a zero gradient would still move the parameters). At
step FAULT, rank 1's gradient of LAYER gets a VALUE entry (a tensor hook: before Horovod's
own hook sees it). Checks on every rank:
- the step is flagged ``step_skipped`` on every rank, and no other step is;
- stepping the optimizer only when it is not skipped leaves the parameters bit for bit as
  they were before the faulty step;
- every error-feedback buffer stays finite; training goes on and the loss falls;
- at the end every rank holds identical parameters.
Usage: nonfinite_check.py CODEC LAYER VALUE   (CODEC: powersgd|topk; VALUE: nan|inf)
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, layer, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
STEPS, FAULT = 12, 5
hvd.init()
rank = hvd.rank()
check = checker(rank)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 4))
codec = acc.PowerSGD(rank=1, critical_rank=4) if codec_name == "powersgd" else acc.TopK(0.05, critical_ratio=0.2)
compression = acc.AccordionCompressor(codec, interval=4)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
params = dict(model.named_parameters())
step = 0


def poison(grad):
    if rank == 1 and step == FAULT:
        grad = grad.clone()
        grad.view(-1)[3] = value
    return grad


params[layer].register_hook(poison)
gen = torch.Generator().manual_seed(rank)
x = torch.randn(64, 32, generator=gen)
y = x[:, :4].argmax(1)
losses = []
for step in range(STEPS):
    before = {n: p.detach().clone() for n, p in params.items()}
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.synchronize()
    check(compression.step_skipped == (step == FAULT), f"step {step}: step_skipped {compression.step_skipped}")
    if not compression.step_skipped:
        with opt.skip_synchronize():
            opt.step()
    else:
        for n, p in params.items():
            check(torch.equal(p.grad, torch.zeros_like(p.grad)), f"skipped step: {n}'s gradient is not zero")
            check(torch.equal(p.detach(), before[n]), f"skipped step moved {n}")
    for n, state in compression.engine.layers.items():
        check(bool(torch.isfinite(state.residual).all()), f"step {step}: {n}'s error feedback is not finite")
    losses.append(float(hvd.allreduce(loss.detach(), name=f"loss.{step}")))

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0), name="final.params")
check(all(torch.equal(gathered[0], row) for row in gathered), "ranks ended with different parameters")
check(losses[-1] < losses[0], f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
check(compression.skipped_steps == 1, f"skipped_steps {compression.skipped_steps}")
say(f"rank {rank}: OK skipped step {FAULT} ({codec_name}, {layer}, {value}); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
