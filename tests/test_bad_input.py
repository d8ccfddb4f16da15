"""Bad input across the public API and the ops: every case ends in correct output or in an
exception whose message names the problem; none crashes the process or hangs, and a
compressor that refused an input computes the next steps exactly as a twin that never saw
it (no corruption). The suite prints how each case ended (see conftest.py).

A case is a function returning how it ended: "error: <Type>: <message>" or "output: <what
was checked>". ``refused`` and ``twin_check`` do the asserting.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from pathlib import Path

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd import ops, reference
from accordion_hvd.cli import train
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.policies import Accordion, GraVAC

OUTCOMES: dict[str, str] = {}  # case -> how it ended; printed by conftest.py
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def refused(exc_type, *words, action):
    """``action()`` must raise ``exc_type`` with every one of ``words`` in its message."""
    with pytest.raises(exc_type) as info:
        action()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in the message: {message}"
    return f"error: {exc_type.__name__}: {message.splitlines()[0][:110]}"


def compressor(codec=None, **kwargs):
    channel = SimulatedWorld(1).channel(0)  # one rank: collectives return at once
    return acc.AccordionCompressor(codec or acc.PowerSGD(rank=2), channel=channel, policy="static", **kwargs)


def step(comp, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sent = {n: comp.compress_named(n, g) for n, g in grads.items()}
    return {n: comp.decompress(out, ctx) for n, (out, ctx) in sent.items()}


def good_grads(seed):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=gen), "b": torch.randn(64, generator=gen)}


def twin_check(make_codec, bad) -> str:
    """Two compressors take the same good steps; only one also gets ``bad(comp)`` in between
    (which must raise). The next good step must give both the same results, bit for bit."""
    a, b = compressor(make_codec()), compressor(make_codec())
    step(a, good_grads(0)), step(b, good_grads(0))
    ended = bad(a)
    ra, rb = step(a, good_grads(1)), step(b, good_grads(1))
    for n in rb:
        assert torch.equal(ra[n], rb[n]), f"{n}: the refused input changed later results"
    assert a.stats()["layers"]["w"] == b.stats()["layers"]["w"]
    return ended


# --- constructor and API arguments ---------------------------------------------------------
@case
def powersgd_rank_zero():
    return refused(ValueError, "rank", "positive", action=lambda: acc.PowerSGD(rank=0))


@case
def powersgd_rank_fractional():
    return refused(TypeError, "rank", "int", action=lambda: acc.PowerSGD(rank=2.5))


@case
def powersgd_rank_bool():
    return refused(TypeError, "rank", action=lambda: acc.PowerSGD(rank=True))


@case
def powersgd_critical_rank_negative():
    return refused(ValueError, "critical_rank", action=lambda: acc.PowerSGD(rank=1, critical_rank=-4))


@case
def powersgd_levels_inverted():
    return refused(ValueError, "critical_rank must be >= rank", "PowerSGD(rank=1, critical_rank=4)",
                   action=lambda: acc.PowerSGD(rank=4, critical_rank=1))


@case
def topk_levels_inverted():
    return refused(ValueError, "critical_ratio must be >= ratio", "TopK(ratio=0.01, critical_ratio=0.1)",
                   action=lambda: acc.TopK(ratio=0.1, critical_ratio=0.01))


@case
def accordion_policy_with_a_one_level_codec():
    return refused(ValueError, "policy", "has one", "policy='static'",
                   action=lambda: acc.AccordionCompressor(acc.PowerSGD(rank=4), policy="accordion"))


@case
def accordion_policy_instance_with_a_one_level_codec():
    return refused(ValueError, "policy", "has one",
                   action=lambda: acc.AccordionCompressor(acc.TopK(ratio=0.1), policy=Accordion(0.5)))


@case
def powersgd_seed_string():
    return refused(TypeError, "seed", action=lambda: acc.PowerSGD(seed="0"))


@case
def powersgd_eps_zero():
    return refused(ValueError, "eps", action=lambda: acc.PowerSGD(eps=0.0))


@case
def topk_ratio_zero():
    return refused(ValueError, "ratio", "(0, 1.0]", action=lambda: acc.TopK(ratio=0))


@case
def topk_ratio_above_one():
    return refused(ValueError, "ratio", action=lambda: acc.TopK(ratio=1.5))


@case
def topk_ratio_nan():
    return refused(ValueError, "ratio", action=lambda: acc.TopK(ratio=float("nan")))


@case
def topk_critical_ratio_negative():
    return refused(ValueError, "critical_ratio", action=lambda: acc.TopK(0.01, critical_ratio=-0.1))


@case
def topk_min_compression_rate_zero():
    return refused(ValueError, "min_compression_rate", action=lambda: acc.TopK(min_compression_rate=0))


@case
def quantize_bits_unsupported():
    return refused(ValueError, "bits", "(8, 16)", action=lambda: acc.Quantize(bits=4))


@case
def quantize_bits_float():
    return refused(ValueError, "bits", "8.0", action=lambda: acc.Quantize(bits=8.0))


@case
def quantize_critical_bits_below_bits():
    return refused(ValueError, "critical_bits", action=lambda: acc.Quantize(bits=16, critical_bits=8))


@case
def quantize_chunk_zero():
    return refused(ValueError, "chunk", "positive", action=lambda: acc.Quantize(chunk=0))


@case
def quantize_rounding_unknown():
    return refused(ValueError, "rounding", "stochastic", action=lambda: acc.Quantize(rounding="floor"))


@case
def codec_lacking_the_protocol():
    class HalfACodec:  # a user's codec with only some of codecs/base.py's methods
        levels = ()

        def compressible(self, shape):
            return True
    return refused(TypeError, "HalfACodec lacks", "init_state", "codecs/base.py",
                   action=lambda: compressor(HalfACodec()))


@case
def compressor_codec_name_instead_of_codec():
    return refused(TypeError, "codec", action=lambda: acc.AccordionCompressor("powersgd"))


@case
def compressor_eta_zero():
    return refused(ValueError, "eta", action=lambda: acc.AccordionCompressor(eta=0))


@case
def compressor_interval_zero():
    return refused(ValueError, "interval", action=lambda: acc.AccordionCompressor(interval=0))


@case
def compressor_interval_fractional():
    return refused(TypeError, "interval", action=lambda: acc.AccordionCompressor(interval=2.5))


@case
def compressor_unknown_policy():
    return refused(ValueError, "policy", action=lambda: acc.AccordionCompressor(policy="aggressive"))


@case
def compressor_gravac_with_powersgd():
    return refused(ValueError, "GraVAC", "TopK", action=lambda: acc.AccordionCompressor(acc.PowerSGD(1), policy=GraVAC()))


@case
def gravac_min_factor_above_max():
    return refused(ValueError, "min_factor", action=lambda: GraVAC(min_factor=100, max_factor=10))


@case
def gravac_unknown_growth():
    return refused(ValueError, "growth", action=lambda: GraVAC(growth="linear"))


@case
def accordion_policy_eta_negative():
    return refused(ValueError, "eta", action=lambda: Accordion(eta=-1))


@case
def batch_size_plain_torch_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    return refused(TypeError, "optimizer", "DistributedOptimizer",
                   action=lambda: acc.AccordionBatchSize(opt, small=1, large=4))


@case
def report_lr_negative():
    return refused(ValueError, "lr", action=lambda: compressor().report_lr(-0.1))


@case
def report_lr_string():
    return refused(TypeError, "lr", action=lambda: compressor().report_lr("0.1"))


@case
def set_level_unknown_layer():
    return twin_check(lambda: acc.PowerSGD(1, critical_rank=4),
                      lambda c: refused(KeyError, "nope", action=lambda: c.set_level("nope", acc.levels.CRITICAL)))


@case
def set_level_unknown_level():
    return twin_check(lambda: acc.PowerSGD(1, critical_rank=4),
                      lambda c: refused(TypeError, "level must be an accordion_hvd.levels.Level", action=lambda: c.set_level("w", "extreme")))


def cli_refused(argv, *words) -> str:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    message = stderr.getvalue().strip().splitlines()[-1]
    assert info.value.code == 2 and all(w in message for w in words), message
    return f"error: SystemExit(2): {message[:110]}"


@case
def cli_ratio_above_one():
    return cli_refused(["--codec", "topk", "--ratio", "2"], "ratio")


@case
def cli_malformed_fault_injection():
    return cli_refused(["--inject-nonfinite", "ten"], "--inject-nonfinite", "STEP@RANK")


@case
def cli_zero_epochs():
    return cli_refused(["--epochs", "0"], "--epochs")


@case
def cli_negative_sample_limit():
    return cli_refused(["--max-train-samples", "-5"], "--max-train-samples", "at least 0")


@case
def cli_reduce_dtype_without_fsdp():
    return cli_refused(["--codec", "powersgd", "--reduce-dtype", "bfloat16"], "--reduce-dtype", "--launcher fsdp")


@case
def cli_keep_checkpoints_without_checkpoint():
    return cli_refused(["--keep-checkpoints"], "--keep-checkpoints", "--checkpoint PATH")


@case
def cli_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    return cli_refused(["--device", "cuda"], "--device cuda", "no GPU")


# --- gradients the compressor is given -----------------------------------------------------
def passes_through(make_tensor, codec=None) -> str:
    comp = compressor(codec)
    grad = make_tensor()
    expected = grad.clone()
    out = step(comp, {"g": grad})["g"]
    assert out is grad and torch.equal(out.to_dense() if out.is_sparse else out,
                                       expected.to_dense() if expected.is_sparse else expected)
    assert comp.stats()["layers"]["g"]["level"] == "dense"
    return f"output: passed through uncompressed, unchanged ({tuple(grad.shape)}, {grad.dtype}, {grad.layout})"


@case
def gradient_empty():
    return passes_through(lambda: torch.zeros(0, 5))


@case
def gradient_zero_dimensional():
    return passes_through(lambda: torch.tensor(3.0))


@case
def gradient_one_dimensional():
    return passes_through(lambda: torch.randn(4096))


@case
def gradient_integer():
    return passes_through(lambda: torch.arange(64 * 48).reshape(64, 48))


@case
def gradient_complex():
    return passes_through(lambda: torch.randn(64, 48, dtype=torch.complex64))


@case
def gradient_sparse():
    return passes_through(lambda: torch.randn(64, 48).relu().to_sparse())


def same_as_contiguous(make_layout, codec_factory) -> list[str]:
    base = torch.randn(16, 8, 5, 5, generator=torch.Generator().manual_seed(3))
    plain = step(compressor(codec_factory()), {"w": base.clone()})["w"]
    other = step(compressor(codec_factory()), {"w": make_layout(base.clone())})["w"]
    torch.testing.assert_close(other.contiguous(), plain, rtol=1e-6, atol=1e-6)


@case
def gradient_non_contiguous():
    for codec in (lambda: acc.PowerSGD(2), lambda: acc.TopK(0.05)):
        same_as_contiguous(lambda t: t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3), codec)
    return "output: equal to the contiguous gradient's result (PowerSGD, TopK)"


@case
def gradient_channels_last():
    for codec in (lambda: acc.PowerSGD(2), lambda: acc.TopK(0.05)):
        same_as_contiguous(lambda t: t.to(memory_format=torch.channels_last), codec)
    return "output: equal to the contiguous gradient's result (PowerSGD, TopK)"


@case
def gradient_twelve_dimensional():
    grad = torch.randn(*([2] * 12), generator=torch.Generator().manual_seed(4))
    out = step(compressor(acc.TopK(0.05)), {"g": grad.clone()})["g"]
    flat = step(compressor(acc.TopK(0.05)), {"g": grad.reshape(2, -1).clone()})["g"]
    assert out.shape == grad.shape and torch.equal(out.reshape(-1), flat.reshape(-1))
    return "output: TopK result equal to the same gradient as a matrix"


@case
def gradient_not_a_tensor():
    return refused(TypeError, "torch.Tensor", action=lambda: compressor().compress_named("w", [1.0, 2.0]))


@case
def gradient_on_meta_device():
    return refused(ValueError, "device", action=lambda: compressor().compress_named("w", torch.empty(64, 48, device="meta")))


@case
def gradient_changes_shape():
    return twin_check(lambda: acc.PowerSGD(2), lambda c: refused(
        ValueError, "'w'", "changed shape", action=lambda: c.compress_named("w", torch.randn(48, 64))))


@case
def gradient_changes_dtype():
    return twin_check(lambda: acc.TopK(0.05), lambda c: refused(
        ValueError, "'w'", "dtype", action=lambda: c.compress_named("w", torch.randn(64, 48, dtype=torch.float64))))


@case
def gradient_compressed_twice_in_a_step():
    """The refused second compress must not disturb the step it happened in, nor later ones."""
    a, b = compressor(acc.PowerSGD(2)), compressor(acc.PowerSGD(2))
    step(a, good_grads(0)), step(b, good_grads(0))
    grads = good_grads(1)
    sent = {n: a.compress_named(n, g.clone()) for n, g in grads.items()}
    ended = refused(RuntimeError, "'w'", "twice", action=lambda: a.compress_named("w", torch.randn(64, 48)))
    ra = {n: a.decompress(out, ctx) for n, (out, ctx) in sent.items()}
    rb = step(b, grads)
    ra2, rb2 = step(a, good_grads(2)), step(b, good_grads(2))
    assert all(torch.equal(ra[n], rb[n]) and torch.equal(ra2[n], rb2[n]) for n in grads)
    return ended


@case
def decompress_without_compress():
    return twin_check(lambda: acc.TopK(0.05), lambda c: refused(
        RuntimeError, "'w'", action=lambda: c.decompress(torch.zeros(0), ("topk", "w"))))


def non_finite(value) -> str:
    comp = compressor(acc.TopK(0.05))
    step(comp, good_grads(0))
    grads = good_grads(1)
    grads["w"][3, 4] = value
    out = step(comp, grads)
    assert comp.step_skipped and all(torch.count_nonzero(t) == 0 for t in out.values())
    assert torch.isfinite(comp.engine.layers["w"].residual).all()
    after = step(comp, good_grads(2))
    assert not comp.step_skipped and all(torch.isfinite(t).all() for t in after.values())
    return "output: step skipped (zero gradients), error feedback finite, next step normal"


@case
def gradient_with_nan():
    return non_finite(float("nan"))


@case
def gradient_with_inf():
    return non_finite(float("inf"))


@case
def powersgd_rank_larger_than_both_sides():
    comp = compressor(acc.PowerSGD(rank=100))
    grad = torch.randn(64, 48)
    out = step(comp, {"w": grad.clone()})["w"]
    assert torch.equal(out, grad)  # r = min(100, 64, 48) gains nothing: the dense path
    return "output: rank clamped to min(n, m); the layer goes dense (no gain), unchanged"


# --- the ops -------------------------------------------------------------------------------
def topk_pair(n=1000, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


@case
def topk_ef_k_zero():
    g, e = topk_pair()
    expected = g + e
    values, indices, _, kept_sq = ops.topk_ef(g, e, 0)
    assert values.numel() == indices.numel() == 0 and kept_sq.item() == 0 and torch.equal(e, expected)
    return "output: nothing selected, the residual holds all of g"


@case
def topk_ef_k_equals_n():
    g, e = topk_pair()
    rv, ri, rres, _, _ = reference.topk_select(g.clone(), e.clone(), g.numel())
    values, indices, _, _ = ops.topk_ef(g, e, g.numel())
    assert torch.equal(indices, ri) and torch.equal(values, rv) and torch.count_nonzero(e) == 0
    return "output: everything selected (equal to the reference), the residual zero"


@case
def topk_ef_k_above_n():
    g, e = topk_pair()
    return refused(RuntimeError, "k must be in [0, numel = 1000]", action=lambda: ops.topk_ef(g, e, 1001))


@case
def topk_ef_nan_and_inf_in_residual():
    g, e = topk_pair()
    e[5], e[9] = float("nan"), float("inf")
    rv, ri, rres, _, _ = reference.topk_select(g.clone(), e.clone(), 10)
    values, indices, g_sq, _ = ops.topk_ef(g, e, 10)
    assert torch.equal(indices, ri) and math.isnan(g_sq.item())
    return "output: selection equal to the reference (NaN ranks highest), g_sq NaN tells the caller"


@case
def topk_ef_integer_residual():
    g, e = topk_pair()
    return refused(RuntimeError, "residual", "dtype", action=lambda: ops.topk_ef(g, e.int(), 5))


@case
def topk_ef_shape_mismatch():
    g, e = topk_pair()
    return refused(RuntimeError, "same shape", action=lambda: ops.topk_ef(g, e[:10], 5))


@case
def topk_ef_sparse_grad():
    g, e = topk_pair()
    return refused(ValueError, "grad", "strided", action=lambda: ops.topk_ef(g.to_sparse(), e, 5))


@case
def topk_ef_mixed_devices():
    g, e = topk_pair()
    return refused(ValueError, "same device", action=lambda: ops.topk_ef(g, e.to("meta"), 5))


@case
def sparse_average_index_out_of_range():
    return refused(RuntimeError, "indices[2] = 100", "outside", action=lambda: ops.sparse_average(
        torch.ones(3), torch.tensor([0, 5, 100], dtype=torch.int32), 10, 1, torch.float32))


@case
def sparse_average_negative_index():
    return refused(RuntimeError, "indices[1] = -1", action=lambda: ops.sparse_average(
        torch.ones(3), torch.tensor([0, -1, 2], dtype=torch.int32), 10, 1, torch.float32))


@case
def orthogonalize_more_columns_than_rows():
    p = torch.randn(3, 5, generator=torch.Generator().manual_seed(6))
    ops.orthogonalize_([p], 1e-8)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p[:, :3].t() @ p[:, :3], torch.eye(3), atol=1e-5, rtol=0)
    return "output: finite; the first min(n, r) columns orthonormal"


@case
def orthogonalize_zero_matrix():
    p = torch.zeros(4, 2)
    ops.orthogonalize_([p], 1e-8)
    assert torch.equal(p, torch.zeros(4, 2))
    return "output: zero columns stay zero (eps), no NaN"


# --- checkpoints ---------------------------------------------------------------------------
def trained(codec):
    comp = compressor(codec)
    step(comp, good_grads(0))
    return comp


@case
def load_state_dict_other_configuration():
    state = trained(acc.PowerSGD(rank=2)).state_dict()
    return twin_check(lambda: acc.PowerSGD(rank=2), lambda c: refused(
        ValueError, "different settings", "rank", action=lambda: compressor(acc.PowerSGD(rank=4)).load_state_dict(state)))


@case
def load_state_dict_not_a_state_dict():
    return twin_check(lambda: acc.PowerSGD(rank=2), lambda c: refused(
        ValueError, "not an AccordionCompressor state_dict", action=lambda: c.load_state_dict({"weights": 1})))


@case
def load_state_dict_missing_entries():
    def bad(c):
        state = trained(acc.PowerSGD(rank=2)).state_dict()
        del state["controller"]
        return refused(ValueError, "malformed", "controller", action=lambda: c.load_state_dict(state))
    return twin_check(lambda: acc.PowerSGD(rank=2), bad)


@case
def load_state_dict_wrong_residual_shape():
    def bad(c):
        state = trained(acc.TopK(0.05)).state_dict()
        state["layers"]["w"]["residual"] = torch.zeros(7)
        return refused(ValueError, "malformed", "'w'", action=lambda: c.load_state_dict(state))
    return twin_check(lambda: acc.TopK(0.05), bad)


@case
def load_state_dict_nan_residual():
    def bad(c):
        state = trained(acc.TopK(0.05)).state_dict()
        state["layers"]["w"]["residual"][0] = float("nan")
        return refused(ValueError, "not finite", "'w'", action=lambda: c.load_state_dict(state))
    return twin_check(lambda: acc.TopK(0.05), bad)


@case
def load_state_dict_unknown_codec():
    def bad(c):
        state = trained(acc.Quantize(8)).state_dict()
        state["config"]["codec"] = "fp4-magic"
        return refused(ValueError, "codec", "'fp4-magic'", action=lambda: c.load_state_dict(state))
    return twin_check(lambda: acc.Quantize(8), bad)


@case
def quantize_gradient_with_nan():
    comp = compressor(acc.Quantize(8))
    step(comp, {"w": torch.randn(64, 48)})
    grad = torch.randn(64, 48)
    grad[5, 7] = float("nan")
    out = step(comp, {"w": grad})
    assert comp.step_skipped and torch.count_nonzero(out["w"]) == 0
    assert torch.isfinite(comp.engine.layers["w"].residual).all()
    after = step(comp, {"w": torch.randn(64, 48)})
    assert not comp.step_skipped and torch.isfinite(after["w"]).all()
    return "output: step skipped (zero gradients), error feedback finite, next step normal"


@case
def resume_from_a_truncated_checkpoint():
    """What --resume does with a damaged file (the CLI under horovodrun: test_reliability_horovod.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.rank0"
        torch.save({"compression": trained(acc.PowerSGD(rank=2)).state_dict()}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        with pytest.raises(SystemExit) as info:
            train.read_checkpoint(Path(tmp) / "ckpt", path)
        assert "cannot read" in str(info.value) and str(path) in str(info.value), info.value
        return f"error: SystemExit: {str(info.value)[:110]}"


@case
def resume_from_another_programs_file():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.rank0"
        torch.save([1, 2, 3], path)
        with pytest.raises(SystemExit) as info:
            train.read_checkpoint(Path(tmp) / "ckpt", path)
        assert "not a checkpoint written by --checkpoint" in str(info.value), info.value
        return f"error: SystemExit: {str(info.value)[:110]}"


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name):
    OUTCOMES[name] = CASES[name]()


def test_the_suite_covers_at_least_30_cases():
    assert len(CASES) >= 30, len(CASES)
