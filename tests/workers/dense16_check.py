"""Worker run by tests/test_network_aware.py under horovodrun, on every rank.

Trains a small MLP through the stock hvd.DistributedOptimizer with AccordionCompressor; from
step DENSE_FROM on every compressed layer is at levels.DENSE16 (whole, in float16, carried by
Horovod's own allreduce). Checks on every rank, at every DENSE16 step and layer:
- the averaged gradient is Horovod's float16 average of every rank's g = grad + e (a separate
  hvd.allreduce of g in float16 gives the same bits), in the parameter's dtype;
- the error feedback then holds exactly what float16 rounded away, g - float16(g);
and at the end: the levels say "dense16", the loss fell, every rank holds the same parameters.
Usage: dense16_check.py CODEC   (CODEC: powersgd | topk)
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from accordion_hvd.levels import DENSE16
from worker_util import checker, say

codec_name = sys.argv[1]
STEPS, DENSE_FROM = 8, 2
hvd.init()
rank = hvd.rank()
check = checker(rank)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 4))
codec = acc.PowerSGD(rank=1) if codec_name == "powersgd" else acc.TopK(0.05)
compression = acc.AccordionCompressor(codec, policy="static", named_parameters=model.named_parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
params = dict(model.named_parameters())
raw: dict[str, torch.Tensor] = {}
for name, p in params.items():
    p.register_hook(lambda g, name=name: raw.__setitem__(name, g.detach().clone()))  # before Horovod's hook

gen = torch.Generator().manual_seed(rank)
x = torch.randn(64, 32, generator=gen)
y = x[:, :4].argmax(1)
losses = []
for step in range(STEPS):
    if step == DENSE_FROM:
        for name in compression._layers:
            compression.set_level(name, DENSE16)
    e_before = {n: s.residual.detach().clone().reshape(params[n].shape) for n, s in compression._layers.items()}
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.synchronize()
    check(not compression.step_skipped, f"step {step} was skipped")
    if step >= DENSE_FROM:
        for n, e in e_before.items():
            g = raw[n] + e
            expected = hvd.allreduce(g.half(), op=hvd.Average, name=f"expected.{step}.{n}").to(g.dtype)
            got = params[n].grad
            check(got.dtype == params[n].dtype, f"{n}: gradient dtype {got.dtype}")
            check(torch.equal(got, expected), f"step {step}, {n}: not the float16 average "
                                              f"(max diff {(got - expected).abs().max():.3g})")
            e_after = compression._layers[n].residual.reshape(g.shape)
            check(torch.equal(e_after, g - g.half().float()), f"step {step}, {n}: e is not the float16 rounding")
    with opt.skip_synchronize():
        opt.step()
    losses.append(float(hvd.allreduce(loss.detach(), name=f"loss.{step}")))

levels = {n: layer["level"] for n, layer in compression.stats()["layers"].items() if n in compression._layers}
check(levels and all(v == "dense16" for v in levels.values()), f"levels {levels}")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0), name="final.params")
check(all(torch.equal(gathered[0], row) for row in gathered), "ranks ended with different parameters")
check(losses[-1] < losses[0], f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
say(f"rank {rank}: OK dense16 ({codec_name}, {len(levels)} layers); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
