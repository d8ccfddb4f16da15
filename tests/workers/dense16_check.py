"""Worker run by tests/test_network_aware.py under horovodrun (FRONT horovod) or torchrun
(FRONT ddp), on every rank.

Trains a small MLP with AccordionCompressor, through the stock hvd.DistributedOptimizer or as
a DDP comm hook; from step DENSE_FROM on every compressed layer is at levels.DENSE16 (whole,
in float16, carried by the front end's own allreduce). Checks on every rank, at every DENSE16
step and layer:
- the averaged gradient is the float16 average of every rank's g = grad + e (a separate
  allreduce of g in float16 gives the same bits), in the parameter's dtype;
- the error feedback then holds exactly what float16 rounded away, g - float16(g);
and at the end: the levels say "dense16", the loss fell, every rank holds the same parameters.
Usage: dense16_check.py CODEC [FRONT]   (CODEC: powersgd | topk; FRONT: horovod (default) | ddp)
"""

import sys

import torch
import torch.nn.functional as F

import accordion_hvd as acc
from accordion_hvd.levels import DENSE16
from worker_util import checker, leave_torch_distributed, say

codec_name = sys.argv[1]
front = sys.argv[2] if len(sys.argv) > 2 else "horovod"
STEPS, DENSE_FROM = 8, 2

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 4))
codec = acc.PowerSGD(rank=1) if codec_name == "powersgd" else acc.TopK(0.05)
compression = acc.AccordionCompressor(codec, policy="static", named_parameters=model.named_parameters())
if front == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    forward = model

    def average(t, name):
        return hvd.allreduce(t, op=hvd.Average, name=name)

    def gather(t, name):
        return hvd.allgather(t.unsqueeze(0), name=name)
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    forward = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    acc.register_ddp_hook(forward, compression, optimizer=opt)

    def average(t, name):
        t = t.clone()
        dist.all_reduce(t)
        return t / size

    def gather(t, name):
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t)
        return torch.stack(out)
check = checker(rank)
params = dict(model.named_parameters())
raw: dict[str, torch.Tensor] = {}
for name, p in params.items():
    p.register_hook(lambda g, name=name: raw.__setitem__(name, g.detach().clone()))  # before the front end's hook

gen = torch.Generator().manual_seed(rank)
x = torch.randn(64, 32, generator=gen)
y = x[:, :4].argmax(1)
losses = []
for step in range(STEPS):
    if step == DENSE_FROM:
        for name in compression.engine.layers:
            compression.set_level(name, DENSE16)
    e_before = {n: s.residual.detach().clone().reshape(params[n].shape) for n, s in compression.engine.layers.items()}
    opt.zero_grad()
    loss = F.cross_entropy(forward(x), y)
    loss.backward()
    if front == "horovod":
        opt.synchronize()
    check(not compression.step_skipped, f"step {step} was skipped")
    if step >= DENSE_FROM:
        for n, e in e_before.items():
            g = raw[n] + e
            expected = average(g.half(), f"expected.{step}.{n}").to(g.dtype)
            got = params[n].grad
            check(got.dtype == params[n].dtype, f"{n}: gradient dtype {got.dtype}")
            check(torch.equal(got, expected), f"step {step}, {n}: not the float16 average "
                                              f"(max diff {(got - expected).abs().max():.3g})")
            e_after = compression.engine.layers[n].residual.reshape(g.shape)
            check(torch.equal(e_after, g - g.half().float()), f"step {step}, {n}: e is not the float16 rounding")
    if front == "horovod":
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    losses.append(float(average(loss.detach(), f"loss.{step}")))

levels = {n: layer["level"] for n, layer in compression.stats()["layers"].items() if n in compression.engine.layers}
check(levels and all(v == "dense16" for v in levels.values()), f"levels {levels}")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = gather(flat, "final.params")
check(all(torch.equal(gathered[0], row) for row in gathered), "ranks ended with different parameters")
check(losses[-1] < losses[0], f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
say(f"rank {rank}: OK dense16 ({codec_name}, {front}, {len(levels)} layers); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
if front == "ddp":
    leave_torch_distributed(dist)  # every group, ours included, destroyed; no interpreter teardown
