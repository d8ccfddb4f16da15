"""Worker run by tests/test_diloco.py under torchrun: ``acc.DiLoCo`` round by round against a
plain-torch DiLoCo written out here (inner SGD, pseudo-gradients averaged with
``dist.all_reduce`` on a group of its own, outer SGD with Nesterov momentum), and its refusals.

Usage: diloco_check.py MODE
MODE "lossless": TopK keeping every entry (thresholds lowered so every weight goes through the
codec; the biases through the uncompressed round): every rank's parameters after every round
equal the reference's, and equal across ranks.
MODE "quantize": Quantize(8) with error feedback: the parameters agree across ranks after
every round, the error feedback is not zero, and training lowers the loss.
MODE "local-sgd": outer_lr=1, outer_momentum=0 is model averaging: after each round every
rank holds the mean of the ranks' local parameters.
MODE "nonfinite": a NaN in rank 1's parameters before round 2: the round is skipped on every
rank, every rank back at the round's start, and the next round goes on.
MODE "resume": a state_dict taken after 2 rounds, loaded into a fresh DiLoCo, continues bit
for bit as the run that saved it.
MODE "bad-input": each bad argument refused with a ValueError/TypeError naming it, on every rank.
"""

import copy
import sys

import torch
import torch.distributed as dist

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say

mode = sys.argv[1]
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)
H, ROUNDS, LR = 3, 4, 0.05
gen = torch.Generator().manual_seed(100 + rank)
DATA = [(torch.randn(16, 24, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(H * ROUNDS)]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def inner_step(model, opt, i):
    x, y = DATA[i]
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_everywhere(tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def reference_rounds(outer_lr=0.7, momentum=0.9, nesterov=True):
    """Plain DiLoCo: the parameters after each round."""
    group = dist.new_group(list(range(size)), backend="gloo")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(start, lr=outer_lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    after = []
    for i in range(H * ROUNDS):
        inner_step(model, opt, i)
        if (i + 1) % H == 0:
            with torch.no_grad():
                for s, p in zip(start, model.parameters()):
                    delta = s - p
                    dist.all_reduce(delta, group=group)
                    s.grad = delta / size
                outer.step()
                for s, p in zip(start, model.parameters()):
                    p.copy_(s)
            after.append(flat(model).clone())
    return after


def ours(compressor, rounds=ROUNDS, poison=None, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diloco = acc.DiLoCo(model, opt, compressor, sync_every=H, **kwargs)
    after, losses = [], []
    for i in range(H * rounds):
        losses.append(inner_step(model, opt, i))
        if poison is not None and i + 1 == poison and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        if diloco.step():
            after.append(flat(model).clone())
    return after, losses, diloco, model, opt


if mode == "lossless":
    expected = reference_rounds()
    codec = acc.TopK(1.0, min_compression_rate=0.5)
    got, _, diloco, _, _ = ours(acc.AccordionCompressor(codec, policy="static"))
    layers = diloco.compressor.stats()["layers"]
    check(layers["0.weight"]["level"] != "dense", f"0.weight was not compressed: {layers['0.weight']}")
    for r, (a, b) in enumerate(zip(got, expected)):
        check(torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"round {r}: max |ours - reference| {(a - b).abs().max():.3g}")
        check(same_everywhere(a), f"round {r}: the ranks' parameters differ")
    say(f"rank {rank}: OK lossless, {len(got)} rounds, {diloco.syncs} syncs")
elif mode == "quantize":
    def data_loss(model):  # over every rank's batches: the same number on every rank
        with torch.no_grad():
            total = torch.stack([torch.nn.functional.cross_entropy(model(x), y) for x, y in DATA]).mean()
        dist.all_reduce(total)
        return total.item() / size

    before = data_loss(make_model())
    got, _, diloco, model, _ = ours(acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"), rounds=4)
    for r, a in enumerate(got):
        check(same_everywhere(a), f"round {r}: the ranks' parameters differ")
    residual = diloco.compressor.state_dict()["layers"]["0.weight"]["residual"]
    check(residual.abs().sum() > 0, "no error feedback kept")
    after = data_loss(model)
    check(after < before, f"training did not lower the loss on the ranks' data: {before:.4f} -> {after:.4f}")
    say(f"rank {rank}: OK quantize, loss {before:.3f} -> {after:.3f}")
elif mode == "local-sgd":
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(acc.TopK(1.0, min_compression_rate=0.5), policy="static"),
                        sync_every=H, outer_lr=1.0, outer_momentum=0.0)
    for i in range(H * 2):
        inner_step(model, opt, i)
        if (i + 1) % H == 0:
            local = flat(model).clone()
            mean = local.clone()
            dist.all_reduce(mean)
            mean /= size
        check(diloco.step() == ((i + 1) % H == 0), "a round at the wrong step")
        if (i + 1) % H == 0:
            check(torch.allclose(flat(model), mean, rtol=1e-6, atol=1e-7), "local SGD is not the average")
    say(f"rank {rank}: OK local-sgd")
elif mode == "nonfinite":
    got, _, diloco, model, _ = ours(acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"),
                                    rounds=3, poison=2 * H - 1)
    check(diloco.skipped == 1 and diloco.compressor.skipped_steps == 1, f"skipped {diloco.skipped}")
    check(torch.equal(got[1], got[0]), "the skipped round moved the parameters")
    check(torch.isfinite(got[2]).all() and not torch.equal(got[2], got[1]), "no round after the skipped one")
    for a in got:
        check(same_everywhere(a), "the ranks' parameters differ")
    say(f"rank {rank}: OK nonfinite")
elif mode == "resume":
    def run(rounds, state=None):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"),
                            sync_every=H)
        first = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
            first = state["i"]
        saved = None
        for i in range(first, H * rounds):
            inner_step(model, opt, i)
            diloco.step()
            if i + 1 == 2 * H and state is None:
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                       "diloco": diloco.state_dict(), "i": i + 1})
        return flat(model), saved

    whole, saved = run(4)
    resumed, _ = run(4, saved)
    check(torch.equal(whole, resumed), f"resumed differs by {(whole - resumed).abs().max():.3g}")
    say(f"rank {rank}: OK resume")
elif mode == "bad-input":
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cases = [
        (dict(sync_every=0), ValueError, "sync_every must be a positive integer"),
        (dict(sync_every="auto"), ValueError, "sync_every must be a positive integer"),
        (dict(outer_lr=0.0), ValueError, "outer_lr must be a positive number"),
        (dict(outer_momentum=1.0), ValueError, "outer_momentum must be a number in [0, 1)"),
    ]
    for kwargs, kind, text in cases:
        try:
            acc.DiLoCo(model, opt, **kwargs)
            check(False, f"{kwargs} accepted")
        except kind as exc:
            check(text in str(exc), f"{kwargs}: unclear: {exc}")
    try:
        acc.DiLoCo(model, torch.optim.SGD(model[0].parameters(), lr=LR))
        check(False, "an optimizer over part of the model was accepted")
    except ValueError as exc:
        check("exactly the model's trainable parameters" in str(exc), f"unclear: {exc}")
    try:
        acc.DiLoCo(torch.nn.parallel.DistributedDataParallel(make_model()), opt)
        check(False, "a DDP model was accepted")
    except TypeError as exc:
        check("DistributedDataParallel" in str(exc), f"unclear: {exc}")
    apart = make_model()
    if rank == 1:
        with torch.no_grad():
            apart[0].bias[0] += 1.0
    try:
        acc.DiLoCo(apart, torch.optim.SGD(apart.parameters(), lr=LR))
        check(False, "parameters that differ across ranks were accepted")
    except ValueError as exc:
        check("differ across ranks at the start" in str(exc), f"unclear: {exc}")
    say(f"rank {rank}: OK bad-input")
leave_torch_distributed(dist)
