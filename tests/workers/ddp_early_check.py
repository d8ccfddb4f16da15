"""Worker run by tests/test_ddp_hook.py under torchrun: the DDP hook hands each gradient to
the compressor as soon as autograd accumulates it (not when DDP's bucket is ready), and that
changes nothing but the time: two copies of a model, one with the early hooks and one with
them removed (every gradient then comes from DDP's bucket), stay bit for bit equal through
steps that include gradients accumulated under ``no_sync`` and a forward without grad between
the training forward and its backward (which leaves the step to DDP's buckets), and with
``find_unused_parameters`` a layer used only in every other step; and the same with
``gradient_as_bucket_view=True`` (the gradients DDP's bucket itself)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)


def build(as_view=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 4))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    compression = acc.AccordionCompressor(acc.PowerSGD(2), policy="static")
    hook = acc.register_ddp_hook(ddp, compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handed = []  # (name, whether the compressor got the accumulated param.grad itself)
    grads = {name: p for name, p in model.named_parameters()}
    engine = compression.engine  # what the hook drives
    original = engine.add

    def spy(name, tensor, **kwargs):
        handed.append((name, grads[name].grad is not None and tensor.data_ptr() == grads[name].grad.data_ptr()))
        return original(name, tensor, **kwargs)

    engine.add = spy
    writes = engine.write_result_into

    def spy_writes(name, target):
        done = writes(name, target)
        handed.append((f"wrote {name}", done))
        return done

    engine.write_result_into = spy_writes
    return model, ddp, hook, opt, handed


early, late, as_view = build(), build(), build(as_view=True)  # as_view: .grad is DDP's bucket itself
late[2].remove()
names = [n for n, _ in early[0].named_parameters()]
for step in range(5):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    for model, ddp, hook, opt, handed in (early, late, as_view):
        del handed[:]
        if step == 1:  # gradients accumulated locally first: nothing reaches the compressor
            with ddp.no_sync():
                ddp(x * 0.5).square().sum().backward()
            check(not handed, f"step {step}: layers reached the compressor under no_sync: {handed}")
        loss = ddp(x).square().sum()
        if step == 3:  # a forward without grad in between: DDP still synchronizes this backward
            with torch.no_grad():
                ddp(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = sorted(n for n, _ in early[4] if not n.startswith("wrote "))
    check(got == sorted(names), f"step {step}: the compressor got {got}, expected every layer once")
    wanted = step != 3  # early unless a forward without grad disarmed the hooks
    check(all(from_param == wanted for n, from_param in early[4] if not n.startswith("wrote ")),
          f"step {step}: handed over from param.grad: {early[4]}, expected {wanted} for every layer")
    # an early PowerSGD layer's result is written straight into DDP's bucket (no copy)
    written = sorted(n.removeprefix("wrote ") for n, done in early[4] if n.startswith("wrote ") and done)
    codec = acc.PowerSGD(2)
    matrices = sorted(n for n, p in early[0].named_parameters() if codec.compressible(p.shape)) if wanted else []
    check(written == matrices, f"step {step}: results written into DDP's bucket: {written}, expected {matrices}")
    check(not any(from_param for _, from_param in late[4]), f"step {step}: the copy without early hooks: {late[4]}")
    for (name, a), b, c in zip(early[0].named_parameters(), late[0].parameters(), as_view[0].parameters()):
        check(torch.equal(a, b), f"step {step}: {name} differs between early and late hand-over "
                                 f"(max {(a - b).abs().max().item():.3g})")
        check(torch.equal(a, c), f"step {step}: {name} differs with gradient_as_bucket_view "
                                 f"(max {(a - c).abs().max().item():.3g})")


class Branchy(torch.nn.Module):
    """A layer ("side") used only in every other step: DDP (find_unused_parameters) marks it
    ready without a gradient, so it reaches the compressor from DDP's bucket, never early."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.side = torch.nn.Linear(32, 64), torch.nn.Linear(64, 4), torch.nn.Linear(64, 4)

    def forward(self, x, use_side):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.side(h) if use_side else 0)


def build_branchy():
    torch.manual_seed(0)
    model = Branchy()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    hook = acc.register_ddp_hook(ddp, acc.AccordionCompressor(acc.PowerSGD(2), policy="static"))
    return model, ddp, hook, torch.optim.SGD(model.parameters(), lr=0.01)


branchy_early, branchy_late = build_branchy(), build_branchy()
branchy_late[2].remove()
for step in range(4):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    for model, ddp, hook, opt in (branchy_early, branchy_late):
        ddp(x, use_side=step % 2 == 0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(branchy_early[0].named_parameters(), branchy_late[0].parameters()):
        check(torch.equal(a, b) and torch.isfinite(a).all(), f"find_unused_parameters, step {step}: {name} differs "
                                                              f"between early and late hand-over, or is not finite")
everyone = [None] * size
dist.all_gather_object(everyone, [p.sum().item() for p in early[0].parameters()])
check(all(e == everyone[0] for e in everyone), f"ranks hold different parameters: {everyone}")
say(f"rank {rank}: OK early hand-over ({len(names)} layers, 5 steps; a layer unused in every other step)")
leave_torch_distributed(dist)
