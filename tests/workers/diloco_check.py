"""Worker run by tests/test_diloco.py under torchrun: ``acc.DiLoCo`` round by round against a
plain-torch DiLoCo written out here (inner SGD, pseudo-gradients averaged with
``dist.all_reduce`` on a group of its own, outer SGD with Nesterov momentum), and its refusals.

Usage: diloco_check.py MODE [LAUNCHER]   (LAUNCHER: torchrun, the default, or horovod: under
horovodrun, acc.DiLoCo on the compressor's default planes over Horovod's world, the reference's
sums through hvd.allreduce)
MODE "lossless": TopK keeping every entry (thresholds lowered so every weight goes through the
codec; the biases through the uncompressed round): every rank's parameters after every round
equal the reference's, and equal across ranks.
MODE "quantize": Quantize(8) with error feedback: the parameters agree across ranks after
every round, the error feedback is not zero, and training lowers the loss.
MODE "local-sgd": outer_lr=1, outer_momentum=0 is model averaging: after each round every
rank holds the mean of the ranks' local parameters.
MODE "nonfinite": a NaN in rank 1's parameters before round 2: the round is skipped on every
rank, every rank back at the round's start, and the next round goes on.
MODE "nonfinite-momentum": a NaN in rank 1's gradient inside round 2, under SGD with momentum
(the NaN kept in its momentum buffer): round 2 is skipped on every rank, rank 1's inner state
starts again, and the rounds after it go on (not skipped, finite, moving).
MODE "resume": a state_dict taken after 2 rounds, loaded into a fresh DiLoCo, continues bit
for bit as the run that saved it.
MODE "auto": sync_every=acc.SyncInterval((1, 2, 4), eta, overhead=None: no clock) step by step against a plain-torch
DiLoCo with the same interval rule written out here (gradient norms reduced per window, the
ladder climbed while calm, the first rung after a learning-rate decay, a round at interval 1
a plain average), without and with reset_momentum (the outer momentum zeroed when the decay's
window lowers the interval), and with plain_below=4 (rounds at 1 and 2 plain averages): the same intervals and parameters after every step, on every rank; the
synced() model is the last round's, the same on every rank, and the local one comes back.
MODE "bad-input": each bad argument refused with a ValueError/TypeError naming it, on every rank.
"""

import copy
import math
import logging
import sys

import torch
import torch.distributed as dist

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say, world_of

mode = sys.argv[1]
launcher = sys.argv[2] if len(sys.argv) > 2 else "torchrun"
rank, size, sum_, gather = world_of(launcher)
check = checker(rank)
H, ROUNDS, LR = 3, 4, 0.05
LADDER, CALM = (1, 2, 4), 10.0  # eta 10: no window's norm moves that much, so only the start and the decay are critical
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
    gathered = gather(tensor)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def reference_rounds(outer_lr=0.7, momentum=0.9, nesterov=True):
    """Plain DiLoCo: the parameters after each round."""
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
                    sum_(delta)
                    s.grad = delta / size
                outer.step()
                for s, p in zip(start, model.parameters()):
                    p.copy_(s)
            after.append(flat(model).clone())
    return after


def reference_auto(steps, decay_at, reset=False, plain_below=2):
    """Plain DiLoCo with the interval rule of periodic/interval.py: (interval, parameters) after
    each step; ``reset``: the outer momentum zeroed when a window lowers the interval; rounds of
    fewer than ``plain_below`` inner steps plain averages."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
    interval, since, prev, sum_sq, seen, decreased, out = LADDER[0], 0, None, 0.0, 0, False, []
    for i in range(steps):
        if i == decay_at:
            opt.param_groups[0]["lr"] = LR / 10
            decreased = True
        inner_step(model, opt, i % len(DATA))
        sum_sq += sum(float(p.grad.norm()) ** 2 for p in model.parameters())
        seen += 1
        since += 1
        if since >= interval:
            with torch.no_grad():
                for s, p in zip(start, model.parameters()):
                    delta = s - p
                    sum_(delta)
                    s.grad = delta / size
                if interval < plain_below:
                    for s in start:
                        s -= s.grad
                else:
                    outer.step()
                for s, p in zip(start, model.parameters()):
                    p.copy_(s)
            since = 0
        if (i + 1) % LADDER[-1] == 0:
            window = torch.tensor([sum_sq / seen, float(decreased)], dtype=torch.float64)
            sum_(window)
            norm = math.sqrt(window[0].item() / size)
            critical = window[1].item() > 0 or prev is None or prev == 0 or abs(prev - norm) / prev >= CALM
            before, interval = interval, LADDER[0] if critical else LADDER[min(LADDER.index(interval) + 1, len(LADDER) - 1)]
            if reset and interval < before:
                for s in start:
                    if outer.state[s]:  # (no outer step yet: no momentum)
                        outer.state[s]["momentum_buffer"].zero_()
            prev, sum_sq, seen, decreased = norm, 0.0, 0, False
        out.append((interval, flat(model).clone()))
    return out


def ours(compressor, rounds=ROUNDS, poison=None, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diloco = acc.DiLoCo(model, opt, compressor, sync_every=H, **{"plain_below": 1, **kwargs})  # (the published step)
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
        sum_(total)
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
            sum_(mean)
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
elif mode == "nonfinite-momentum":
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"),
                        sync_every=H, plain_below=1)
    after = []
    for i in range(H * ROUNDS):
        x, y = DATA[i]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i + 1 == 2 * H - 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        if diloco.step():
            after.append(flat(model).clone())
    check(diloco.skipped == 1, f"{diloco.skipped} rounds skipped, expected 1 (round 2 alone)")
    check(torch.equal(after[1], after[0]), "the skipped round moved the parameters")
    for r in range(2, ROUNDS):
        check(torch.isfinite(after[r]).all() and not torch.equal(after[r], after[r - 1]), f"round {r + 1} did not go on")
    for a in after:
        check(same_everywhere(a), "the ranks' parameters differ")
    say(f"rank {rank}: OK nonfinite-momentum")
elif mode == "resume":
    def run(rounds, state=None, sync_every=H):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"),
                            sync_every=sync_every, plain_below=1)
        first = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
            first = state["i"]
        saved = None
        for i in range(first, H * rounds):
            inner_step(model, opt, i % len(DATA))
            diloco.step()
            if i + 1 == 2 * H and state is None:
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                       "diloco": diloco.state_dict(), "i": i + 1})
        return flat(model), saved

    whole, saved = run(4)
    resumed, _ = run(4, saved)
    check(torch.equal(whole, resumed), f"resumed differs by {(whole - resumed).abs().max():.3g}")
    # sync_every="auto": saved mid-window (step 6 of windows of 4), the policy's state and the window's sum with it
    whole, saved = run(8, sync_every=acc.SyncInterval(LADDER, eta=CALM, overhead=None))
    resumed, _ = run(8, saved, sync_every=acc.SyncInterval(LADDER, eta=CALM, overhead=None))
    check(torch.equal(whole, resumed), f"auto: resumed differs by {(whole - resumed).abs().max():.3g}")
    say(f"rank {rank}: OK resume")
elif mode == "auto":
    STEPS, DECAY = 40, 26
    finals = []
    # reset_momentum: the momentum zeroed when the decay's window lowers the interval; plain_below 4:
    # the rounds at intervals 1 and 2 plain averages, the outer momentum for those of 4 only
    for reset, plain_below in ((False, 2), (True, 2), (False, 4)):
        expected = reference_auto(STEPS, DECAY, reset, plain_below)
        intervals = [interval for interval, _ in expected]
        # the rule exercised: 1 at the start, up the ladder while calm, 1 again after the decay
        # (each the interval after that step's decision; windows of 4 steps, the decay in the 7th)
        check(intervals[:7] == [1] * 7 and intervals[7:11] == [2] * 4 and intervals[11:27] == [4] * 16
              and intervals[27:31] == [1] * 4 and intervals[31] == 2, f"the reference's intervals {intervals}")
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        codec = acc.TopK(1.0, min_compression_rate=0.5)
        diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(codec, policy="static"),
                            sync_every=acc.SyncInterval(LADDER, eta=CALM, overhead=None), reset_momentum=reset,
                            plain_below=plain_below)
        checked_synced = False
        timed, time_round = [], diloco.policy.round_took  # (a spy: which steps are timed as rounds)
        diloco.policy.round_took = lambda seconds: (timed.append(diloco.syncs), time_round(seconds))
        for i, (interval, params) in enumerate(expected):
            if i == DECAY:
                opt.param_groups[0]["lr"] = LR / 10
            inner_step(model, opt, i % len(DATA))
            synced = diloco.step()
            check(diloco.interval == interval, f"step {i + 1}: interval {diloco.interval}, the reference's {interval}")
            check(torch.allclose(flat(model), params, rtol=1e-5, atol=1e-6),
                  f"reset {reset}, step {i + 1}: max |ours - reference| {(flat(model) - params).abs().max():.3g}")
            if not synced and not checked_synced:  # between rounds: the ranks' models differ, the synced one does not
                local = flat(model).clone()
                with diloco.synced():
                    check(same_everywhere(flat(model)) and torch.equal(flat(model), torch.cat(
                        [s.reshape(-1) for s in diloco.start])), "synced() is not the last round's model")
                check(torch.equal(flat(model), local), "synced() did not give the local model back")
                checked_synced = True
        check(checked_synced, "no step without a round")
        # the link term's input: every round timed once, after it ran; no step without one
        check(timed == list(range(1, diloco.syncs + 1)), f"rounds timed after rounds {timed}, {diloco.syncs} rounds")
        finals.append(flat(model))
    check(not torch.allclose(finals[0], finals[1]), "reset_momentum changed nothing after the decay")
    check(not torch.allclose(finals[0], finals[2]), "plain_below=4 changed nothing")
    # the defaults (docs/api.md): under "auto" the momentum reset, rounds under 64 inner steps plain
    # averages, the compressor's windows 16 rounds; at a fixed sync_every DiLoCo as published
    model = make_model()
    auto = acc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=LR))
    check((auto.reset_momentum, auto.plain_below, auto.compressor.interval) == (True, 64, 16),
          f"auto's defaults {auto.reset_momentum, auto.plain_below, auto.compressor.interval}")
    model = make_model()
    fixed = acc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=8)
    check((fixed.reset_momentum, fixed.plain_below) == (False, 64), f"fixed {fixed.reset_momentum, fixed.plain_below}")
    say(f"rank {rank}: OK auto, intervals {intervals}, {diloco.syncs} rounds")
elif mode == "bad-input":
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cases = [
        (dict(sync_every=0), ValueError, "sync_every must be a positive integer"),
        (dict(sync_every="often"), ValueError, "sync_every must be a positive integer"),
        (dict(outer_lr=0.0), ValueError, "outer_lr must be a positive number"),
        (dict(outer_momentum=1.0), ValueError, "outer_momentum must be a number in [0, 1)"),
        (dict(overlap="yes"), TypeError, "overlap must be True or False"),
        (dict(nesterov=1), TypeError, "nesterov must be True or False"),
        (dict(sync_every=4, reset_momentum=True), ValueError, "reset_momentum needs an interval policy"),
        (dict(plain_below=0), ValueError, "plain_below must be a positive integer"),
        (dict(plain_below=2.5), ValueError, "plain_below must be a positive integer"),
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
    # settings that differ across ranks: the same error on every rank, at the first round
    model_b = make_model()
    opt_b = torch.optim.SGD(model_b.parameters(), lr=LR)
    differing = acc.DiLoCo(model_b, opt_b, sync_every=1, outer_lr=0.7 if rank == 0 else 0.5)
    inner_step(model_b, opt_b, 0)
    try:
        differing.step()
        check(False, "different outer_lr on the ranks was accepted")
    except ValueError as exc:
        check("acc.DiLoCo: ranks were started with different settings" in str(exc)
              and "'diloco_outer_lr': 0.7 (process 0) vs 0.5 (process 1)" in str(exc), f"unclear: {exc}")
    apart = make_model()
    if rank == 1:
        with torch.no_grad():
            apart[0].bias[0] += 1.0
    try:
        acc.DiLoCo(apart, torch.optim.SGD(apart.parameters(), lr=LR))
        check(False, "parameters that differ across ranks were accepted")
    except ValueError as exc:
        check("differ across ranks at the start" in str(exc), f"unclear: {exc}")
    # diloco.step() before opt.step(): refused at its first call, on every rank, before any
    # collective (every round would start an inner step late and the ranks drift apart)
    model_c = make_model()
    opt_c = torch.optim.SGD(model_c.parameters(), lr=LR)
    early = acc.DiLoCo(model_c, opt_c, sync_every=2)
    x, y = DATA[0]
    torch.nn.functional.cross_entropy(model_c(x), y).backward()
    try:
        early.step()
        check(False, "diloco.step() with no inner step since the last call was accepted")
    except ValueError as exc:
        check("DiLoCo.step(): the inner optimizer has not stepped since the last call" in str(exc),
              f"unclear: {exc}")
    opt_c.step()
    check(early.step() is False, "the step after the refusal did not count as an inner step")
    for p in model_c.parameters():  # an AMP GradScaler skips opt.step() on non-finite gradients
        p.grad.fill_(float("inf"))
    check(early.step() is True, "a round after a step a GradScaler skipped was refused")
    # an outer step that overshoots (here an outer learning rate of 500) is named on every rank
    model_d = make_model()
    opt_d = torch.optim.SGD(model_d.parameters(), lr=LR)
    wild = acc.DiLoCo(model_d, opt_d, sync_every=2, outer_lr=500.0, plain_below=1)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("accordion_hvd.diloco").addHandler(handler)
    for i in range(4):
        inner_step(model_d, opt_d, i)
        wild.step()
    logging.getLogger("accordion_hvd.diloco").removeHandler(handler)
    check(any("outer step grew the parameters' norm" in r.getMessage() for r in records),
          f"no warning of the outer step's growth: {[r.getMessage() for r in records]}")
    # one SyncInterval per DiLoCo: it holds that DiLoCo's window statistics
    shared = acc.SyncInterval()
    first = make_model()
    acc.DiLoCo(first, torch.optim.SGD(first.parameters(), lr=LR), sync_every=shared)
    try:
        second = make_model()
        acc.DiLoCo(second, torch.optim.SGD(second.parameters(), lr=LR), sync_every=shared)
        check(False, "one SyncInterval for two DiLoCos was accepted")
    except ValueError as exc:
        check("sync_every: this acc.SyncInterval already chooses another DiLoCo's interval" in str(exc),
              f"unclear: {exc}")
    # the outer optimizer passed in: the default one built by hand gives the same model, bit for bit
    def rounds_with(**kwargs):
        m = make_model()
        o = torch.optim.SGD(m.parameters(), lr=LR)
        d = acc.DiLoCo(m, o, sync_every=2, plain_below=1, **kwargs)  # (every round the outer step)
        for i in range(6):
            inner_step(m, o, i)
            d.step()
        return flat(m)
    by_hand = rounds_with(outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True))
    check(torch.equal(by_hand, rounds_with()), "outer_optimizer building the default one changed the result")
    check(not torch.equal(rounds_with(outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0)), by_hand),
          "outer_optimizer was not used")
    try:
        acc.DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=LR), outer_lr=0.5,
                   outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
        check(False, "outer_optimizer with outer_lr was accepted")
    except ValueError as exc:
        check("outer_optimizer is given: leave outer_lr" in str(exc), f"unclear: {exc}")
    say(f"rank {rank}: OK bad-input")
if launcher != "horovod":
    leave_torch_distributed(dist)
