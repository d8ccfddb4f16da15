"""The link-gate policy (accordion_hvd/policies/link_gate.py) and the default configuration it
is part of (``acc.AccordionCompressor()``): its trials and decision on synthetic windows, its
state and bad input, through the compressor on the simulated world, and under real horovodrun
and torchrun (tests/workers/default_check.py)."""

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.levels import CRITICAL, DENSE16, NORMAL
from accordion_hvd.policies import Accordion, GraVAC, LinkGate, NetworkAware, NetworkReport, Static, WindowReport
from launch import run_ddp_worker, run_worker

LAYERS = ("a", "b")


def window(step_s, norms=(1.0, 1.0), lr_decreased=False):
    network = None if step_s == "none" else NetworkReport(link=None, world=2, backward_s=0.0, ready_s={}, buckets=(),
                                                          wire={}, step_s=step_s)
    return WindowReport(norms=dict(zip(LAYERS, norms)), steps=10, lr_decreased=lr_decreased, network=network)


def levels_of(levels):
    return [levels[layer] for layer in LAYERS]


@pytest.mark.parametrize("dense_s, compressed_s, pays", [(0.534, 0.275, True), (0.317, 0.29, False),
                                                          (0.5, 0.4, False), (0.5, 0.39, True)])
def test_compressed_trial_then_dense_trial_then_the_measured_choice(dense_s, compressed_s, pays):
    gate = LinkGate(Accordion(0.5))
    assert [gate.initial_level(layer) for layer in LAYERS] == [NORMAL, NORMAL]  # the compressed trial: aggressive
    assert levels_of(gate.end_window(window(compressed_s))) == [DENSE16, DENSE16]  # the dense trial
    assert gate.settled_level is None  # trials
    decided = gate.end_window(window(dense_s, norms=(1.0, 3.0)))
    assert gate.compressing == pays
    assert gate.settled_level == (None if pays else DENSE16)
    # compression pays: Accordion's own levels (b's norm tripled: critical); else dense16 for good
    assert levels_of(decided) == ([NORMAL, CRITICAL] if pays else [DENSE16, DENSE16])
    later = gate.end_window(window(0.01, norms=(1.0, 3.0)))
    assert levels_of(later) == ([NORMAL, NORMAL] if pays else [DENSE16, DENSE16])
    assert gate.lr_decreased(list(LAYERS)) == ({"a": CRITICAL, "b": CRITICAL} if pays else None)


def test_the_dense_trial_is_a_short_window():
    gate = LinkGate(Static(), trial_steps=5)
    assert gate.window_steps(100) == 100  # the compressed trial: the job's window
    gate.end_window(window(0.5))
    assert gate.phase == "dense-trial" and gate.window_steps(100) == 5 and gate.window_steps(4) == 4
    gate.end_window(window(2.0))
    assert gate.phase == "compressed" and gate.window_steps(100) == 100
    assert LinkGate(Static()).trial_steps == 8 and gate.config()["trial_steps"] == 5
    for bad in (2, 0, 3.5, "8", True):
        with pytest.raises((TypeError, ValueError), match="trial_steps"):
            LinkGate(Static(), trial_steps=bad)


def test_through_the_compressor_the_dense_trial_lasts_trial_steps():
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, min_numel=8), policy=LinkGate(Static(), trial_steps=3),
                                       interval=6, channel=channel)
        seen = []
        for _ in range(12):
            out, ctx = comp.compress_named("a.weight", torch.randn(16, 8))
            comp.decompress(out, ctx)
            seen.append(str(comp.controller.levels["a.weight"]))
        return seen, comp.policy.phase

    for seen, phase in SimulatedWorld(2).run(worker):
        # (seen[i]: the level after step i + 1, for the next step) 6 compressed steps, then 3 dense
        assert seen[:5] == ["normal"] * 5 and seen[5:8] == ["dense16"] * 3, seen
        assert phase in ("dense", "compressed") and seen[8:] == ["dense16" if phase == "dense" else "normal"] * 4, seen


def test_a_state_saved_when_the_dense_trial_came_first_finishes_that_order():
    gate = LinkGate(Static())
    gate.load_state_dict({"phase": "dense-trial", "dense_s": None, "compressed_s": None, "inner": {}})
    assert levels_of(gate.end_window(window(0.5))) == [NORMAL, NORMAL] and gate.phase == "compressed-trial"
    gate.end_window(window(0.2))
    assert gate.verdict()["verdict"] == "compress" and (gate.dense_s, gate.compressed_s) == (0.5, 0.2)


@pytest.mark.parametrize("missing", ["none", None, float("nan"), 0.0])
def test_a_window_without_a_measured_step_repeats_its_trial(missing, caplog):
    gate = LinkGate(Static())
    caplog.set_level("INFO", logger="accordion_hvd.policies")
    assert levels_of(gate.end_window(window(missing))) == [NORMAL, NORMAL]
    assert gate.phase == "compressed-trial" and "no measured step" in caplog.text
    gate.end_window(window(0.2))
    assert levels_of(gate.end_window(window(missing))) == [DENSE16, DENSE16] and gate.phase == "dense-trial"
    gate.end_window(window(0.5))
    assert gate.phase == "compressed" and gate.verdict()["verdict"] == "compress"
    assert gate.verdict()["summary"] == ("link-gate: a dense 16-bit step took 0.500 s, a compressed one 0.200 s "
                                         "(2.50x): compression pays (more than 1.25x), compressing from now on")


def test_no_learning_rate_reaction_before_compression_is_found_to_pay():
    gate = LinkGate(Accordion(0.5))
    assert gate.lr_decreased(list(LAYERS)) is None  # the dense trial stays dense


def test_the_inner_policy_sees_every_window():
    """Accordion's norms are current when it takes over: the dense windows' norms count."""
    gate = LinkGate(Accordion(0.5))
    gate.end_window(window(0.1, norms=(1.0, 1.0)))
    gate.end_window(window(0.5, norms=(1.0, 1.2)))  # relative change 0.2 < eta: normal
    assert levels_of(gate.end_window(window(0.1, norms=(1.0, 1.2)))) == [NORMAL, NORMAL]
    assert gate.inner.state_dict()["prev"] == {"a": 1.0, "b": 1.2}


def test_state_round_trip_resumes_without_new_trials_and_bad_input():
    gate = LinkGate(Accordion(0.5))
    gate.end_window(window(0.2))
    gate.end_window(window(0.5))
    again = LinkGate(Accordion(0.5))
    again.load_state_dict(gate.state_dict())
    assert again.state_dict() == gate.state_dict() and again.compressing
    assert again.initial_level("new") == CRITICAL  # a layer that appears later: Accordion's first window
    with pytest.raises(ValueError, match="phase"):
        again.load_state_dict({**gate.state_dict(), "phase": "maybe"})
    for bad in (1.0, 0.5, 0, -2, float("nan"), "2"):
        with pytest.raises((TypeError, ValueError), match="pays"):
            LinkGate(Static(), pays=bad)
    for inner in (GraVAC(), NetworkAware()):
        with pytest.raises(ValueError, match="inner"):
            LinkGate(inner)
    with pytest.raises(TypeError, match="inner"):
        LinkGate("accordion")


def test_the_default_configuration_and_what_a_chosen_codec_keeps():
    default = acc.AccordionCompressor()  # evidence-v2 amendment 8: 8 bits in sparse chunks, gated
    assert isinstance(default.policy, LinkGate) and isinstance(default.policy.inner, Static)
    assert isinstance(default.codec, acc.Quantize) and (default.codec.bits, default.codec.skip_energy) == (8, 0.05)
    assert default.policy.pays == 1.05
    assert isinstance(acc.AccordionCompressor(policy="static").policy, Static)  # a policy given: that one
    chosen = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4))
    assert isinstance(chosen.policy, Accordion)  # a codec given: Accordion, as before
    gated = acc.AccordionCompressor(acc.TopK(0.01), policy="link-gate").policy
    assert isinstance(gated, LinkGate) and isinstance(gated.inner, Static) and gated.pays == 1.25
    # 8 bits lose no steps: the gate keeps them for any step measurably shorter than dense's
    assert acc.AccordionCompressor(acc.Quantize(8), policy="link-gate").policy.pays == 1.05
    assert acc.AccordionCompressor(acc.Quantize(8), policy=LinkGate(Static(), pays=1.5)).policy.pays == 1.5


CODECS = {"default": None, "topk": lambda: acc.TopK(0.01), "quantize": lambda: acc.Quantize(8)}


@pytest.mark.parametrize("codec", CODECS)
def test_through_the_compressor_every_rank_takes_the_same_decision(codec):
    """The trials measure and decide with every codec (Quantize's once stayed in its dense
    trial for good: its exchange had no buckets yet when every layer went whole)."""
    shapes = {"a.weight": (64, 48), "b.weight": (128, 64), "c.weight": (96, 128)}

    def worker(rank, channel):
        comp = acc.AccordionCompressor(CODECS[codec] and CODECS[codec](), policy="link-gate", interval=3,
                                       channel=channel)
        gen = torch.Generator().manual_seed(rank)
        seen = []
        for _ in range(10):
            for out, ctx in [comp.compress_named(n, torch.randn(s, generator=gen)) for n, s in shapes.items()]:
                comp.decompress(out, ctx)
            seen.append(sorted({str(level) for level in comp.controller.levels.values()}))
        return seen, comp.policy.state_dict()

    results = SimulatedWorld(2).run(worker)
    assert results[0] == results[1]
    seen, state = results[0]
    assert seen[:2] == [["normal"]] * 2 and seen[3:5] == [["dense16"]] * 2  # the simulated link is fast
    assert state["phase"] in ("dense", "compressed") and state["dense_s"] > 0 and state["compressed_s"] > 0
    assert all(s == ["dense16"] for s in seen[6:]) if state["phase"] == "dense" else \
        all("dense16" not in s for s in seen[6:])


def settle(comp):
    """The gate set as its trials decide where compression does not pay."""
    gate = comp.engine.policy
    gate.load_state_dict({**gate.state_dict(), "phase": "dense", "dense_s": 1.0, "compressed_s": 1.0})


def test_the_verdict_is_in_stats_and_said_once_by_rank_0(caplog):
    """stats()["gate"] on every rank; rank 0 alone logs the verdict, once, under
    accordion_hvd.levels (shown by default, as level changes are)."""
    caplog.set_level("INFO", logger="accordion_hvd.levels")

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, min_numel=8), policy="link-gate", interval=100, channel=channel)
        seen = [comp.stats()["gate"]["verdict"]]
        settle(comp)
        for _ in range(2):
            out, ctx = comp.compress_named("a.weight", torch.ones(3, 4))
            comp.decompress(out, ctx)
        return seen + [comp.stats()["gate"]]

    got = SimulatedWorld(2).run(worker)
    for rank in (0, 1):
        assert got[rank][0] == "pending"
        assert {k: v for k, v in got[rank][1].items() if k != "summary"} == {
            "verdict": "dense16", "dense_step_s": 1.0, "compressed_step_s": 1.0, "pays": 1.05}
    said = [r.getMessage() for r in caplog.records if "link-gate:" in r.getMessage()]
    assert said == ["after step 1: link-gate: a dense 16-bit step took 1.000 s, a compressed one 1.000 s (1.00x): "
                    "compression does not pay (at most 1.05x), every layer 16-bit dense from now on"], said


def test_other_policies_have_no_gate_in_stats():
    assert acc.AccordionCompressor(acc.PowerSGD(1, 4)).stats()["gate"] is None


def test_a_codec_class_instead_of_an_instance_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match=r"codec must be a codec instance, got the class PowerSGD itself; pass an "
                                        r"instance, e\.g\. acc\.PowerSGD\(\.\.\.\)"):
        acc.AccordionCompressor(acc.PowerSGD)


def test_once_settled_flat_buffers_go_whole_in_float16_with_error_feedback():
    """engine/whole.py on the simulated world, against the same math written out: each
    buffer's average is the mean of float16(g), g = flat + e, and e keeps what float16 rounded
    away, seeded from the layers' own error feedback (a.weight's from a dense trial);
    a step with a rank's NaN is skipped, its results zero, each finite rank's g kept in e; the
    buffers' error feedback is in the checkpoint. And add_whole's bad input."""
    layers = [("a.weight", 12), ("a.bias", 4)]

    def flats(rank):
        gen = torch.Generator().manual_seed(rank)
        out = [torch.randn(16, generator=gen) * 100 for _ in range(3)]
        if rank == 1:
            out[1][3] = float("nan")
        return out

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, min_numel=8), policy="link-gate", interval=100, channel=channel)
        engine = comp.engine
        with pytest.raises(RuntimeError, match="add_whole before the policy settled"):
            engine.add_whole("m", torch.zeros(16), layers)
        gate = engine.policy  # a dense trial (the second window where the link does not price it)
        gate.load_state_dict({**gate.state_dict(), "phase": "dense-trial"})
        out, ctx = comp.compress_named("a.weight", torch.full((3, 4), 0.1 * (rank + 1)))
        comp.decompress(out, ctx)
        seed = comp.state_dict()["layers"]["a.weight"]["residual"].clone()
        settle(comp)
        assert engine.settled_dense
        with pytest.raises(ValueError, match="buffer 'm' must be a flat float tensor"):
            engine.add_whole("m", torch.zeros(4, 4), layers)
        results = []
        for flat in flats(rank):
            avg = channel.wait(channel.allreduce_mean_async([engine.add_whole("m", flat, layers)], name="m"))[0]
            engine.finish_whole("m", flat, avg)
            engine.end_step()
            results.append((flat, comp.step_skipped))
        return seed, results, comp.state_dict()["whole"]["m"]["e"], comp.stats()["layers"]["a.bias"]

    got = SimulatedWorld(2).run(worker)
    e = [torch.cat([got[rank][0], torch.zeros(4)]) for rank in (0, 1)]
    assert e[0].abs().sum() > 0  # a.weight's rounding from the dense trial
    for step in range(3):
        g = [flats(rank)[step] + e[rank] for rank in (0, 1)]
        skipped = step == 1
        if skipped:
            expected = torch.zeros(16)
            e = [g[0], e[1]]  # rank 1's g was not finite: its e stays
        else:
            expected = ((g[0].half() + g[1].half()) / 2).float()
            e = [x - x.half().float() for x in g]
        for rank in (0, 1):
            result, was_skipped = got[rank][1][step]
            assert was_skipped == skipped
            assert torch.equal(result, expected), (step, rank)
    for rank in (0, 1):
        assert torch.equal(got[rank][2], e[rank])
    assert got[0][3]["floats_sent"] == 3 * 4 and got[0][3]["bytes_sent"] == 3 * 4 * 2  # float16 on the wire


@pytest.mark.horovod
def test_under_horovodrun_the_default_trials_decides_and_ranks_agree():
    """Also what a plain script shows by default: the gate's verdict in one line, and the hint
    about Horovod's 1 ms cycle (this job leaves $HOROVOD_CYCLE_TIME unset), each from rank 0 only."""
    out = run_worker("default_check.py", "horovod", np=2, backend="gloo")
    assert out.count("OK default (horovod)") == 2, out
    verdicts = [line for line in out.splitlines() if "accordion_hvd.levels: after step" in line and "link-gate:" in line]
    assert len(verdicts) == 1 and verdicts[0].startswith("[0]"), out
    hints = [line for line in out.splitlines() if "Call acc.quiet_horovod_cycle() before hvd.init()" in line]
    assert len(hints) == 1 and hints[0].startswith("[0]"), out


@pytest.mark.torchrun
def test_under_torchrun_the_default_trials_decides_and_ranks_agree():
    out = run_ddp_worker("default_check.py", "ddp", np=2)
    assert out.count("OK default (ddp)") == 2, out
