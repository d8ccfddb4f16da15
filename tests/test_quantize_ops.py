"""Quantize's compiled CPU kernels (csrc/cpu/quantize.cpp: accordion::quantize_ef_ and
accordion::quantize_average) against the plain-torch reference (reference.quantize_ef and
reference.quantized_average), bit for bit: every width, chunk sizes that divide the layer and
that do not, float32 and 16-bit gradients, a chunk of zeros, ties at half, a non-finite
gradient; the payload layout; opcheck; bad arguments named."""

import pytest
import torch
from torch.library import opcheck

from accordion_hvd import ops, reference


def parts(payload, numel, bits, chunk):
    chunks = -(-numel // chunk)
    q = payload[4 * chunks:4 * chunks + numel * bits // 8].view(torch.int8 if bits == 8 else torch.int16)
    return q, payload[:4 * chunks].view(torch.float32)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("numel,chunk", [(1000, 64), (4096, 512), (513, 512), (7, 3), (1, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_ef_is_the_reference_bit_for_bit(bits, numel, chunk, dtype):
    torch.manual_seed(numel * bits + chunk)
    grad = (torch.randn(numel) * 3).to(dtype)
    residual = torch.randn(numel) * 0.1
    if numel >= 2 * chunk:
        grad[chunk:2 * chunk] = 0  # a chunk of zeros: scale 0, zeros sent
        residual[chunk:2 * chunk] = 0
    want_q, want_s, want_e = reference.quantize_ef(grad, residual.clone(), bits, chunk)
    e = residual.clone()
    payload = ops.quantize_ef_(grad, e, bits, chunk, torch.tensor(True))
    assert payload.dtype == torch.uint8 and payload.numel() == ops.quantize_payload_bytes(numel, bits, chunk)
    q, s = parts(payload, numel, bits, chunk)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert torch.equal(e, residual + grad.float())  # g = grad + e, kept until the step settles
    assert torch.equal(e - q.float() * s.repeat_interleave(chunk)[:numel], want_e)
    assert not payload[4 * -(-numel // chunk) + numel * bits // 8:].any()  # the padding is zero


def test_ties_round_half_to_even_like_torch():
    # max |g| = 127 makes s = 1, so g / s is g itself: the halves must round to the even neighbour
    g = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    payload = ops.quantize_ef_(torch.zeros(8), g.clone(), 8, 8)
    q, s = parts(payload, 8, 8, 8)
    assert s.item() == 1.0 and q.tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_a_non_finite_gradient_leaves_e_and_sends_nan_scales():
    grad = torch.randn(300)
    grad[5] = float("nan")
    residual = torch.randn(300)
    e = residual.clone()
    payload = ops.quantize_ef_(grad, e, 8, 64, torch.tensor(False))
    q, s = parts(payload, 300, 8, 64)
    assert torch.equal(e, residual) and torch.isnan(s).all()
    want_q, _, _ = reference.quantize_ef(torch.zeros(300), residual, 8, 64)  # q of e alone
    assert torch.equal(q, want_q)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_average_is_the_reference_bit_for_bit(bits, ranks, dtype):
    numel, chunk = 1000, 64
    payloads, parts_of = [], []
    for r in range(ranks):
        torch.manual_seed(r)
        p = ops.quantize_ef_(torch.randn(numel), torch.zeros(numel), bits, chunk)
        payloads.append(p)
        parts_of.append(parts(p, numel, bits, chunk))
    rows = torch.stack(payloads)
    want = reference.quantized_average(parts_of, chunk).to(dtype)
    assert torch.equal(ops.quantize_average(rows, numel, bits, chunk, dtype), want)
    # rows that are a slice of a wider gathered bucket (a row stride beyond their length)
    bucket = torch.cat([torch.zeros(ranks, 12, dtype=torch.uint8), rows, torch.ones(ranks, 8, dtype=torch.uint8)], 1)
    assert torch.equal(ops.quantize_average(bucket[:, 12:12 + rows.shape[1]], numel, bits, chunk, dtype), want)


CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and __import__("accordion_hvd").with_cuda),
                          reason="needs a GPU and a CUDA build")


@CUDA
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cuda_kernels_are_the_cpu_kernels_bit_for_bit(bits, dtype):
    """csrc/cuda/quantize.cu, which the codec uses on CUDA tensors (codecs/quantize.py
    ``_fused``, ``decode``; passed on an H200, benchmarks/results/gpu/2026-11-27-h200)."""
    numel, chunk = 100_003, 512
    torch.manual_seed(bits)
    grad, residual = (torch.randn(numel) * 3).to(dtype), torch.randn(numel) * 0.1
    payloads = {}
    for finite in (True, False):
        e_cpu, e_gpu = residual.clone(), residual.cuda()
        flag = torch.tensor(finite)
        want = payloads[finite] = ops.quantize_ef_(grad, e_cpu, bits, chunk, flag)
        got = ops.quantize_ef_(grad.cuda(), e_gpu, bits, chunk, flag.cuda())
        assert torch.equal(got.cpu().view(-1)[:4 * 196].view(torch.float32).nan_to_num(7.0),
                           want.view(-1)[:4 * 196].view(torch.float32).nan_to_num(7.0))
        assert torch.equal(got.cpu()[4 * 196:], want[4 * 196:]) and torch.equal(e_gpu.cpu(), e_cpu)
    want = payloads[True]
    rows = torch.stack([want, want.roll(4 * 196)])  # a second rank: the same scales, other integers
    rows[1, :4 * 196] = want[:4 * 196]
    assert torch.equal(ops.quantize_average(rows.cuda(), numel, bits, chunk, dtype).cpu(),
                       ops.quantize_average(rows, numel, bits, chunk, dtype))


def test_opcheck():
    opcheck(torch.ops.accordion.quantize_ef_.default, (torch.randn(300), torch.randn(300), 8, 64, torch.tensor(True)))
    opcheck(torch.ops.accordion.quantize_ef_.default, (torch.randn(300).half(), torch.randn(300), 16, 64, None))
    rows = torch.stack([ops.quantize_ef_(torch.randn(300), torch.zeros(300), 8, 64) for _ in range(2)])
    opcheck(torch.ops.accordion.quantize_average.default, (rows, 300, 8, 64, torch.float16))


@pytest.mark.parametrize("call,message", [
    (lambda: ops.quantize_ef_(torch.randn(10), torch.randn(10), 4, 8), "bits must be 8 or 16, got 4"),
    (lambda: ops.quantize_ef_(torch.randn(10), torch.randn(10), 8, 0), "chunk must be >= 1, got 0"),
    (lambda: ops.quantize_ef_(torch.randn(10), torch.randn(10).double(), 8, 8), "residual must"),
    (lambda: ops.quantize_ef_(torch.randn(10), torch.randn(11), 8, 8), "same shape"),
    (lambda: ops.quantize_ef_(torch.randn(10), torch.randn(10), 8.0, 8), "bits must be an int"),
    (lambda: ops.quantize_average(torch.zeros(2, 10, dtype=torch.uint8), 10, 8, 8, torch.float32),
     "each row must be a payload of 20 bytes"),
    (lambda: ops.quantize_average(torch.zeros(2, 20), 10, 8, 8, torch.float32), "rows must be a 2-d uint8"),
    (lambda: ops.quantize_average(torch.zeros(2, 20, dtype=torch.uint8), 10, 8, 8, torch.int32), "floating-point"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        call()
