"""The CUDA kernels of every accordion:: op against the CPU kernels and the plain-torch
reference: TopK's selection, residual and values bit for bit (the CPU kernel defines the
same function), the decode bit for bit, PowerSGD's Gram-Schmidt within float tolerance.

Run with ``pytest -m cuda``; skipped, with the reason, without a GPU or without a build
that has the CUDA kernels.
"""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
    pytest.mark.skipif(not acc.with_cuda, reason="accordion_hvd was built without CUDA kernels"),
]

GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(n, grad_dtype, kind="normal", seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        grad = torch.randn(n, generator=gen)
        residual = 0.1 * torch.randn(n, generator=gen)
    elif kind == "ties":  # few distinct magnitudes: the threshold falls inside a run of ties
        grad = torch.randint(-3, 4, (n,), generator=gen).float()
        residual = torch.zeros(n)
    elif kind == "sparse":  # mostly exact zeros, as an embedding's gradient
        grad = torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.01)
        residual = torch.zeros(n)
    elif kind == "constant":
        grad = torch.full((n,), 0.5)
        residual = torch.zeros(n)
    else:
        raise ValueError(kind)
    return grad.to(grad_dtype), residual


def run_both(grad, residual, k):
    """The op on CPU and on CUDA from the same inputs; returns both results (on the CPU)."""
    r_cpu, r_gpu = residual.clone(), residual.cuda()
    cpu = acc.ops.topk_ef(grad, r_cpu, k)
    gpu = acc.ops.topk_ef(grad.cuda(), r_gpu, k)
    return (*cpu, r_cpu), tuple(t.cpu() for t in (*gpu, r_gpu))


def assert_same_topk(cpu, gpu):
    (v0, i0, g0, k0, r0), (v1, i1, g1, k1, r1) = cpu, gpu
    assert torch.equal(i0, i1), "selection sets differ"
    assert torch.equal(v0, v1)
    assert torch.equal(r0, r1)
    # The norms: in double on the GPU, so exact to ~1e-12 against float64 sums of the outputs
    # (g is the new residual plus the kept values); the CPU kernel sums in float per chunk.
    kept = v1.double().square().sum()
    torch.testing.assert_close(k1, kept, rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(g1, r1.double().square().sum() + kept, rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=0)
    torch.testing.assert_close(k1, k0, rtol=1e-6, atol=0)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097, 65_537, 1_000_003])
def test_topk_matches_cpu_bit_for_bit(n, grad_dtype):
    grad, residual = make(n, grad_dtype, seed=n)
    for k in sorted({0, 1, max(1, n // 1000), max(1, n // 100), n // 10, n // 4, n // 2, n - 1, n}):
        if 0 <= k <= n:
            assert_same_topk(*run_both(grad, residual, k))


@pytest.mark.parametrize("kind", ["ties", "sparse", "constant"])
@pytest.mark.parametrize("n", [5, 4099, 300_007])
def test_topk_ties_go_to_the_lower_index(kind, n):
    grad, residual = make(n, torch.float32, kind, seed=3)
    for k in sorted({1, n // 7, n // 3, n // 2, n - 1}):
        cpu, gpu = run_both(grad, residual, k)
        assert_same_topk(cpu, gpu)
        ref = reference.topk_select(grad, residual, k)
        assert torch.equal(gpu[1], ref[1])


def test_topk_matches_reference_large():
    grad, residual = make(10_000_000, torch.float32, seed=11)
    k = 100_000
    values, indices, g_sq, kept_sq = acc.ops.topk_ef(grad.cuda(), r := residual.cuda(), k)
    ref_values, ref_indices, ref_residual, ref_g_sq, ref_kept_sq = reference.topk_select(grad, residual, k)
    assert torch.equal(indices.cpu(), ref_indices)
    assert torch.equal(values.cpu(), ref_values)
    assert torch.equal(r.cpu(), ref_residual)
    torch.testing.assert_close(g_sq.cpu(), ref_g_sq, rtol=1e-10, atol=0)
    torch.testing.assert_close(kept_sq.cpu(), ref_kept_sq, rtol=1e-10, atol=0)


def test_topk_misaligned_inputs_take_the_scalar_path():
    n = 100_003
    grad_buf, residual_buf = make(n + 1, torch.float16, seed=5)
    grad, residual = grad_buf[1:], residual_buf[1:]  # contiguous, but not 16-byte aligned
    assert_same_topk(*run_both(grad, residual, 1234))


def test_topk_nonfinite_entries_rank_as_the_cpu_kernel_ranks_them():
    grad, residual = make(50_000, torch.float32, seed=6)
    grad[[10, 20_000]] = float("nan")
    grad[30_000] = float("inf")
    cpu, gpu = run_both(grad, residual, 500)
    assert torch.equal(cpu[1], gpu[1])
    torch.testing.assert_close(gpu[0], cpu[0], rtol=0, atol=0, equal_nan=True)


def test_topk_repeated_calls_are_deterministic():
    grad, residual = make(2_000_003, torch.float32, seed=7)
    first = acc.ops.topk_ef(grad.cuda(), residual.cuda(), 20_000)
    for _ in range(3):
        again = acc.ops.topk_ef(grad.cuda(), residual.cuda(), 20_000)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("out_dtype", GRAD_DTYPES + [torch.float64])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_sparse_average_matches_cpu_bit_for_bit(world, out_dtype):
    n, k = 100_003, 2_000
    gen = torch.Generator().manual_seed(world)
    values = torch.randn(world * k, generator=gen)
    # Overlapping index sets across ranks, distinct within one.
    indices = torch.cat([torch.randperm(n // 10, generator=gen)[:k] for _ in range(world)]).to(torch.int32)
    cpu = acc.ops.sparse_average(values, indices, n, world, out_dtype)
    gpu = acc.ops.sparse_average(values.cuda(), indices.cuda(), n, world, out_dtype)
    assert gpu.dtype == out_dtype
    assert torch.equal(cpu, gpu.cpu())


def test_sparse_average_bad_index_is_an_error_and_writes_nothing_outside():
    values = torch.ones(4, device="cuda")
    indices = torch.tensor([0, 1, 7, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"indices\[2\] = 7 is outside \[0, numel = 5\)"):
        acc.ops.sparse_average(values, indices, 5, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonalize_matches_reference(dtype):
    gen = torch.Generator().manual_seed(8)
    shapes = [(1, 1), (3, 2), (64, 1), (576, 4), (4608, 8), (3072, 12), (30_522, 8), (2, 2)]
    ps = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    ps[1][:, 0] = 0  # a zero column stays finite
    expected = [reference.orthogonalize_(p.clone()) for p in ps]
    got = acc.ops.orthogonalize_([p.cuda() for p in ps])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for g, e in zip(got, expected):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.cpu(), e, rtol=tol, atol=tol)


def test_orthogonalize_many_matrices_in_several_launches():
    ps = [torch.randn(50 + i, 1 + i % 8, device="cuda") for i in range(450)]
    expected = [reference.orthogonalize_(p.clone()) for p in ps]
    acc.ops.orthogonalize_(ps)
    for g, e in zip(ps, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_opcheck_on_cuda():
    grad, residual = make(4097, torch.float16)
    opcheck(torch.ops.accordion.topk_ef.default, (grad.cuda(), residual.cuda(), 100))
    values, indices = torch.randn(30, device="cuda"), torch.randperm(100, device="cuda")[:30].to(torch.int32)
    opcheck(torch.ops.accordion.sparse_average.default, (values, indices, 100, 3, torch.float16))
    opcheck(torch.ops.accordion.orthogonalize_.default, ([torch.randn(20, 3, device="cuda")], 1e-8))


@pytest.mark.parametrize("codec_name", ["topk", "powersgd"])
def test_codec_step_on_cuda_matches_cpu(codec_name):
    """One encode/decode of each codec on the GPU gives what it gives on the CPU."""
    torch.manual_seed(9)
    grad = torch.randn(256, 300)
    results = {}
    for device in ("cpu", "cuda"):
        g = grad.to(device)
        if codec_name == "topk":
            codec = acc.TopK(0.05)
            state = codec.init_state("w", g)
            values, indices = codec.encode(state, g)
            out = codec.decode(state, values, indices, 1, g.dtype)
        else:
            codec = acc.PowerSGD(rank=4)
            state = codec.init_state("w", g)
            p = codec.start(state, g.clone())
            (qt,) = codec.middle([state], [p])
            out = codec.finish(state, qt, g.clone())
            codec.settle(state)
        results[device] = (out.cpu(), state.residual.cpu())
    tol = 0 if codec_name == "topk" else 1e-4
    for a, b in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
