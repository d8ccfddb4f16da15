"""Quantize's sparse-chunk CPU kernels (csrc/cpu/quantize_chunks.cpp: accordion::quantize_chunks_ef_,
quantize_chunks_average, quantize_chunks_settle_) against the plain-torch reference
(reference.quantize_chunks_ef, quantized_chunks_average) and the codec's torch-op path, bit for
bit: both widths, chunks that divide the layer and that do not (and that are not a power of
two), 16-bit gradients, near-ties of energy, a non-finite gradient, payloads from several ranks
and sliced from a wider bucket; opcheck; bad arguments named, and payloads that are not
sparse-chunk payloads refused before anything is written."""

from types import SimpleNamespace

import pytest
import torch
from torch.library import opcheck

from accordion_hvd import ops, reference
from accordion_hvd.codecs import quantize_chunks as sparse
from accordion_hvd.codecs.quantize import quantize_flat

TRUE = torch.tensor(True)


def skewed(numel, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen)
    g[torch.randperm(numel, generator=gen)[:numel // 5]] *= 20
    return g.to(dtype)


def torch_path(grad, residual, bits, chunk, k, skip, finite=TRUE):
    """The codec's torch-op path (quantize_chunks.encode, unfused)."""
    state = SimpleNamespace(residual=residual, bits=bits, k=k, k_pending=None, sent=None, nbytes=None)
    return sparse.encode(state, grad, finite, chunk=chunk, skip=skip, fused=False, quantize=quantize_flat,
                         generator=None)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("numel,chunk", [(1000, 64), (4096, 512), (513, 128), (700, 100), (5, 512), (9000, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip", [0.0, 0.05, 0.5])
def test_encode_and_settle_are_the_reference_bit_for_bit(bits, numel, chunk, dtype, skip):
    chunks = -(-numel // chunk)
    residual = torch.zeros(numel)
    k = chunks
    for step in range(3):
        grad = skewed(numel, 10 * numel + step, dtype)
        want_i, want_q, want_s, want_next, want_e = reference.quantize_chunks_ef(grad, residual, bits, chunk, k, skip)
        e = residual.clone()
        payload = ops.quantize_chunks_ef_(grad, e, bits, chunk, k, skip, TRUE)
        assert torch.equal(payload, torch_path(grad, residual.clone(), bits, chunk, k, skip))
        assert payload.numel() == sparse.payload_bytes(k, chunk, bits)
        k_next, indices, scales, q = sparse.unpack(payload, k, chunk, bits)
        assert int(k_next) == want_next and torch.equal(indices, want_i)
        assert torch.equal(scales, want_s) and torch.equal(q, want_q)
        assert not payload[4 + 8 * k + k * chunk * bits // 8:].any()  # the padding is zero
        assert torch.equal(e, residual + grad.float())  # g, kept until the step settles
        ops.quantize_chunks_settle_(e, indices, q, scales, chunk, TRUE)
        assert torch.equal(e, want_e)
        residual, k = want_e, max(1, min(want_next, chunks))


def test_near_ties_pick_the_chunks_the_reference_picks():
    # every chunk a permutation of the same values: energies equal up to the order of the sum
    chunk, chunks = 96, 40
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(chunk, generator=gen)
    g = torch.cat([base[torch.randperm(chunk, generator=gen)] for _ in range(chunks)])
    want_i, *_ = reference.quantize_chunks_ef(g, torch.zeros_like(g), 8, chunk, 7, 0.5)
    payload = ops.quantize_chunks_ef_(g, torch.zeros_like(g), 8, chunk, 7, 0.5)
    assert torch.equal(sparse.unpack(payload, 7, chunk, 8)[1], want_i)


def test_a_non_finite_gradient_leaves_e_sends_nan_scales_and_a_skipped_step_keeps_g():
    grad, residual = skewed(600, 1), skewed(600, 2) * 0.1
    grad[5] = float("nan")
    e = residual.clone()
    payload = ops.quantize_chunks_ef_(grad, e, 8, 64, 10, 0.1, torch.tensor(False))
    assert torch.equal(e, residual)
    k_next, indices, scales, q = sparse.unpack(payload, 10, 64, 8)
    assert torch.isnan(scales).all()
    want_i, want_q, *_ = reference.quantize_chunks_ef(torch.zeros(600), residual, 8, 64, 10, 0.1)
    assert torch.equal(indices, want_i) and torch.equal(q, want_q)  # chosen from e alone
    ops.quantize_chunks_settle_(e, indices, q, scales, 64, torch.tensor(False))
    assert torch.equal(e, residual)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_average_is_the_reference_bit_for_bit(bits, ranks, dtype):
    numel, chunk, k = 1000, 64, 6
    payloads, parts, needs = [], [], []
    for r in range(ranks):
        p = ops.quantize_chunks_ef_(skewed(numel, r), torch.zeros(numel), bits, chunk, k, 0.2 + 0.3 * r)
        k_next, indices, scales, q = sparse.unpack(p, k, chunk, bits)
        payloads.append(p)
        parts.append((indices, q, scales))
        needs.append(int(k_next))
    rows = torch.stack(payloads)
    want = reference.quantized_chunks_average(parts, numel, chunk).to(dtype)
    mean, k_next = ops.quantize_chunks_average(rows, numel, k, bits, chunk, dtype)
    assert torch.equal(mean, want) and int(k_next) == max(needs)
    torch_mean, torch_k = sparse.average(rows, numel, k, chunk, bits)
    assert torch.equal(torch_mean.to(dtype), mean) and int(torch_k) == int(k_next)
    # rows that are a slice of a wider gathered bucket
    bucket = torch.cat([torch.zeros(ranks, 12, dtype=torch.uint8), rows, torch.ones(ranks, 8, dtype=torch.uint8)], 1)
    assert torch.equal(ops.quantize_chunks_average(bucket[:, 12:12 + rows.shape[1]], numel, k, bits, chunk,
                                                   dtype)[0], want)


def test_the_next_count_is_clamped_to_the_layer():
    p = ops.quantize_chunks_ef_(skewed(300, 0), torch.zeros(300), 8, 64, 2, 0.0)
    for header, want in ((1000, 5), (0, 1), (-3, 1)):
        p[:4] = torch.tensor([header], dtype=torch.int32).view(torch.uint8)
        assert int(ops.quantize_chunks_average(p[None], 300, 2, 8, 64, torch.float32)[1]) == want


def test_opcheck():
    g, e = skewed(300, 0), torch.randn(300)
    opcheck(torch.ops.accordion.quantize_chunks_ef_.default, (g, e, 8, 64, 3, 0.1, TRUE))
    opcheck(torch.ops.accordion.quantize_chunks_ef_.default, (g.half(), e, 16, 64, 5, 0.0, None))
    rows = torch.stack([ops.quantize_chunks_ef_(skewed(300, r), torch.zeros(300), 8, 64, 3, 0.1) for r in range(2)])
    opcheck(torch.ops.accordion.quantize_chunks_average.default, (rows, 300, 3, 8, 64, torch.float16))
    _, indices, scales, q = sparse.unpack(rows[0], 3, 64, 8)
    opcheck(torch.ops.accordion.quantize_chunks_settle_.default, (torch.randn(300), indices, q, scales, 64, TRUE))


def _bad_rows():
    p = ops.quantize_chunks_ef_(skewed(300, 0), torch.zeros(300), 8, 64, 2, 0.0)
    p[4:8] = torch.tensor([9], dtype=torch.int32).view(torch.uint8)  # a chunk index past the layer's 5
    return p[None]


@pytest.mark.parametrize("call,message", [
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10), 4, 8, 1, 0.1), "bits must be 8 or 16, got 4"),
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10), 8, 0, 1, 0.1), "chunk must be >= 1, got 0"),
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10), 8, 4, 4, 0.1), r"k \(the chunks sent\) must "
     r"be in \[1, 3\]"),
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10), 8, 4, 1, 1.0), r"skip .* must be in \[0, 1\)"),
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10).double(), 8, 4, 1, 0.1), "residual must"),
    (lambda: ops.quantize_chunks_ef_(torch.randn(10), torch.randn(10), 8, 4, 1.0, 0.1), "k must be an int"),
    (lambda: ops.quantize_chunks_average(torch.zeros(2, 12, dtype=torch.uint8), 10, 1, 8, 8, torch.float32),
     "each row must be a payload of 20 bytes"),
    (lambda: ops.quantize_chunks_average(torch.zeros(2, 20), 10, 1, 8, 8, torch.float32), "rows must be a 2-d uint8"),
    (lambda: ops.quantize_chunks_average(_bad_rows(), 300, 2, 8, 64, torch.float32),
     r"rank 0's payload is not a sparse-chunk payload of this layer: its chunk index at position 0 is 9"),
    (lambda: ops.quantize_chunks_settle_(torch.randn(10), torch.tensor([2, 1], dtype=torch.int32),
                                         torch.zeros(8, dtype=torch.int8), torch.ones(2), 4, TRUE),
     "indices must be ascending"),
    (lambda: ops.quantize_chunks_settle_(torch.randn(10), torch.tensor([0, 1]), torch.zeros(8, dtype=torch.int8),
                                         torch.ones(2), 4, TRUE), "indices must be a contiguous 1-d int32"),
    (lambda: ops.quantize_chunks_settle_(torch.randn(10), torch.tensor([0, 1], dtype=torch.int32),
                                         torch.zeros(7, dtype=torch.int8), torch.ones(2), 4, TRUE), "q must be"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        call()


def test_bad_indices_change_no_residual():
    e = torch.randn(10)
    before = e.clone()
    with pytest.raises(RuntimeError, match="ascending"):
        ops.quantize_chunks_settle_(e, torch.tensor([0, 3], dtype=torch.int32), torch.ones(8, dtype=torch.int8),
                                    torch.ones(2), 4, TRUE)
    assert torch.equal(e, before)


CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and __import__("accordion_hvd").with_cuda),
                          reason="needs a GPU and a CUDA build")


@CUDA
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel,chunk", [(1_000_003, 512), (3_000_000, 100), (7, 512)])
def test_the_cuda_kernels_are_the_cpu_kernels_bit_for_bit(bits, dtype, numel, chunk):
    """csrc/cuda/quantize_chunks.cu against the CPU kernels: the payload (k_next, the chosen
    chunks, scales, integers), e after the encode and after settling, the average of three
    ranks and the agreed count. (3e6 in chunks of 100: 30,000 chunks, the running sum in 30
    blocks.)"""
    chunks = -(-numel // chunk)
    k = max(1, chunks // 5)
    for finite in (True, False):
        grad, residual = skewed(numel, bits, dtype), skewed(numel, 1) * 0.01
        flag = torch.tensor(finite)
        e_cpu, e_gpu = residual.clone(), residual.cuda()
        want = ops.quantize_chunks_ef_(grad, e_cpu, bits, chunk, k, 0.05, flag)
        got = ops.quantize_chunks_ef_(grad.cuda(), e_gpu, bits, chunk, k, 0.05, flag.cuda()).cpu()
        nan_safe = lambda p: torch.cat([p[:4 + 4 * k], p[4 + 4 * k:4 + 8 * k].view(torch.float32).nan_to_num(7.0)
                                        .view(torch.uint8), p[4 + 8 * k:]])
        assert torch.equal(nan_safe(got), nan_safe(want)) and torch.equal(e_gpu.cpu(), e_cpu)
        _, indices, scales, q = sparse.unpack(want, k, chunk, bits)
        ops.quantize_chunks_settle_(e_cpu, indices, q, scales, chunk, flag)
        parts = [t.cuda() for t in sparse.unpack(got.cuda(), k, chunk, bits)[1:]]
        ops.quantize_chunks_settle_(e_gpu, parts[0], parts[2], parts[1], chunk, flag.cuda())
        assert torch.equal(e_gpu.cpu(), e_cpu)
    rows = torch.stack([ops.quantize_chunks_ef_(skewed(numel, r, dtype), torch.zeros(numel), bits, chunk, k, 0.05)
                        for r in range(3)])
    want_mean, want_k = ops.quantize_chunks_average(rows, numel, k, bits, chunk, dtype)
    mean, k_next = ops.quantize_chunks_average(rows.cuda(), numel, k, bits, chunk, dtype)
    assert torch.equal(mean.cpu(), want_mean) and int(k_next) == int(want_k)


@CUDA
def test_the_cuda_encode_of_a_large_layer_runs_without_a_host_read():
    grad, e = skewed(10_000_000, 0).cuda(), torch.zeros(10_000_000, device="cuda")
    flag = torch.tensor(True, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        payload = ops.quantize_chunks_ef_(grad, e, 8, 512, 4000, 0.05, flag)
        _, indices, scales, q = sparse.unpack(payload, 4000, 512, 8)
        ops.quantize_chunks_settle_(e, indices, q, scales, 512, flag)
        mean, k_next = ops.quantize_chunks_average(torch.stack([payload, payload]), 10_000_000, 4000, 8, 512,
                                                   torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert 1 <= int(k_next) <= 19532
