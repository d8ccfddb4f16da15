"""Worker run by tests/test_diloco.py: ``acc.DiLoCo(..., overlap=True)`` step by step against a
plain-torch overlapped DiLoCo written out here (each round's average applied one round late,
each rank's model set to the outer step's result plus its progress since the launch).

Usage: diloco_overlap_check.py MODE [LAUNCHER]   (LAUNCHER: torchrun, the default, or horovod)
MODE "lossless": TopK keeping every entry, a fixed interval: every rank's parameters after
every inner step equal the reference's; flush() lands the last round, after which the ranks
hold the same model.
MODE "auto": acc.SyncInterval((1, 2, 4)): the rounds at interval 1 (the start, after a decay)
synchronous and plain averages, the others overlapped: the reference's parameters after
every step, the ranks equal after each round at interval 1.
MODE "auto-reset": the same with reset_momentum=True: where the decay's window lowers the
interval, the round in flight lands first, then the outer momentum is zeroed (else that round,
landing later, would refill it with a pseudo-gradient of the old learning rate).
MODE "nonfinite": a NaN on rank 1 in the round in flight: it is skipped when it lands, every
rank back at the start-of-round parameters (the progress since dropped), the next one goes on.
MODE "resume": a state_dict taken with a round in flight (it lands first), loaded into a fresh
DiLoCo, continues bit for bit as the run that saved it.
"""

import copy
import sys

import torch
import torch.distributed as dist

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say, world_of

mode = sys.argv[1]
launcher = sys.argv[2] if len(sys.argv) > 2 else "torchrun"
rank, size, sum_, gather = world_of(launcher)
check = checker(rank)
H, LR = 3, 0.05
LADDER, CALM = (1, 2, 4), 10.0  # eta 10: only the start and the decay are critical
gen = torch.Generator().manual_seed(100 + rank)
DATA = [(torch.randn(16, 24, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(12)]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def inner_step(model, opt, i):
    x, y = DATA[i % len(DATA)]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_everywhere(tensor) -> bool:
    gathered = gather(tensor)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def lossless():
    return acc.AccordionCompressor(acc.TopK(1.0, min_compression_rate=0.5), policy="static")


def reference(steps, interval_at, decay_at=None, auto=False, reset=False):
    """Overlapped DiLoCo: the parameters after each inner step and whether a round started.
    ``interval_at(i)``: the interval in force at inner step i; ``reset``: where it falls, the
    round in flight lands and the outer momentum is zeroed."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)

    def land(average, plain, launched):
        for s, a in zip(start, average):
            s.grad = a
        if plain:
            for s in start:
                s -= s.grad
        else:
            outer.step()
        for s, p, then in zip(start, params, launched or start):
            p.copy_(s if launched is None else s + (p - then))

    pending, since, out = None, 0, []
    for i in range(steps):
        if i == decay_at:
            opt.param_groups[0]["lr"] = LR / 10
        inner_step(model, opt, i)
        since += 1
        interval = interval_at(i)
        with torch.no_grad():
            if since >= interval:
                if pending is not None:
                    land(*pending)
                average = [s - p for s, p in zip(start, params)]
                for a in average:
                    sum_(a)
                    a /= size
                plain = auto and interval == 1
                if interval > 1:
                    pending = (average, plain, [p.detach().clone() for p in params])
                else:
                    pending = land(average, plain, None)
                since = 0
            if reset and i + 1 < steps and interval_at(i + 1) < interval:
                if pending is not None:
                    pending = land(*pending)
                outer.state.clear()  # (SGD starts a cleared buffer as the next gradient: as zeroed)
        out.append(flat(model).clone())
    return out


def ours(steps, sync_every, decay_at=None, poison=None, compressor=None, reset=False):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diloco = acc.DiLoCo(model, opt, compressor or lossless(), sync_every=sync_every, overlap=True,
                        reset_momentum=reset, plain_below=2)  # (the reference's: plain at interval 1 only)
    out, intervals = [], []
    for i in range(steps):
        if i == decay_at:
            opt.param_groups[0]["lr"] = LR / 10
        inner_step(model, opt, i)
        if poison is not None and i + 1 == poison and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        intervals.append(diloco.interval)  # in force at this step
        diloco.step()
        out.append(flat(model).clone())
    return out, intervals, diloco, model


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


if mode == "lossless":
    STEPS = 4 * H
    expected = reference(STEPS, lambda i: H)
    got, _, diloco, model = ours(STEPS, H)
    for i, (a, b) in enumerate(zip(got, expected)):
        check(close(a, b), f"step {i + 1}: max |ours - reference| {(a - b).abs().max():.3g}")
    check(diloco.syncs == 4 and diloco.launched is not None, f"{diloco.syncs} rounds, the last in flight")
    check(not same_everywhere(flat(model)), "the ranks agree with a round in flight")
    diloco.flush()
    check(diloco.launched is None and same_everywhere(flat(model)), "flush() did not land the round")
    say(f"rank {rank}: OK lossless, {diloco.syncs} rounds")
elif mode in ("auto", "auto-reset"):
    STEPS, DECAY, RESET = 40, 26, mode == "auto-reset"
    got, intervals, diloco, _ = ours(STEPS, acc.SyncInterval(LADDER, eta=CALM, overhead=None), decay_at=DECAY,
                                     reset=RESET)
    # in force at each step: 1 at the start, up the ladder while calm, 1 again after the decay
    check(intervals[:8] == [1] * 8 and intervals[8:12] == [2] * 4 and intervals[12:28] == [4] * 16
          and intervals[28:32] == [1] * 4 and intervals[32] == 2, f"intervals {intervals}")
    expected = reference(STEPS, lambda i: intervals[i], decay_at=DECAY, auto=True, reset=RESET)
    for i, (a, b) in enumerate(zip(got, expected)):
        check(close(a, b), f"step {i + 1}: max |ours - reference| {(a - b).abs().max():.3g}")
        if intervals[i] == 1:  # a synchronous round at this step: one model everywhere
            check(same_everywhere(a), f"step {i + 1}: the ranks differ after a round at interval 1")
    say(f"rank {rank}: OK {mode}, {diloco.syncs} rounds")
elif mode == "nonfinite":
    compressor = acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static")
    got, _, diloco, model = ours(4 * H, H, poison=2 * H - 1, compressor=compressor)
    # round 2 (launched at step 2H, rank 1's model poisoned) lands at step 3H: skipped there
    check(diloco.skipped == 1 and diloco.compressor.skipped_steps == 1, f"skipped {diloco.skipped}")
    check(torch.isfinite(got[3 * H - 1]).all() and same_everywhere(got[3 * H - 1]),
          "after the skipped round the ranks are not at the same finite start")
    check(torch.isfinite(got[-1]).all() and diloco.syncs == 4, "no round after the skipped one")
    say(f"rank {rank}: OK nonfinite")
elif mode == "resume":
    def run(steps, state=None):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        diloco = acc.DiLoCo(model, opt, acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static"),
                            sync_every=H, overlap=True, plain_below=1)
        first, saved = 0, None
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
            first = state["i"]
        for i in range(first, steps):
            inner_step(model, opt, i)
            diloco.step()
            if i + 1 == 2 * H + 1 and state is None:  # round 2 in flight
                check(diloco.launched is not None, "no round in flight")
                outer = diloco.state_dict()  # lands it first
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": outer,
                                       "i": i + 1})
        diloco.flush()
        return flat(model), saved

    whole, saved = run(5 * H)
    resumed, _ = run(5 * H, saved)
    check(torch.equal(whole, resumed), f"resumed differs by {(whole - resumed).abs().max():.3g}")
    say(f"rank {rank}: OK resume")
if launcher != "horovod":
    leave_torch_distributed(dist)
