"""The 8-bit quantization codec (accordion_hvd/codecs/quantize.py) and its exchange: the math
against the plain-torch reference (reference.quantize_ef), the exchange's mean on simulated
worlds of 2 and 3 ranks, levels switched 8 <-> 16 bits, non-finite gradients, checkpoints,
bad input, and the claim that it was added without the engine knowing it. Under real
horovodrun and torchrun it runs against the NumPy reference in test_numpy_reference.py and
test_ddp_hook.py (modes quantize, quantize-switch)."""

import math
import re
from pathlib import Path

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.levels import CRITICAL, DENSE16, NORMAL

TRUE = torch.tensor(True)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("numel,chunk", [(1000, 64), (4096, 512), (513, 512), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_step_is_the_reference(bits, numel, chunk, dtype):
    torch.manual_seed(numel + bits)
    codec = acc.Quantize(bits, chunk=chunk, min_numel=1)
    grad = (torch.randn(numel) * 3).to(dtype)
    state = codec.init_state("w", grad)
    state.residual.copy_(torch.randn(numel) * 0.05)
    q, scales, residual = reference.quantize_ef(grad, state.residual.clone(), bits, chunk)
    payload = codec.encode(state, grad, TRUE)
    assert torch.equal(state.sent[0], q) and torch.equal(state.sent[1], scales)
    assert payload.numel() == codec.payload_bytes(numel, bits) and payload.dtype == torch.uint8
    mean = codec.decode(state, torch.stack([payload, payload]), dtype)
    assert torch.equal(mean.float(), reference.quantized_average([(q, scales), (q, scales)], chunk).to(dtype).float())
    codec.settle(state, TRUE)
    assert torch.equal(state.residual, residual)
    # the error is at most half a step of each chunk's scale
    step = scales.repeat_interleave(chunk)[:numel]
    assert bool((state.residual.abs() <= step / 2 + 1e-6).all())


def test_a_chunk_of_zeros_sends_zeros_and_keeps_nothing_back():
    codec = acc.Quantize(8, chunk=4, min_numel=1)
    grad = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0])
    state = codec.init_state("w", grad)
    codec.encode(state, grad, TRUE)
    q, scales = state.sent
    assert scales[0] == 0 and bool((q[:4] == 0).all()) and scales[1] == pytest.approx(2 / 127)
    codec.settle(state, TRUE)
    assert bool((state.residual[:4] == 0).all())


def test_a_skipped_step_keeps_all_of_g_in_the_error_feedback():
    codec = acc.Quantize(8, min_numel=1)
    grad = torch.randn(2000)
    state = codec.init_state("w", grad)
    codec.encode(state, grad, TRUE)
    codec.settle(state, torch.tensor(False))
    assert torch.equal(state.residual, grad)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    grad = torch.full((4096,), 0.3)
    grad[0] = 1.0  # scale 1/127: 0.3 sits between two levels
    means = []
    for _ in range(2):
        codec = acc.Quantize(8, rounding="stochastic", chunk=4096, min_numel=1, seed=3)
        state = codec.init_state("w", grad)
        codec.encode(state, grad, TRUE)
        q, scales = state.sent
        means.append(float((q[1:].float() * scales[0]).mean()))
    assert means[0] == means[1]  # seeded per layer
    assert means[0] == pytest.approx(0.3, abs=2e-4)  # nearest would give round(38.1) / 127 = 0.2992
    nearest = acc.Quantize(8, chunk=4096, min_numel=1)
    state = nearest.init_state("w", grad)
    nearest.encode(state, grad, TRUE)
    assert float(state.sent[0][1]) * float(state.sent[1][0]) == pytest.approx(38 / 127)


def test_bad_arguments_are_named():
    for kwargs, message in [({"bits": 4}, "bits must be one of"), ({"bits": 32}, "bits must be one of"),
                            ({"bits": 16, "critical_bits": 8}, "critical_bits must be >= bits"),
                            ({"critical_bits": 12}, "critical_bits must be one of"),
                            ({"rounding": "up"}, "rounding must be one of"), ({"chunk": 0}, "chunk"),
                            ({"min_numel": -1}, "min_numel")]:
        with pytest.raises((TypeError, ValueError), match=message):
            acc.Quantize(**kwargs)


SHAPES = {"a.weight": (64, 48), "b.weight": (96, 40), "b.bias": (96,)}


def grads_of(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=gen) * (1 + rank) for n, s in SHAPES.items()}


class EveryOther(acc.policies.Policy):
    """Levels 8, 16, 8, ... bits: the critical level in every second window."""
    name, uses_norms, reacts_to_lr = "every-other", False, False

    def __init__(self):
        self.windows = 0

    def initial_level(self, layer):
        return NORMAL

    def end_window(self, report):
        self.windows += 1
        return {layer: CRITICAL if self.windows % 2 else NORMAL for layer in report.norms}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_mean_of_the_dequantized_payloads_with_levels_switched(world):
    chunk = 128

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, 16, chunk=chunk), policy=EveryOther(), interval=1,
                                       channel=channel)
        out = []
        for step in range(4):
            g = grads_of(rank, step)
            sent = {n: comp.compress_named(n, g[n]) for n in sorted(g)}
            got = {n: comp.decompress(channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0],
                                      sent[n][1]) for n in sorted(sent)}
            out.append((got, {n: str(s["level"]) for n, s in comp.stats()["layers"].items()}))
        return out, comp.stats()

    results = SimulatedWorld(world).run(worker)
    residuals = {(r, n): torch.zeros(math.prod(s)) for r in range(world) for n, s in SHAPES.items()}
    for step in range(4):
        bits = 8 if step % 2 == 0 else 16  # the window of step s (interval 1) decided the level of s + 1
        for n in ("a.weight", "b.weight"):
            payloads = []
            for r in range(world):
                q, scales, residuals[r, n] = reference.quantize_ef(grads_of(r, step)[n], residuals[r, n], bits, chunk)
                payloads.append((q, scales))
            want = reference.quantized_average(payloads, chunk).view(SHAPES[n])
            for r in range(world):
                assert torch.equal(results[r][0][step][0][n], want), (step, n, r)
        # stats after step s give the level the window just chose, that of step s + 1
        assert results[0][0][step][1]["a.weight"] == ("critical" if bits == 8 else "normal")
    stats = results[0][1]
    # floats sent: the payload's bytes over 4, per step (8 and 16 bits alternating)
    a = acc.Quantize(8, 16, chunk=chunk)
    per = {b: -(-a.payload_bytes(64 * 48, b) // 4) for b in (8, 16)}
    assert stats["layers"]["a.weight"]["floats_sent"] == 2 * per[8] + 2 * per[16]
    assert stats["layers"]["b.bias"]["floats_sent"] == 4 * 96  # small: dense
    # bytes on the wire: the payloads themselves (scales and integers), exactly
    assert stats["layers"]["a.weight"]["bytes_sent"] == 2 * a.payload_bytes(64 * 48, 8) + 2 * a.payload_bytes(64 * 48, 16)
    assert stats["layers"]["a.weight"]["bytes_dense"] == 4 * 4 * 64 * 48


@pytest.mark.parametrize("skip_energy", [0.0, 0.1], ids=["every-chunk", "sparse-chunks"])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere_and_loses_nothing(skip_energy):
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, skip_energy=skip_energy), policy="static", channel=channel)
        g = torch.randn(64, 48, generator=torch.Generator().manual_seed(rank))
        if rank == 1:
            g[3, 3] = math.nan
        out, ctx = comp.compress_named("w", g)
        got = comp.decompress(channel.wait(channel.allreduce_mean_async([out], "hvd.w"))[0], ctx)
        return got, comp.skipped_steps, comp.engine.layers["w"].residual.clone(), g

    results = SimulatedWorld(2).run(worker)
    for rank, (got, skipped, residual, g) in enumerate(results):
        assert skipped == 1 and torch.equal(got, torch.zeros_like(got))
        # the finite rank keeps all of g; the other never folded its gradient in
        assert torch.equal(residual, g.reshape(-1) if rank == 0 else torch.zeros_like(residual))


def test_dense16_through_the_front_end_and_a_checkpoint_round_trip():
    codec = acc.Quantize(8, 16, min_numel=1)
    grad = torch.randn(3000)
    state = codec.init_state("w", grad)
    codec.set_level(state, DENSE16)
    assert codec.sends_dense(state) and codec.floats_sent(state) == 3000
    out = codec.flush_dense(state, grad, TRUE)
    assert out.dtype == torch.float16
    codec.settle_dense(state, torch.float16, TRUE)
    assert torch.equal(state.residual, grad - grad.half().float())
    again = codec.state_from_dict("w", codec.state_to_dict(state))
    assert again.level == DENSE16 and torch.equal(again.residual, state.residual)
    with pytest.raises(ValueError, match="does not fit"):
        codec.state_from_dict("w", {**codec.state_to_dict(state), "residual": torch.zeros(5)})


def test_stochastic_rounding_resumes_bit_for_bit_from_a_checkpoint():
    """The rounding generator is part of a layer's state: a compressor loaded from a state
    taken after step 3 rounds steps 4-6 exactly as the one that never stopped."""
    grads = [[torch.randn(64, 48, generator=torch.Generator().manual_seed(10 * s + r)) for r in range(2)]
             for s in range(6)]

    def make(channel):
        return acc.AccordionCompressor(acc.Quantize(8, rounding="stochastic", chunk=256, seed=5),
                                       policy="static", channel=channel)

    def steps(comp, channel, rank, which):
        out = []
        for s in which:
            sent, ctx = comp.compress_named("w", grads[s][rank].clone())
            out.append(comp.decompress(sent, ctx))
        return out

    def worker(rank, channel):
        comp = make(channel)
        steps(comp, channel, rank, range(3))
        saved = comp.state_dict()
        assert "generator" in saved["layers"]["w"]
        straight = steps(comp, channel, rank, range(3, 6))
        resumed_comp = make(channel)
        resumed_comp.load_state_dict(saved)
        resumed = steps(resumed_comp, channel, rank, range(3, 6))
        return straight, resumed, comp.engine.layers["w"].residual, resumed_comp.engine.layers["w"].residual

    for straight, resumed, e_straight, e_resumed in SimulatedWorld(2).run(worker):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed)) and torch.equal(e_straight, e_resumed)
    fresh = acc.Quantize(8, rounding="stochastic", seed=5)
    state = fresh.init_state("w", torch.zeros(4096))
    with pytest.raises(ValueError, match="generator state"):
        fresh.state_from_dict("w", {**fresh.state_to_dict(state), "generator": [1, 2]})


def test_level_errors_are_the_quantization_errors():
    codec = acc.Quantize(8, 16, chunk=256, min_numel=1)
    grad = torch.randn(2048)
    state = codec.init_state("w", grad)
    errors = codec.level_errors(state, grad, (NORMAL, CRITICAL))
    for bits, got in zip((8, 16), errors):
        _, _, e = reference.quantize_ef(grad, torch.zeros(2048), bits, 256)
        assert got == pytest.approx(float(e.double().square().sum()), rel=1e-6)
    assert errors[1] < errors[0] / 1000


def test_the_engine_and_the_front_ends_never_mention_the_quantization_codec():
    """Added without editing the engine: only the codec, its exchange and the package's
    exports name it."""
    package = Path(acc.__file__).parent
    engine = [*(str(p.relative_to(package)) for p in sorted((package / "engine").glob("*.py"))),
              *(str(p.relative_to(package)) for p in sorted((package / "horovod").glob("*.py"))),
              "controller.py", "network_probe.py", "ddp.py", "elastic.py", "counters.py",
              "batch_size.py", "step_faults.py", "checkpoint.py", "exchange/registry.py", "exchange/buckets.py",
              "exchange/base.py", "buffered_step.py", "binding.py", "hsdp.py",
              # the periodic wing but 1-bit Adam (whose warm-up is 8-bit sparse chunks, by design)
              *(str(p.relative_to(package)) for p in sorted((package / "periodic").glob("*.py"))
                if p.name != "onebit_adam.py")]
    assert "engine/engine.py" in engine and "horovod/compressor.py" in engine
    for name in engine:
        assert not re.search(r"quantiz", (package / name).read_text(), re.I), name
