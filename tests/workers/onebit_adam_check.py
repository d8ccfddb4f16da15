"""Worker run by tests/test_onebit_adam.py under torchrun or horovodrun: ``acc.OneBitAdam``
step by step against a plain-torch 1-bit Adam written out here, and its refusals.

Usage: onebit_adam_check.py MODE [LAUNCHER]   (LAUNCHER: torchrun, the default, or horovod)
MODE "reference": the warm-up through a lossless compressor (TopK keeping every entry), so
its steps are AdamW's on the mean gradient; then the frozen stage with Sign on both weight
matrices: every rank's parameters after every step equal a plain-torch 1-bit Adam's (the
gradients averaged with the job's own sums; the 1-bit messages and both error feedbacks from
reference.sign_ef / sign_average; the update clipped at max_update), and equal across ranks.
AdamW unclipped and clipped at 0.3 (where the clip binds), Adam with L2 decay at the default 1.
MODE "default": the defaults (8-bit sparse-chunk warm-up, Sign after it): the ranks agree after
every step, the loss falls, and the bits per parameter per step are what the codecs send.
MODE "resume": a state_dict taken before the freeze and one after, each loaded into a fresh
OneBitAdam (and optimizer and model), continue bit for bit as the run that saved them.
MODE "dcp": the same through torch.distributed.checkpoint (the model and OneBitAdam, a Stateful
holding each rank's part under its own key), saved after the freeze, loaded into fresh ones.
MODE "nonfinite": a NaN in rank 1's gradient at a frozen step: the step is skipped on every
rank (parameters unchanged), and the steps after it go on.
MODE "bad-input": each bad argument refused with an error naming it, on every rank; a
freeze_step, or betas, that differ across ranks refused on every rank at the first step; a
state of a job with another number of ranks refused.
"""

import copy
import math
import sys

import torch

import accordion_hvd as acc
from accordion_hvd import reference
from worker_util import checker, leave_torch_distributed, say, world_of

mode = sys.argv[1]
launcher = sys.argv[2] if len(sys.argv) > 2 else "torchrun"
rank, size, sum_, gather = world_of(launcher)
check = checker(rank)
STEPS, FREEZE, LR, WD = 12, 4, 0.01, 0.1
TEACHER = torch.randn(24, 4, generator=torch.Generator().manual_seed(7))  # labels a model can learn
gen = torch.Generator().manual_seed(100 + rank)
DATA = [(x, (x @ TEACHER).argmax(1)) for x in (torch.randn(16, 24, generator=gen) for _ in range(STEPS))]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def backward(model, i):
    x, y = DATA[i]
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_everywhere(tensor) -> bool:
    return all(torch.equal(g, tensor) for g in gather(tensor))


def lossless():
    return acc.AccordionCompressor(acc.TopK(1.0, min_compression_rate=0.5), policy="static")


def sign(min_numel=256):
    return acc.AccordionCompressor(acc.codecs.Sign(min_numel=min_numel), policy="static")


def mean_(tensor):
    sum_(tensor)
    tensor /= size
    return tensor


def reference_run(make_opt, decoupled, max_update):
    """Plain 1-bit Adam: the parameters after every step."""
    model = make_model()
    opt = make_opt(model)
    after, momentum, denom, worker, server = [], None, None, None, None
    params = list(model.parameters())
    for i in range(STEPS):
        backward(model, i)
        with torch.no_grad():
            if i < FREEZE:
                for p in params:
                    mean_(p.grad)
                opt.step()
            else:
                if momentum is None:
                    group = opt.param_groups[0]
                    b1, b2 = group["betas"]
                    st = [opt.state[p] for p in params]
                    momentum = [s["exp_avg"] / (1 - b1 ** FREEZE) for s in st]
                    v = [s["exp_avg_sq"] / (1 - b2 ** FREEZE) for s in st]
                    denom = [x.sqrt().add(group["eps"]).masked_fill(x == 0, math.inf) for x in v]
                    worker = [torch.zeros(p.numel()) for p in params]
                    server = [torch.zeros(p.numel()) for p in params]
                for k, p in enumerate(params):
                    g = p.grad if decoupled else p.grad + WD * p
                    x = momentum[k] * 0.9 + g * (1 - 0.9)
                    if p.dim() == 2 and p.numel() >= 256:
                        payload, gw = reference.sign_ef(x, worker[k])
                        worker[k] = gw - reference.sign_average(payload.unsqueeze(0), p.numel())
                        rows = torch.stack(gather(payload))
                        avg = reference.sign_average(rows, p.numel())
                        payload, z = reference.sign_ef(avg, server[k])
                        out = reference.sign_average(payload.unsqueeze(0), p.numel())
                        server[k] = z - out
                        momentum[k] = out.view_as(p)
                    else:
                        momentum[k] = mean_(x.clone())
                for k, p in enumerate(params):
                    update = momentum[k] / denom[k]
                    if max_update is not None:
                        update = update.clamp(-max_update, max_update)
                    if decoupled:
                        p.mul_(1 - LR * WD)
                    p.add_(update, alpha=-LR)
        after.append(flat(model).clone())
    return after


def ours(make_opt, warmup=None, compressor=None, poison=None, **kwargs):
    model = make_model()
    opt = acc.OneBitAdam(model, make_opt(model), freeze_step=FREEZE, warmup=warmup, compressor=compressor, **kwargs)
    after, losses, took = [], [], []
    for i in range(STEPS):
        losses.append(backward(model, i))
        if poison is not None and i == poison and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        took.append(opt.step())
        after.append(flat(model).clone())
    return after, losses, took, opt


adamw = lambda model: torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)  # noqa: E731
adam_l2 = lambda model: torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WD)  # noqa: E731

if mode == "reference":
    clipped = 0
    for name, make_opt, decoupled, max_update in (("adamw", adamw, True, None), ("adamw-clip", adamw, True, 0.3),
                                                  ("adam-l2", adam_l2, False, 1.0)):
        expected = reference_run(make_opt, decoupled, max_update)
        got, _, _, opt = ours(make_opt, lossless(), sign(), max_update=max_update)
        if max_update == 0.3:
            clipped = (got[-1] - reference_run(make_opt, decoupled, None)[-1]).abs().max()
        for i, (a, b) in enumerate(zip(got, expected)):
            # (Sign's scales may differ from the reference's in their last bit: the order of a sum)
            check(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
                  f"{name} step {i + 1}: max |ours - reference| {(a - b).abs().max():.3g}")
            check(same_everywhere(a), f"{name} step {i + 1}: the ranks' parameters differ")
        check(opt.frozen and opt.stats()["steps"] == STEPS, f"{name}: {opt.stats()}")
    check(clipped > 1e-4, f"max_update=0.3 clipped nothing (differs from unclipped by {clipped:.3g})")
    say(f"rank {rank}: OK reference")
elif mode == "default":
    got, losses, _, opt = ours(adamw)
    for i, a in enumerate(got):
        check(same_everywhere(a), f"step {i + 1}: the ranks' parameters differ")
    check(sum(losses[-3:]) < sum(losses[:3]), f"the loss did not fall: {losses}")
    stats, numel = opt.stats(), sum(p.numel() for p in make_model().parameters())
    sign_bytes = 4 + -(-24 * 64 // 32) * 4 + 4 * (64 + 64 * 4 + 4)  # 0.weight in 1 bit; the rest 32-bit dense
    frozen = (STEPS - FREEZE) * sign_bytes
    check(stats["bytes_sent"] - frozen <= FREEZE * (numel + 8 * 3 + 4 * (64 + 64 * 4 + 4)),
          f"bytes sent {stats['bytes_sent']}: more than 8-bit warm-up steps and {frozen} in 1 bit")
    say(f"rank {rank}: OK default, {stats['bits_per_parameter_per_step']:.2f} bits per parameter per step")
elif mode == "resume":
    def run(state=None, save_at=()):
        model = make_model()
        opt = acc.OneBitAdam(model, adamw(model), freeze_step=FREEZE, compressor=sign())
        first, saved = 0, {}
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            first = state["i"]
        for i in range(first, STEPS):
            backward(model, i)
            opt.step()
            if i + 1 in save_at:
                saved[i + 1] = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "i": i + 1})
        return flat(model), saved

    whole, saved = run(save_at=(FREEZE - 1, FREEZE + 3))
    for at, state in saved.items():
        resumed, _ = run(state)
        check(torch.equal(whole, resumed), f"resumed from step {at}: differs by {(whole - resumed).abs().max():.3g}")
    say(f"rank {rank}: OK resume")
elif mode == "dcp":
    import os
    import shutil

    import torch.distributed.checkpoint as dcp

    where = f"/tmp/onebit_adam_dcp_{os.environ['MASTER_PORT']}"

    def run(load=False, save_at=None):
        model = make_model()
        opt = acc.OneBitAdam(model, adamw(model), freeze_step=FREEZE, compressor=sign())
        first = 0
        if load:
            state = {"model": model.state_dict(), "optim": opt}
            dcp.load(state, checkpoint_id=where)
            model.load_state_dict(state["model"])
            first = opt.steps
        for i in range(first, STEPS):
            backward(model, i)
            opt.step()
            if i + 1 == save_at:
                dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=where)
        return flat(model), opt

    whole, _ = run(save_at=FREEZE + 3)
    resumed, opt = run(load=True)
    check(torch.equal(whole, resumed), f"resumed through DCP: differs by {(whole - resumed).abs().max():.3g}")
    sum_(torch.zeros(1))  # every rank done reading before rank 0 removes the checkpoint
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    say(f"rank {rank}: OK dcp")
elif mode == "nonfinite":
    poison = FREEZE + 2
    got, _, took, opt = ours(adamw, compressor=sign(), poison=poison)
    check(took == [i != poison for i in range(STEPS)], f"steps taken: {took}")
    check(torch.equal(got[poison], got[poison - 1]), "the skipped step moved the parameters")
    check(all(torch.isfinite(a).all() and same_everywhere(a) for a in got), "not finite, or the ranks differ")
    check(not torch.equal(got[-1], got[poison]), "the steps after the skipped one did not move")
    say(f"rank {rank}: OK nonfinite")
elif mode == "bad-input":
    model = make_model()
    cases = [
        (lambda: acc.OneBitAdam(model, adamw(model), freeze_step=0), ValueError, "freeze_step must be a positive"),
        (lambda: acc.OneBitAdam(model, adamw(model), freeze_step=2.5), ValueError, "freeze_step must be a positive"),
        (lambda: acc.OneBitAdam(model, torch.optim.SGD(model.parameters(), lr=LR), freeze_step=4), TypeError,
         "optimizer must be a torch.optim.AdamW"),
        (lambda: acc.OneBitAdam(model, torch.optim.AdamW(model.parameters(), amsgrad=True), freeze_step=4),
         ValueError, "amsgrad"),
        (lambda: acc.OneBitAdam(model, torch.optim.AdamW(model[0].parameters()), freeze_step=4), ValueError,
         "exactly the model's trainable parameters"),
        (lambda: acc.OneBitAdam(model, adamw(model), freeze_step=4, warmup=acc.TopK(0.1)), TypeError,
         "warmup must be an acc.Compressor (or acc.AccordionCompressor)"),
        (lambda: acc.OneBitAdam(model, adamw(model), freeze_step=4, max_update=0), ValueError,
         "max_update must be a positive number or None"),
    ]
    for make, kind, text in cases:
        try:
            make()
            check(False, f"{text}: accepted")
        except kind as exc:
            check(text in str(exc), f"unclear: {exc}")
    apart = make_model()
    if rank == 1:
        with torch.no_grad():
            apart[0].bias[0] += 1.0
    try:
        acc.OneBitAdam(apart, adamw(apart), freeze_step=4)
        check(False, "parameters that differ across ranks were accepted")
    except ValueError as exc:
        check("OneBitAdam: the model's parameters differ across ranks" in str(exc), f"unclear: {exc}")
    differing = make_model()
    opt = acc.OneBitAdam(differing, adamw(differing), freeze_step=4 if rank == 0 else 5)
    backward(differing, 0)
    try:
        opt.step()
        check(False, "different freeze_step on the ranks was accepted")
    except ValueError as exc:
        check("'onebit_adam_freeze_step': 4 (process 0) vs 5 (process 1)" in str(exc), f"unclear: {exc}")
    apart = make_model()  # betas that differ across ranks: refused on every rank at the first step
    opt = acc.OneBitAdam(apart, torch.optim.AdamW(apart.parameters(), betas=(0.9, 0.999 if rank == 0 else 0.99)),
                         freeze_step=4)
    backward(apart, 0)
    try:
        opt.step()
        check(False, "different betas on the ranks were accepted")
    except ValueError as exc:
        check("'onebit_adam_groups'" in str(exc) and "0.999" in str(exc), f"unclear: {exc}")
    fresh = make_model()
    state = acc.OneBitAdam(fresh, adamw(fresh), freeze_step=4).state_dict()
    try:  # a state from a job of another number of ranks
        acc.OneBitAdam(fresh, adamw(fresh), freeze_step=4).load_state_dict(
            {**state, "accordion.onebit_adam.world": size + 1})
        check(False, "a state of another world was accepted")
    except ValueError as exc:
        check(f"saved by a job of {size + 1} ranks" in str(exc), f"unclear: {exc}")
    say(f"rank {rank}: OK bad-input")
if launcher != "horovod":
    import torch.distributed as dist
    leave_torch_distributed(dist)
