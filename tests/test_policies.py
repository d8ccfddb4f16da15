"""The level policies and the regime controller, on the simulated N-rank world.

The Accordion rule by hand; then the whole loop (compressor -> controller -> policy ->
levels) with rank-dependent gradients, where every rank must switch in the same step;
learning-rate decreases; non-finite norms; checkpoints that resume bit for bit.
"""

import math

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.levels import CRITICAL, NORMAL
from accordion_hvd.policies import Accordion, Static, WindowReport

C, N = "critical", "normal"  # as stats() and the logs write them


def window(norms, steps=10):
    return WindowReport(dict(norms), steps)


def test_accordion_rule_by_hand():
    policy = Accordion(eta=0.5)
    assert policy.initial_level("w") == CRITICAL
    assert policy.end_window(window({"w": 4.0, "v": 1.0})) == {"w": CRITICAL, "v": CRITICAL}  # nothing to compare yet
    assert policy.end_window(window({"w": 3.0, "v": 1.2})) == {"w": NORMAL, "v": NORMAL}  # -25%, +20%
    assert policy.end_window(window({"w": 1.5, "v": 1.8})) == {"w": CRITICAL, "v": CRITICAL}  # -50% (= eta), +50%
    assert policy.end_window(window({"w": 1.4, "v": 0.0})) == {"w": NORMAL, "v": CRITICAL}
    assert policy.end_window(window({"w": 1.4, "v": 5.0})) == {"w": NORMAL, "v": CRITICAL}  # prev == 0 counts as critical
    assert policy.lr_decreased(["w", "v"]) == {"w": CRITICAL, "v": CRITICAL}


def test_a_non_finite_window_is_skipped_and_does_not_poison_the_next_one():
    policy = Accordion(eta=0.5)
    policy.end_window(window({"w": 4.0, "v": 1.0}))
    assert policy.end_window(window({"w": 3.9, "v": 1.1})) == {"w": NORMAL, "v": NORMAL}
    assert policy.end_window(window({"w": math.nan, "v": 100.0})) == {"w": NORMAL, "v": NORMAL}  # skipped: unchanged
    # The comparison is with the last good window (3.9, 1.1), not with the skipped one.
    assert policy.end_window(window({"w": 3.8, "v": 1.0})) == {"w": NORMAL, "v": NORMAL}
    assert policy.end_window(window({"w": math.inf, "v": 1.0})) == {"w": NORMAL, "v": NORMAL}


def test_static_never_leaves_the_normal_level():
    policy = Static()
    assert policy.initial_level("w") == NORMAL
    assert policy.end_window(window({"w": 1.0})) == {"w": NORMAL}
    assert policy.lr_decreased(["w"]) is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(policy="gravity"), "policy must be one of"),
    (dict(policy=3), "policy must be None, a name or a Policy"),
    (dict(eta=0), "eta must be positive"),
    (dict(eta=-1.0), "eta must be positive"),
    (dict(interval=0), "interval must be positive"),
    (dict(interval=2.5), "interval must be an int"),
    (dict(accumulate="yes"), "accumulate must be a bool"),
])
def test_bad_policy_arguments_name_the_problem(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        acc.AccordionCompressor(acc.PowerSGD(1, 4), **kwargs)


def test_accordion_is_the_default_only_when_the_codec_has_two_levels():
    assert isinstance(acc.AccordionCompressor(acc.PowerSGD(1, 4)).policy, Accordion)
    assert isinstance(acc.AccordionCompressor(acc.PowerSGD(2)).policy, Static)
    assert isinstance(acc.AccordionCompressor(acc.TopK(0.1, 0.99), policy="static").policy, Static)


# --- the loop, on the simulated world ---------------------------------------------------------
SHAPES = {"a.weight": (32, 48), "b.weight": (24, 40), "b.bias": (24,)}


def scale_for(rank, step):
    """A gradient scale that changes by regime and differs a lot between ranks: rank 1's local
    norm alone would put layer b in other regimes than rank 0's would."""
    base = 1.0 if step < 12 else 0.2 if step < 24 else 0.19
    return base * (5.0 if rank == 1 and step % 7 == 0 else 1.0)


def run(world_size, steps, make, *, lr=None, grads=None, start_state=None, record_levels=True):
    """Every simulated rank runs `steps` steps; returns per rank (levels per step, results,
    compressor)."""
    def worker(rank, channel):
        comp = make(channel)
        if start_state is not None:
            comp.load_state_dict(start_state[rank])
        levels, results = [], []
        for step in range(steps):
            if lr is not None:
                comp.report_lr(lr(step))
            gen = torch.Generator().manual_seed(100 * step + rank)
            g = grads(rank, step) if grads else {
                n: torch.randn(s, generator=gen) * scale_for(rank, step) for n, s in SHAPES.items()}
            sent = {n: comp.compress_named(n, g[n]) for n in sorted(g)}
            reduced = {n: channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0] for n in sent}
            results.append({n: comp.decompress(reduced[n], sent[n][1]) for n in sorted(sent)})
            levels.append({n: layer["level"] for n, layer in comp.stats()["layers"].items()})
        return levels, results, comp
    return SimulatedWorld(world_size).run(worker)


def accordion(interval=4, **kw):
    return lambda channel: acc.AccordionCompressor(acc.PowerSGD(1, critical_rank=4), interval=interval,
                                                   channel=channel, **kw)


@pytest.mark.parametrize("accumulate", [True, False])
def test_all_ranks_switch_in_the_same_step_despite_rank_dependent_norms(accumulate):
    out = run(2, 36, accordion(interval=4, accumulate=accumulate))
    levels0, levels1 = out[0][0], out[1][0]
    assert levels0 == levels1, "ranks used different levels in the same step"
    seen = {lv for step in levels0 for lv in step.values()}
    assert seen == {C, N, "dense"}, f"the run never switched: {seen}"
    # levels[step] is what the end of that step decided (used from step + 1); decisions
    # happen at the end of every 4th step only.
    for step in range(1, 36):
        if (step + 1) % 4 != 0:
            assert levels0[step] == levels0[step - 1], f"level changed at step {step}, not a detection point"
    # The regime change at step 12 (gradients 5x smaller) makes the window ending at step 15
    # critical for both layers.
    assert levels0[15]["a.weight"] == C and levels0[15]["b.weight"] == C


def test_controller_uses_the_mean_of_the_ranks_norms():
    # Layer norms per rank are known exactly: gradient = c * ones. Rank 0 always 1, rank 1
    # 1 then 3: rank 0 alone would see no change, rank 1 alone +200%; the mean, 1 -> 2, is
    # +100%: critical at eta 0.9, normal at eta 1.5.
    def grads(rank, step):
        c = 1.0 if rank == 0 or step < 4 else 3.0
        return {"w": torch.full((16, 16), c)}
    for eta, expected in ((0.9, C), (1.5, N)):
        out = run(2, 9, accordion(interval=4, eta=eta), grads=grads)
        assert out[0][0][8]["w"] == out[1][0][8]["w"] == expected, (eta, out[0][0])


def test_a_learning_rate_decrease_makes_every_layer_critical_until_the_next_detection():
    def lr(step):
        return 0.1 if step < 17 else 0.01
    # Steady gradients: normal from the second detection (end of step 7) on; the lr drop in
    # step 17 makes everything critical from step 18 until the detection at the end of 19.
    # (levels[step]: what the end of that step decided.)
    out = run(2, 26, accordion(interval=4), lr=lr, grads=lambda rank, step: {"w": torch.full((16, 16), 1.0 + rank)})
    levels = [step["w"] for step in out[0][0]]
    assert levels[7:17] == [N] * 10 and levels[17:19] == [C, C] and levels[19:] == [N] * 7, levels
    assert [step["w"] for step in out[1][0]] == levels


def test_low_rate_holds_every_layer_critical_from_a_tenth_of_the_peak_rate_down():
    # Accordion(low_rate=0.1) (policies/accordion.py): the paper's rule returns to normal at
    # the first detection after the decay (test above); with low_rate it stays critical while
    # the rate is at or below a tenth of its peak. The rate first rises (a warmup: the peak
    # follows it), decays x0.1 in step 17 (critical from there on), and rises again to a
    # quarter of its peak in step 25 (the paper's rule again from the next detection).
    def lr(step):
        return 0.05 if step < 3 else 0.1 if step < 17 else 0.01 if step < 25 else 0.025
    make = lambda channel: acc.AccordionCompressor(acc.PowerSGD(1, critical_rank=4), interval=4, channel=channel,
                                                   policy=Accordion(0.5, low_rate=0.1))  # one policy per rank
    out = run(2, 34, make, lr=lr,
              grads=lambda rank, step: {"w": torch.full((16, 16), 1.0 + rank)})
    levels = [step["w"] for step in out[0][0]]
    assert levels[7:17] == [N] * 10 and levels[17:27] == [C] * 10 and levels[27:] == [N] * 7, levels
    assert [step["w"] for step in out[1][0]] == levels
    # The peak is part of the checkpoint: a resumed run still knows 0.01 is a tenth of it.
    state = out[0][2].state_dict()
    assert state["controller"]["lr_peak"] == [0.1], state["controller"]


def test_low_rate_by_hand_and_bad_values():
    policy = Accordion(eta=0.5, low_rate=0.1)
    assert repr(policy) == "Accordion(eta=0.5, low_rate=0.1)" and policy.config()["low_rate"] == 0.1
    steady = {"w": 1.0}
    policy.end_window(WindowReport(steady, 10, lr_fraction=1.0))
    assert policy.end_window(WindowReport(steady, 10, lr_fraction=1.0)) == {"w": NORMAL}
    assert policy.end_window(WindowReport(steady, 10, lr_fraction=0.1 * 1.0000000001)) == {"w": CRITICAL}
    assert policy.end_window(WindowReport(steady, 10, lr_fraction=0.5)) == {"w": NORMAL}
    assert policy.end_window(WindowReport(steady, 10, lr_fraction=None)) == {"w": NORMAL}  # no rate known
    assert Accordion(0.5).end_window(WindowReport(steady, 10, lr_fraction=0.01)) == {"w": CRITICAL}  # first window
    for bad in (0, 1, 1.5, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="low_rate must be None or a number in \\(0, 1\\)"):
            Accordion(0.5, low_rate=bad)


def test_ranks_with_different_learning_rates_fail_loudly_on_every_rank():
    def make(channel):
        comp = accordion()(channel)
        comp.report_lr(0.1 * (channel.rank + 1))
        return comp
    with pytest.raises(RuntimeError, match="ranks use different learning rates"):
        run(2, 2, make)


def test_epoch_windows():
    def make(channel):
        return acc.AccordionCompressor(acc.PowerSGD(1, 4), interval=None, channel=channel)

    def worker(rank, channel):
        comp = make(channel)
        levels = []
        for epoch in range(4):
            for step in range(3):
                g = torch.full((16, 16), 1.0 if epoch < 2 else 10.0)
                sent, ctx = comp.compress_named("w", g)
                comp.decompress(sent, ctx)
            comp.epoch_end()
            levels.append(comp.stats()["layers"]["w"]["level"])
        return levels
    for levels in SimulatedWorld(2).run(worker):
        assert levels == [C, N, C, N], levels


def test_a_nan_gradient_on_one_rank_skips_the_window_on_every_rank():
    def grads(rank, step):
        g = torch.ones(16, 16)
        if rank == 1 and step == 9:
            g[3, 3] = math.nan
        return {"w": g}
    out = run(2, 16, accordion(interval=4), grads=grads)
    levels = [step["w"] for step in out[0][0]]
    # Windows end at steps 3, 7, 11, 15: critical (first), normal, skipped (NaN), normal
    # (compared with the window ending at 7, the last good one).
    assert levels[:7] == [C] * 7 and levels[7:] == [N] * 9, levels
    assert [step["w"] for step in out[1][0]] == levels


# --- checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("make_codec", [lambda: acc.PowerSGD(1, 4), lambda: acc.TopK(0.05, 0.6)],
                         ids=["powersgd", "topk"])
def test_resuming_from_a_state_dict_is_bit_identical(make_codec):
    def make(channel):
        return acc.AccordionCompressor(make_codec(), interval=3, channel=channel)

    full = run(2, 20, make)
    first = run(2, 11, make)
    states = [r[2].state_dict() for r in first]
    # Through bytes, as a checkpoint file would carry it.
    import io
    buffers = []
    for s in states:
        buffers.append(io.BytesIO())
        torch.save(s, buffers[-1])
    states = [torch.load(io.BytesIO(b.getvalue()), weights_only=False) for b in buffers]

    def later_grads(rank, step):
        gen = torch.Generator().manual_seed(100 * (step + 11) + rank)
        return {n: torch.randn(s, generator=gen) * scale_for(rank, step + 11) for n, s in SHAPES.items()}
    resumed = run(2, 9, make, grads=later_grads, start_state=states)
    for rank in range(2):
        assert resumed[rank][0] == full[rank][0][11:], "levels differ after resuming"
        for a, b in zip(resumed[rank][1], full[rank][1][11:]):
            assert all(torch.equal(a[n], b[n]) for n in a), "results differ after resuming"
        assert resumed[rank][2].stats() == full[rank][2].stats()


@pytest.mark.parametrize("make", [lambda ch: acc.AccordionCompressor(acc.TopK(0.05), policy="gravac", channel=ch),
                                  lambda ch: acc.AccordionCompressor(acc.PowerSGD(1, 4), interval=2, channel=ch)],
                         ids=["topk-gravac", "powersgd"])
def test_a_state_loaded_into_a_compressor_that_already_stepped_keeps_every_counter_live(make):
    """A rollback (what Elastic's restore does): the exchange built before the load must count
    into the loaded counters, not into the dicts the load replaced (issue 46)."""
    def worker(rank, channel):
        comp = make(channel)

        def steps(first):
            for step in range(first, first + 3):
                gen = torch.Generator().manual_seed(100 * step + rank)
                sent = {n: comp.compress_named(n, torch.randn(s, generator=gen) * (1 + step % 3))
                        for n, s in SHAPES.items()}
                for n in sorted(sent):
                    comp.decompress(channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0],
                                    sent[n][1])
        steps(0)
        state = comp.state_dict()
        steps(3)
        straight = comp.stats()
        comp.load_state_dict(state)
        loaded_seconds = dict(comp.seconds)
        steps(3)
        return straight, comp.stats(), loaded_seconds, dict(comp.seconds), comp.exchange.seconds is comp.seconds

    for straight, again, loaded, seconds, shared in SimulatedWorld(2).run(worker):
        assert again == straight  # floats sent per layer, levels, steps: as if never rolled back
        assert shared and seconds["comm"] > loaded["comm"] and seconds["compress"] > loaded["compress"]


def test_load_state_dict_refuses_other_settings_and_garbage():
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(1, 4), channel=channel)
        sent, ctx = comp.compress_named("w", torch.randn(16, 16))
        comp.decompress(sent, ctx)
        state = comp.state_dict()
        other = acc.AccordionCompressor(acc.PowerSGD(2, 4), channel=channel)
        with pytest.raises(ValueError, match=r"different settings: rank: checkpoint 1, this compressor 2"):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="not an AccordionCompressor state_dict"):
            other.load_state_dict({"junk": 1})
        broken = dict(state, layers={"w": dict(state["layers"]["w"], rank=3)})
        with pytest.raises(ValueError, match="does not fit this codec"):
            acc.AccordionCompressor(acc.PowerSGD(1, 4), channel=channel).load_state_dict(broken)
        return True
    assert SimulatedWorld(1).run(worker) == [True]


# --- batch-size mode (the horovodrun test is in test_train_cli.py) ----------------------------
class _Optimizer:
    """What AccordionBatchSize uses of Horovod's DistributedOptimizer."""
    def __init__(self, lr):
        self.param = torch.nn.Parameter(torch.zeros(8, 8))
        self.param_groups = [{"params": [self.param], "lr": lr}]
        self.backward_passes_per_step = 1

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes


def test_batch_size_mode_switches_passes_and_scales_the_lr():
    def worker(rank, channel):
        opt = _Optimizer(lr=0.1)
        batch = acc.AccordionBatchSize(opt, small=1, large=4, interval=2, control=channel.control_plane())
        seen = []
        for step in range(12):
            assert opt.backward_passes_per_step == batch.passes
            assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * batch.passes)
            opt.param.grad = torch.full((8, 8), 1.0 + rank)  # a steady gradient: normal after 2 windows
            seen.append(batch.passes)
            batch.step()
        return seen
    for seen in SimulatedWorld(2).run(worker):
        assert seen == [1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4], seen


@pytest.mark.parametrize("kwargs,message", [
    (dict(small=0), "small must be positive"), (dict(large=2.5), "large must be an int"),
    (dict(small=4, large=2), "large must be >= small"), (dict(eta=0), "eta must be positive"),
])
def test_batch_size_mode_bad_arguments(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        acc.AccordionBatchSize(_Optimizer(0.1), **kwargs)
    with pytest.raises(TypeError, match="Horovod's DistributedOptimizer"):
        acc.AccordionBatchSize(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


# --- GraVAC -------------------------------------------------------------------------------
from accordion_hvd.policies import GraVAC  # noqa: E402


def test_gravac_rule_by_hand():
    policy = GraVAC(min_factor=10, max_factor=80, window=2, epsilon=0.7, omega=0.01, smoothing=0.0)
    assert policy.factors() == (10, 10)
    assert policy.choose(0.9, 0.9) == "candidate"
    assert policy.choose(0.5, 0.8) == "minimum"
    assert policy.choose(0.5, 0.6) == "dense"
    assert policy.choose(math.nan, 0.9) == "dense"
    policy.end_step(1.0)
    policy.end_step(1.0)  # window done: score 10x, grow to 20x
    assert policy.factors() == (20, 10) and policy.searching
    policy.choose(0.75, 0.9)
    policy.end_step(0.5)
    policy.end_step(0.5)  # 20x: twice the throughput, gain 0.75 -> the best so far; grow to 40x
    assert policy.candidate == 40
    policy.choose(0.375, 0.9)  # half the gain at twice the speed: the same compression throughput
    policy.end_step(0.25)
    policy.end_step(0.25)
    assert not policy.searching and policy.candidate == 20, policy.history  # the lower of the two best


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_factor=0.5), "min_factor <= max_factor"), (dict(min_factor=100, max_factor=10), "max_factor"),
    (dict(epsilon=1.5), "epsilon must be in"), (dict(growth="linear"), "growth must be"),
    (dict(window=0), "window must be positive"), (dict(smoothing=1.0), "smoothing must be in"),
])
def test_gravac_bad_arguments(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        GraVAC(**kwargs)


def test_gravac_needs_topk():
    with pytest.raises(ValueError, match="GraVAC.*needs the TopK codec"):
        acc.AccordionCompressor(acc.PowerSGD(1), policy="gravac")


def test_gravac_in_the_compressor_chooses_alike_and_keeps_the_error_feedback_exact():
    # Error-feedback conservation under every choice: what all ranks sent (the mean of
    # their decompressed gradients, times the world size) plus what they keep equals what
    # they were given.
    def worker(rank, channel):
        policy = GraVAC(min_factor=4, max_factor=32, window=3, epsilon=0.5, smoothing=0.0)
        comp = acc.AccordionCompressor(acc.TopK(0.1), policy=policy, channel=channel)
        given, sent, levels = torch.zeros(64 * 48), torch.zeros(64 * 48), []
        for step in range(14):
            gen = torch.Generator().manual_seed(100 * step + rank)
            g = torch.randn(64, 48, generator=gen) * (1 + 3 * (step % 5 == 0))
            given += g.reshape(-1)
            out, ctx = comp.compress_named("w", g.clone())
            sent += comp.decompress(out, ctx).reshape(-1)
            levels.append(comp.stats()["layers"]["w"]["level"])
        return levels, given, sent, comp.engine.layers["w"].residual.clone(), comp.stats()
    out = SimulatedWorld(2).run(worker)
    assert out[0][0] == out[1][0], "ranks chose differently"
    assert len(set(out[0][0])) >= 2, out[0][0]
    given = out[0][1] + out[1][1]
    kept = out[0][3] + out[1][3]
    torch.testing.assert_close(out[0][2] * 2 + kept, given, rtol=1e-5, atol=1e-4)
    assert out[0][4] == out[1][4]
