"""The network-aware policy (accordion_hvd/policies/network_aware.py): the codecs' level errors
against brute force, the search on synthetic networks (what hides under backward goes
gentle, saved error is spent where it buys time, the budget holds), its fallbacks, state
and bad input; the whole path through the compressor on the simulated world; and under real
horovodrun (tests/workers/network_aware_check.py)."""

import functools
import logging
import math
from dataclasses import replace

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.comm.link import LinkMeasurement
from accordion_hvd.costmodel import Link
from accordion_hvd.engine import Route
from accordion_hvd.levels import CRITICAL, DENSE, DENSE16, NORMAL
from accordion_hvd.policies import NetworkAware, NetworkReport, WindowReport
from launch import run_ddp_worker, run_worker

SLOW = Link(alpha=100e-6, beta=8 / 100e6)  # 100 Mbit/s


# --- the codecs' level errors -----------------------------------------------------------------
def test_topk_level_errors_are_the_energy_outside_the_top_k():
    codec = acc.TopK(ratio=0.1, critical_ratio=0.3)
    grad = torch.randn(20, 10, dtype=torch.float64)
    state = codec.init_state("w", grad)
    state.residual.copy_(torch.randn(200, dtype=torch.float64))
    g = grad.reshape(-1) + state.residual
    expected = []
    for k in (20, 60):
        kept = g.abs().sort(descending=True).values[:k]
        expected.append(float(g.square().sum() - kept.square().sum()))
    got = codec.level_errors(state, grad, (NORMAL, CRITICAL, DENSE))
    assert got[:2] == pytest.approx(expected, rel=1e-12) and got[2] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_level_errors_of_32_and_16_bit_gradients_match_float64(dtype):
    """The products run in the residual's precision (float32), the sums in float64: the
    errors stay within float32's rounding of the float64 ones."""
    torch.manual_seed(1)
    grad = torch.randn(96, 40, dtype=dtype)
    residual = torch.randn(96, 40)
    for codec in (acc.TopK(ratio=0.05, critical_ratio=0.2), acc.PowerSGD(rank=1, critical_rank=4)):
        state, exact = codec.init_state("w", grad), codec.init_state("w", grad.double())
        assert state.residual.dtype == torch.float32
        state.residual.copy_(residual.reshape(state.residual.shape))
        exact.residual.copy_(residual.reshape(exact.residual.shape).double())
        got = codec.level_errors(state, grad, codec.levels)
        expected = codec.level_errors(exact, grad.double(), codec.levels)
        # sent whole (TopK, through Horovod), a 16-bit gradient's g = grad + e is rounded to 16 bits
        # (the rest stays in e): that rounding is its error, next to nothing; float32 and float64 have none
        whole = codec.levels.index(DENSE)
        if dtype == torch.float16 and isinstance(codec, acc.TopK):
            assert 0 < got[whole] < 1e-6 * got[0]
            got[whole] = 0.0
        assert got == pytest.approx(expected, rel=1e-5), type(codec).__name__


def test_powersgd_level_errors_are_near_the_best_low_rank_error_and_never_below_it():
    torch.manual_seed(0)
    codec = acc.PowerSGD(rank=1, critical_rank=4)
    low = torch.randn(64, 4, dtype=torch.float64) @ torch.diag(torch.tensor([8.0, 4.0, 2.0, 1.0], dtype=torch.float64)) \
        @ torch.randn(4, 48, dtype=torch.float64)
    grad = low + 0.1 * torch.randn(64, 48, dtype=torch.float64)
    state = codec.init_state("w", grad)
    errors = codec.level_errors(state, grad, (NORMAL, CRITICAL))
    s = torch.linalg.svdvals(grad).square()
    best = [float(s[1:].sum()), float(s[4:].sum())]
    for got, floor in zip(errors, best):
        assert floor * (1 - 1e-9) <= got <= 1.5 * floor
    assert errors[0] > errors[1]


def test_wire_matches_what_the_codecs_send():
    shape = torch.Size([64, 8, 3, 3])
    assert acc.PowerSGD(rank=2).wire(shape, NORMAL) == (("allreduce", 4 * 64 * 2), ("allreduce", 4 * 72 * 2))
    topk = acc.TopK(ratio=0.01, critical_ratio=0.6)
    assert topk.wire(shape, NORMAL) == (("allgather", 8 * math.ceil(0.01 * 4608)),)
    assert topk.wire(shape, CRITICAL) == (("dense", 4 * 4608),)  # keeping >= half: sent dense
    assert topk.wire(shape, DENSE) == (("dense", 4 * 4608),)


def test_powersgd_dense_level_sends_m_itself_and_settles_or_keeps_its_error_feedback():
    """A PowerSGD layer at DENSE: the result is the exact average of every rank's M = grad + e
    (in its bucket's P round), e is zero afterwards; a skipped step (NaN on one rank) keeps
    e = M; back at NORMAL the layer warm-starts from the Q it had; floats are counted."""
    shape = (24, 16)

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=2), policy="static", channel=channel)
        gen = torch.Generator().manual_seed(rank)
        grads = [torch.randn(shape, generator=gen) for _ in range(4)]
        seen = []

        def step(g):
            out, ctx = comp.compress_named("w", g.clone())
            return comp.decompress(out, ctx).clone()

        step(grads[0])  # NORMAL: leaves some error feedback
        e0 = comp.engine.layers["w"].residual.clone()
        q0 = comp.engine.layers["w"].q.clone()
        comp.set_level("w", DENSE)
        seen.append((step(grads[1]), grads[1] + e0, comp.engine.layers["w"].residual.clone()))
        bad = grads[2].clone()
        if rank == 1:
            bad[0, 0] = float("nan")
        seen.append((step(bad), grads[2], comp.engine.layers["w"].residual.clone(), comp.step_skipped))
        comp.set_level("w", NORMAL)
        assert torch.equal(comp.engine.layers["w"].q, q0)
        step(grads[3])
        return seen, comp.stats()["layers"]["w"]

    results = SimulatedWorld(2).run(worker)
    average = (results[0][0][0][1] + results[1][0][0][1]) / 2
    for (dense, _, e_after), (skipped, g2, e_kept, was_skipped) in (r[0] for r in results):
        torch.testing.assert_close(dense, average, rtol=0, atol=1e-6)
        assert torch.count_nonzero(e_after) == 0
        assert was_skipped and torch.count_nonzero(skipped) == 0
    # rank 0's gradient of the skipped step is kept in e (its e was zero before it)
    torch.testing.assert_close(results[0][0][1][2], results[0][0][1][1])
    stats = results[0][1]
    assert stats["floats_sent"] == 2 * (24 + 16) * 2 + 2 * 24 * 16 and stats["level"] == "normal"


@pytest.mark.parametrize("make", [lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)], ids=["powersgd", "topk"])
def test_dense16_sends_float16_and_keeps_the_rounding_in_error_feedback(make):
    """A layer at DENSE16 goes whole in float16 (through the front end's allreduce, as Horovod
    carries it): the result is the float16 average of every rank's g = grad + e, back in the
    gradient's dtype; e keeps exactly what float16 rounded away; a skipped step (NaN on one
    rank) keeps all of g; back at NORMAL the layer compresses again."""
    shape = (24, 16)

    def worker(rank, channel):
        comp = acc.AccordionCompressor(make(), policy="static", channel=channel)
        gen = torch.Generator().manual_seed(rank)
        grads = [torch.randn(shape, generator=gen) for _ in range(4)]

        def step(g):
            out, ctx = comp.compress_named("w", g.clone())
            wire = out.dtype
            if ctx[0] == Route.FRONT_END:  # Horovod's part: the average, in the dtype it was given
                out = channel.wait(channel.allreduce_mean_async([out], "hvd.w"))[0]
            return comp.decompress(out, ctx).clone(), wire

        residual = lambda: comp.engine.layers["w"].residual.clone().reshape(shape)
        step(grads[0])  # NORMAL: leaves some error feedback
        comp.set_level("w", DENSE16)
        g1 = grads[1] + residual()
        result, wire = step(grads[1])
        e1 = residual()
        bad = grads[2].clone()
        if rank == 1:
            bad[3, 3] = float("inf")
        skipped_result, _ = step(bad)
        skipped, e2 = comp.step_skipped, residual()
        comp.set_level("w", NORMAL)
        _, wire_after = step(grads[3])
        return g1, result, wire, e1, skipped_result, skipped, e2, grads[2], wire_after

    out = SimulatedWorld(2).run(worker)
    halves = [r[0].half() for r in out]
    expected = (torch.stack(halves).sum(0) / 2).float()
    for rank, (g1, result, wire, e1, skipped_result, skipped, e2, g2, wire_after) in enumerate(out):
        assert wire == torch.float16 and result.dtype == torch.float32 and wire_after == torch.float32
        assert torch.equal(result, expected), rank
        assert torch.equal(e1, g1 - g1.half().float()), rank  # the rounding, kept for later steps
        assert skipped and torch.count_nonzero(skipped_result) == 0
        kept = e1 + g2 if rank == 0 else e1  # rank 1's non-finite gradient was never folded in
        assert torch.equal(e2, kept), rank


def test_dense16_is_priced_at_two_bytes_and_its_error_is_the_rounding():
    shape = torch.Size([64, 8, 3, 3])
    assert acc.PowerSGD(rank=2).wire(shape, DENSE16) == (("dense", 2 * 64 * 72),)
    assert acc.TopK(ratio=0.01).wire(shape, DENSE16) == (("dense", 2 * 4608),)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    for codec in (acc.PowerSGD(rank=2), acc.TopK(ratio=0.01)):
        state = codec.init_state("w", grad)
        state.residual.normal_(generator=torch.Generator().manual_seed(4))
        g = grad.reshape(state.residual.shape) + state.residual
        dense, dense16 = codec.level_errors(state, grad, (DENSE, DENSE16))
        assert dense == 0.0
        assert dense16 == pytest.approx(float((g - g.half().float()).double().square().sum()), rel=1e-12)


def test_network_aware_measures_dense16_when_asked_for_fp16():
    assert NetworkAware(warmup=0, dense="fp16").dense_level == DENSE16 and NetworkAware(warmup=0).dense_level == DENSE
    assert NetworkAware(warmup=0, dense="fp16").config()["dense"] == "fp16"
    with pytest.raises(ValueError, match=r"dense must be one of \['fp16', 'fp32'\], got 'bf16'"):
        NetworkAware(warmup=0, dense="bf16")
    comp = acc.AccordionCompressor(acc.TopK(ratio=0.01, critical_ratio=0.1), policy=NetworkAware(warmup=0, dense="fp16"))
    assert comp.engine.probe.levels == (NORMAL, CRITICAL, DENSE16)


# --- the search ----------------------------------------------------------------------------------
def topk_network(link, ready, backward, sizes, buckets, dense=DENSE):
    codec = acc.TopK(ratio=0.01, critical_ratio=0.1)
    levels = (NORMAL, CRITICAL, dense)
    wire = {n: {lv: codec.wire(torch.Size([sizes[n]]), lv) for lv in levels} for n in sizes}
    return NetworkReport(link=link, world=4, backward_s=backward, ready_s=ready, buckets=buckets, wire=wire)


def errors_for(sizes, dense=DENSE):
    """A level's error: 1% keeps a tenth of the energy lost at 10%... (made up, monotone);
    float16's rounding costs next to nothing."""
    return {n: {NORMAL: 1.0 * sizes[n], CRITICAL: 0.5 * sizes[n], dense: 0.0 if dense == DENSE else 1e-6 * sizes[n]}
            for n in sizes}


def window(policy, norms, errors, network, steps=10):
    return policy.end_window(WindowReport(norms, steps, errors=errors, network=network))


def test_layers_whose_communication_hides_under_backward_go_dense_the_last_ones_stay():
    sizes = {"early": 1 << 16, "late": 1 << 22}
    ready = {"early": 0.0, "late": 0.5}
    network = topk_network(SLOW, ready, 0.5, sizes, (("early",), ("late",)))
    policy = NetworkAware(warmup=0, verify=False)
    norms = {"early": 1.0, "late": 1.0}
    window(policy, norms, None, None)  # first window: everything critical, nothing to compare
    levels = window(policy, norms, errors_for(sizes), network)  # same norms: Accordion says normal
    assert levels == {"early": DENSE, "late": NORMAL}
    last = policy.last
    assert last["predicted_s"] <= last["accordion_s"] + 1e-12 and last["error"] <= last["budget"]


def test_the_first_warmup_windows_keep_accordions_levels_without_a_search():
    """A short job stays Accordion: no level errors measured, no trial, until ``warmup``
    windows have passed; then the same search as without the warm-up."""
    sizes = {"early": 1 << 16, "late": 1 << 22}
    network = topk_network(SLOW, {"early": 0.0, "late": 0.5}, 0.5, sizes, (("early",), ("late",)))
    norms, asked = {"early": 1.0, "late": 1.0}, []

    def report():
        return WindowReport(norms, 10, network=network,
                            measure_errors=lambda: asked.append(1) or errors_for(sizes))
    policy = NetworkAware(verify=False, warmup=3)
    seen, said = [], []
    for _ in range(4):
        seen.append(policy.end_window(report()))
        said.append(policy.last.get("kept", ""))
    assert seen[:3] == [{"early": CRITICAL, "late": CRITICAL}] + [{"early": NORMAL, "late": NORMAL}] * 2
    assert all("warm-up" in why for why in said[:3]) and "warm-up" not in said[3]
    assert seen[3] == {"early": DENSE, "late": NORMAL} and len(asked) == 1  # errors measured only now
    assert NetworkAware().warmup == 8 and NetworkAware().config()["warmup"] == 8
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="warmup"):
            NetworkAware(warmup=bad)


def test_a_layer_that_hides_only_in_float16_goes_dense16_when_the_policy_may_send_fp16():
    # 1 Mi entries ready at 0 s, backward over at 0.8 s: a ring allreduce of it among 4 takes
    # 1.0 s in float32 on the planned link (100 Mbit/s, headroom 2) and would lengthen the
    # step; in float16 0.5 s, hidden.
    sizes = {"early": 1 << 20, "late": 1 << 20}
    ready = {"early": 0.0, "late": 0.8}
    chosen = {}
    for dense, name in ((DENSE, "fp32"), (DENSE16, "fp16")):
        network = topk_network(SLOW, ready, 0.8, sizes, (("early",), ("late",)), dense=dense)
        policy = NetworkAware(warmup=0, verify=False, dense=name)
        chosen[name] = window(policy, {"early": 1.0, "late": 1.0}, errors_for(sizes, dense), network)
    assert chosen["fp32"]["early"] == CRITICAL and chosen["fp16"]["early"] == DENSE16
    assert chosen["fp32"]["late"] == chosen["fp16"]["late"]


def test_a_layer_beyond_float16s_range_never_goes_dense16():
    """Its DENSE16 error is infinite (the level cannot carry it): the search leaves that level
    out for that layer, and the window is still usable (not every layer falls back)."""
    grad = torch.randn(64, 72)
    grad[3, 5] = 1e5  # > 65504
    for codec in (acc.PowerSGD(rank=2), acc.TopK(ratio=0.01)):
        state = codec.init_state("w", grad)
        assert codec.level_errors(state, grad, (DENSE16,)) == [math.inf]
    sizes = {"early": 1 << 20, "late": 1 << 20}
    ready = {"early": 0.0, "late": 0.8}
    network = topk_network(SLOW, ready, 0.8, sizes, (("early",), ("late",)), dense=DENSE16)
    errors = errors_for(sizes, DENSE16)
    errors["early"][DENSE16] = math.inf
    policy = NetworkAware(warmup=0, verify=False, dense="fp16")
    levels = window(policy, {"early": 1.0, "late": 1.0}, errors, network)
    assert levels["early"] == CRITICAL and "kept" not in policy.last  # searched, DENSE16 not chosen


def test_error_saved_where_it_is_free_is_spent_where_it_buys_time():
    # Critical regime (first windows): the budget is every layer at 10%. The early layer goes
    # dense for free, and the error it saves lets the big late layer drop to 1%.
    sizes = {"early": 1 << 20, "late": 1 << 20}
    ready = {"early": 0.0, "late": 2.0}  # dense early: 0.5 s on the link, 1 s planned (headroom 2)
    network = topk_network(SLOW, ready, 2.0, sizes, (("early",), ("late",)))
    policy = NetworkAware(warmup=0, verify=False)
    levels = window(policy, {"early": 1.0, "late": 1.0}, errors_for(sizes), network)
    assert levels == {"early": DENSE, "late": NORMAL}
    assert policy.last["error"] <= policy.last["budget"]
    assert policy.last["predicted_s"] < policy.last["accordion_s"]


def test_margins_a_transfer_that_hides_only_on_the_measured_link_and_a_trade_for_a_small_gain():
    # Dense early takes 0.5 s on the measured link, under a backward of 0.8 s: hidden on the
    # link as measured, not on one twice as slow. The late layer's trade saves ~0.18 s of ~1 s.
    sizes = {"early": 1 << 20, "late": 1 << 20}
    network = topk_network(SLOW, {"early": 0.0, "late": 0.8}, 0.8, sizes, (("early",), ("late",)))
    norms, errors = {"early": 1.0, "late": 1.0}, errors_for(sizes)
    bare = NetworkAware(warmup=0, headroom=1.0, min_gain=0.0, verify=False).end_window(WindowReport(norms, 1, errors=errors, network=network))
    assert bare == {"early": DENSE, "late": NORMAL}
    careful = NetworkAware(warmup=0, verify=False).end_window(WindowReport(norms, 1, errors=errors, network=network))
    assert careful == {"early": CRITICAL, "late": CRITICAL}  # Accordion's: nothing hides with the margin
    picky = NetworkAware(warmup=0, headroom=1.0, min_gain=0.5, verify=False)
    assert picky.end_window(WindowReport(norms, 1, errors=errors, network=network)) == {"early": DENSE,
                                                                                        "late": CRITICAL}


def test_a_layer_that_cannot_hide_never_goes_gentler_than_its_budget():
    sizes = {"only": 1 << 16}
    network = topk_network(SLOW, {"only": 0.2}, 0.2, sizes, (("only",),))
    policy = NetworkAware(warmup=0, verify=False)
    norms = {"only": 1.0}
    window(policy, norms, None, None)
    assert window(policy, norms, errors_for(sizes), network) == {"only": NORMAL}
    assert NetworkAware(warmup=0, tolerance=0.9, verify=False).end_window(WindowReport(norms, 1, errors=errors_for(sizes), network=network)) \
        == {"only": DENSE}  # 90% of a step of tolerance pays dense's 31 ms: the gentlest level


def test_kernel_work_counts_each_rounds_math_and_the_finish():
    shape = torch.Size([512, 512, 3, 3])  # a ResNet-18 layer: M is 512 x 4608
    psgd = acc.PowerSGD(rank=1, critical_rank=4)
    for level in (NORMAL, CRITICAL, DENSE, DENSE16):
        assert len(psgd.kernel_work(shape, level)) == len(psgd.wire(shape, level)) + 1
    r1, r4, dense, dense16 = (sum(psgd.kernel_work(shape, lv)) for lv in (NORMAL, CRITICAL, DENSE, DENSE16))
    assert dense < dense16 < r1 < r4  # whole: one add and one settle; compressed: two products more
    nm = 512 * 4608
    assert psgd.kernel_work(shape, NORMAL)[0] == 3 * 4 * nm + nm  # grad + e into e (3 passes), P = M Q
    topk = acc.TopK(ratio=0.01, critical_ratio=0.1)
    for level in (NORMAL, CRITICAL, DENSE, DENSE16):
        assert len(topk.kernel_work(shape, level)) == len(topk.wire(shape, level)) + 1
    assert sum(topk.kernel_work(shape, DENSE)) < sum(topk.kernel_work(shape, NORMAL)) \
        < sum(topk.kernel_work(shape, CRITICAL))


def test_the_prediction_prices_each_levels_math():
    """On a fast link a layer ready at the end of backward: sent whole it costs 7 ms on the wire
    (planned) and little math; at 1% almost no wire but 50 ms of selection. Without the math
    in the model the policy keeps Accordion's 1%; with it, the layer goes whole."""
    fast = Link(alpha=10e-6, beta=8 / 10e9)
    sizes = {"early": 1 << 10, "late": 1 << 20}
    network = topk_network(fast, {"early": 0.0, "late": 0.5}, 0.5, sizes, (("early",), ("late",)))
    kernels = {n: {NORMAL: (0.05, 0.01), CRITICAL: (0.05, 0.02), DENSE: (0.001, 0.001)} for n in sizes}
    norms = {"early": 1.0, "late": 1.0}
    chosen = {}
    for name, report in (("wire only", network), ("with math", replace(network, kernel_s=kernels))):
        policy = NetworkAware(warmup=0, verify=False)
        window(policy, norms, None, None)
        chosen[name] = window(policy, norms, errors_for(sizes), report)
    assert chosen["wire only"]["late"] == NORMAL and chosen["with math"]["late"] == DENSE
    bad = replace(network, kernel_s={**kernels, "late": {**kernels["late"], NORMAL: (math.nan, 0.0)}})
    policy = NetworkAware(warmup=0, verify=False)
    assert window(policy, norms, errors_for(sizes), bad) == {"early": CRITICAL, "late": CRITICAL}
    assert "not finite" in policy.last["kept"]


class _OneRank:
    size = 1

    def allreduce(self, values, name, op):
        return list(values)


def test_the_probe_leaves_the_math_out_of_ready_times_and_prices_every_level(monkeypatch):
    import accordion_hvd.network_probe as probe_module
    clock, math_clock = [0.0], {"compress": 0.0}
    monkeypatch.setattr(probe_module.time, "perf_counter", lambda: clock[0])
    codec = acc.PowerSGD(rank=1, critical_rank=4)
    states = {"a": codec.init_state("a", torch.zeros(64, 32)), "b": codec.init_state("b", torch.zeros(128, 64))}
    probe = probe_module.NetworkProbe(codec, states, seconds=math_clock)
    for _ in range(3):  # per step: a ready, 0.1 s of math, 0.2 s of backward, b ready, 0.05 s of math
        probe.mark("a")
        clock[0] += 0.3
        math_clock["compress"] += 0.1
        probe.mark("b")
        clock[0] += 0.05
        math_clock["compress"] += 0.05
        probe.end_step()
    probe.window(SLOW, [("a", "b")])
    report = probe.network(_OneRank(), ["a", "b"])
    assert report.ready_s == pytest.approx({"a": 0.0, "b": 0.2}) and report.backward_s == pytest.approx(0.2)
    ran = sum(sum(codec.kernel_work(states[n].shape, states[n].level)) for n in states)
    for n in states:  # the window's 0.15 s of math per step, spread over its levels' work
        for level in probe.levels:
            assert report.kernel_s[n][level] == pytest.approx(
                tuple(w * 0.15 / ran for w in codec.kernel_work(states[n].shape, level)))
    assert sum(sum(report.kernel_s[n][states[n].level]) for n in states) == pytest.approx(0.15)
    blind = probe_module.NetworkProbe(codec, states)
    blind.mark("a")
    blind.end_step()
    blind.window(SLOW, [("a", "b")])
    assert blind.network(_OneRank(), ["a", "b"]).kernel_s == {}  # no math clock: no math priced


@pytest.mark.parametrize("why,change", [
    ("no link", dict(link=None)),
    ("not finite", dict(backward_s=math.nan)),
    ("negative", dict(ready_s={"a": -1.0, "b": 1.0})),
    ("no exchange", dict(buckets=())),
    ("negative", "errors"),
    ("no exchange yet", "none"),
])
def test_without_a_usable_report_every_layer_is_gentle_and_ranks_still_agree(why, change, caplog):
    sizes = {"a": 1 << 16, "b": 1 << 20}
    base = dict(link=SLOW, world=2, backward_s=1.0, ready_s={"a": 0.0, "b": 1.0}, buckets=(("a", "b"),),
                wire=topk_network(SLOW, {}, 0, sizes, ()).wire)
    network = NetworkReport(**{**base, **(change if isinstance(change, dict) else {})})
    errors = errors_for(sizes)
    if change == "errors":
        errors["a"][NORMAL] = -1.0
    if change == "none":
        errors = network = None
    # Level errors are looked at only when the search runs; with the check against the clock it
    # would not before Accordion's levels were timed, so the bad errors' case runs without it.
    policy, regimes = NetworkAware(warmup=0, eta=0.3, verify=change != "errors"), acc.policies.Accordion(eta=0.3)
    for norms in ({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 1.1, "b": 2.0}):
        report = WindowReport(norms, 5, errors=errors, network=network)
        assert policy.end_window(report) == {"a": CRITICAL, "b": CRITICAL}
        regimes.end_window(report)
    assert why in policy.last["kept"] and why in caplog.text
    assert policy.regimes.state_dict() == regimes.state_dict()  # regime detection went on underneath


def early_and_late():
    """The first search test's setting, whose search sends "early" whole (free by the link)
    and keeps "late" at 1%: its network, norms, errors, Accordion's levels and its own."""
    sizes = {"early": 1 << 16, "late": 1 << 22}
    network = topk_network(SLOW, {"early": 0.0, "late": 0.5}, 0.5, sizes, (("early",), ("late",)))
    return (network, {"early": 1.0, "late": 1.0}, errors_for(sizes), {"early": NORMAL, "late": NORMAL},
            {"early": DENSE, "late": NORMAL})


def test_its_own_levels_only_after_accordions_were_measured_and_only_while_they_measure_no_slower(caplog):
    # The search's choice of the first test (early dense, late normal), under the check against
    # the clock: each window reports the step measured at the levels the policy gave it.
    caplog.set_level(logging.INFO, "accordion_hvd.policies")
    network, norms, errors, accordion, own = early_and_late()

    def run(policy, step_of, measured=None):
        """Windows in which a step takes ``step_of(levels)`` seconds; the levels of each. The
        errors come on demand, as from the controller: ``measured`` lists the windows that
        asked for them."""
        levels, seen = {"early": CRITICAL, "late": CRITICAL}, []
        policy.verdicts = []

        def measure(i):
            if measured is not None:
                measured.append(i)
            return errors

        for i in range(6):
            report = WindowReport(norms, 10, network=replace(network, step_s=step_of(levels)) if seen else None,
                                  measure_errors=functools.partial(measure, i))
            levels = {**levels, **policy.end_window(report)}
            seen.append(dict(levels))
            policy.verdicts.append(policy.last.get("verified"))
        return seen

    asked = []
    faster = run(NetworkAware(warmup=0), lambda lv: 0.9 if lv == own else 1.0, asked)
    assert faster[1] == accordion  # first window with a budget of normal levels: measure them
    assert faster[2:] == [own] * 4  # then its own, kept while they measure faster
    assert asked == [2, 3, 4, 5]  # the errors only where the search ran
    slower, asked = NetworkAware(warmup=0), []
    seen = run(slower, lambda lv: 1.1 if lv == own else 1.0, asked)
    assert seen[1:] == [accordion, own, accordion, accordion, accordion]  # tried once, measured slower
    assert asked == [2]  # once vetoed, a window ends without the level errors' products
    assert "measured 1.1000 s per step" in caplog.text and "measured slower" in slower.last["verified"]
    unmeasured = run(NetworkAware(warmup=0), lambda lv: None)  # no rank timed a step: Accordion's levels throughout
    assert unmeasured[1:] == [accordion] * 5
    # a verdict expires: after `memory` windows the search runs again (now with the host cost
    # its trial taught it, so it chooses Accordion's levels by itself: no trial, no verdict)
    forgetful = NetworkAware(warmup=0, memory=1)
    assert run(forgetful, lambda lv: 1.1 if lv == own else 1.0)[1:] == [accordion, own, accordion, accordion, accordion]
    assert forgetful.verdicts[4].startswith("measured slower") and forgetful.verdicts[5] is None
    # the state carries the measurements: a resumed policy decides as the uninterrupted one
    first, again = NetworkAware(warmup=0), NetworkAware(warmup=0)
    run(first, lambda lv: 1.1 if lv == own else 1.0)
    again.load_state_dict(first.state_dict())
    assert again.state_dict() == first.state_dict()
    assert window(again, norms, errors, replace(network, step_s=1.0)) == accordion


def test_a_search_that_keeps_accordions_levels_is_not_repeated_until_it_expires():
    # Nothing can hide (the only layer is ready at the end of backward): the search keeps the
    # budget's levels, and the windows after it skip the level errors' products until `memory`.
    sizes = {"only": 1 << 16}
    network = topk_network(SLOW, {"only": 0.2}, 0.2, sizes, (("only",),))
    norms, errors = {"only": 1.0}, errors_for(sizes)
    policy, asked, levels = NetworkAware(warmup=0, memory=3), [], []
    for i in range(8):
        report = WindowReport(norms, 10, network=replace(network, step_s=1.0) if i else None,
                              measure_errors=lambda i=i: asked.append(i) or errors)
        levels.append(policy.end_window(report)["only"])
        if i == 3:
            assert "its search kept Accordion's levels" in policy.last["verified"]
    assert levels == [CRITICAL] + [NORMAL] * 7
    assert asked == [2, 6]  # searched once Accordion's levels were measured, and again when that expired
    again = NetworkAware(warmup=0, memory=3)
    again.load_state_dict(policy.state_dict())
    assert again.state_dict() == policy.state_dict() and again.state_dict()["kept"]


def test_a_trial_slower_than_predicted_teaches_the_host_cost_of_a_byte(caplog):
    # The search's choice of the first test sends "early" whole for free by the link alone.
    # Measured 0.1 s per step slower than Accordion's levels (as a transfer's CPU slows backward
    # on shared cores), the trial sets the cost of a byte so that the model would have said so,
    # and the next search no longer sends it whole; a trial measured faster lowers it again.
    caplog.set_level(logging.INFO, "accordion_hvd.policies")
    network, norms, errors, accordion, own = early_and_late()
    extra = sum(b for _, b in network.wire["early"][DENSE]) - sum(b for _, b in network.wire["early"][NORMAL])
    policy = NetworkAware(warmup=0)
    steps = {str(accordion): 1.0, str(own): 1.1}
    levels = window(policy, norms, None, None)  # critical: nothing to compare yet
    for _ in range(3):  # Accordion's levels measured, then its own tried, then judged
        levels = window(policy, norms, errors, replace(network, step_s=steps.get(str(levels), 1.0)))
    assert levels == accordion and "measured slower" in policy.last["verified"]
    assert policy.state_dict()["host_s_per_byte"] == pytest.approx(0.1 / extra)
    assert "for %d bytes more per step" % extra in caplog.text
    assert policy.choose(accordion, errors, network) == accordion  # sending it whole is no longer free
    assert NetworkAware(warmup=0).choose(accordion, errors, network) == own  # (without what it learned)
    learned = policy.state_dict()["host_s_per_byte"]  # the model now says what the clock said
    assert policy.predict(own, network, learned) - policy.predict(accordion, network, learned) == pytest.approx(0.1)

    cheap = NetworkAware(warmup=0)  # a trial that measured 0.05 s faster than the model said: the cost never goes below 0
    state = cheap.state_dict()
    state["host_s_per_byte"] = 0.02 / extra
    cheap.load_state_dict(state)
    cheap._trial_model = [1.0, 1.0, 0, extra]
    cheap._calibrate(-0.05)
    assert cheap.state_dict()["host_s_per_byte"] == 0.0
    for sent in ([extra, extra], [20 * extra, 21 * extra]):  # no more bytes than the budget, 5% more: too few
        cheap._trial_model = [1.0, 1.0, *sent]
        cheap._calibrate(0.3)
        assert cheap.state_dict()["host_s_per_byte"] == 0.0


def test_state_round_trip_and_bad_input():
    policy = NetworkAware(warmup=0, eta=0.4, tolerance=0.02, headroom=1.5, min_gain=0.1)
    policy.end_window(WindowReport({"a": 1.0}, 3))
    state = policy.state_dict()
    again = NetworkAware(warmup=0, eta=0.4, tolerance=0.02, headroom=1.5, min_gain=0.1)
    again.load_state_dict(state)
    assert again.state_dict() == state and again.config() == policy.config()
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="tolerance"):
            NetworkAware(warmup=0, tolerance=bad)
        with pytest.raises(ValueError, match="min_gain"):
            NetworkAware(warmup=0, min_gain=bad)
    for bad in (0.5, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="headroom"):
            NetworkAware(warmup=0, headroom=bad)
    with pytest.raises(ValueError, match="eta"):
        NetworkAware(warmup=0, eta=0)
    for bad in (0, 1.5, True, "3"):
        with pytest.raises(ValueError, match="memory"):
            NetworkAware(warmup=0, memory=bad)
    with pytest.raises(ValueError, match="verify"):
        NetworkAware(warmup=0, verify=1)
    with pytest.raises(ValueError, match="accumulate=True"):
        acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=2), policy=NetworkAware(warmup=0), accumulate=False)
    assert isinstance(acc.AccordionCompressor(policy="network-aware").policy, NetworkAware)


# --- through the compressor ----------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_the_compressor_measures_and_every_rank_decides_the_same(codec):
    shapes = {"a.weight": (64, 32), "b.weight": (128, 64), "c.weight": (32, 128)}

    def worker(rank, channel):
        make = acc.PowerSGD(rank=1, critical_rank=2) if codec == "powersgd" else acc.TopK(0.05, 0.2)
        comp = acc.AccordionCompressor(make, policy=NetworkAware(warmup=0, eta=0.3), interval=3, channel=channel)
        # the simulated data plane times nothing: the link is given, the same on every rank
        comp.engine.between.measure_link = lambda: LinkMeasurement(SLOW, 10)
        gen = torch.Generator().manual_seed(rank)
        decided = []
        for step in range(9):
            ctxs = [comp.compress_named(n, torch.randn(s, generator=gen) * (1 + step % 4)) for n, s in shapes.items()]
            for out, ctx in ctxs:
                comp.decompress(out, ctx)
            decided.append(dict(comp.controller.levels))
        return decided, dict(comp.policy.last), comp.policy.state_dict()["measured"]

    results = SimulatedWorld(2).run(worker)
    assert results[0] == results[1]  # levels every step, the last decision's figures, the measured steps
    last, measured = results[0][1], results[0][2]
    assert "predicted_s" in last and last["error"] <= last["budget"] * (1 + 1e-9)
    assert measured and all(seconds > 0 for _, seconds in measured.values())


@pytest.mark.horovod
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_under_horovodrun_a_real_link_is_measured_and_ranks_agree(codec):
    out = run_worker("network_aware_check.py", codec, "24", np=2, backend="gloo")
    assert out.count(": OK network-aware") == 2, out


@pytest.mark.horovod
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_under_horovodrun_dense16_is_horovods_float16_average(codec):
    out = run_worker("dense16_check.py", codec, np=2, backend="gloo")
    assert out.count(f"OK dense16 ({codec}, horovod,") == 2, out


@pytest.mark.torchrun
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_under_torchrun_dense16_is_the_float16_average_through_the_ddp_hook(codec):
    out = run_ddp_worker("dense16_check.py", codec, "ddp", np=2)
    assert out.count(f"OK dense16 ({codec}, ddp,") == 2, out
