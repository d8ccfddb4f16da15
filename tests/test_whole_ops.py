"""accordion::flush_whole and accordion::settle_sent_ (a layer or flat buffer sent whole, its
rounding kept in error feedback) against the plain-torch reference, bit for bit, on the CPU
and, where there is a GPU, on CUDA."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference

CASES = [(torch.float32, torch.float16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)]
IDS = [f"{str(g)[6:]}-to-{str(w)[6:]}" for g, w in CASES]


def inputs(grad_dtype, n=70001, seed=0):
    """Odd length (the tiles' and the vector loops' tails), magnitudes across the 16-bit
    ranges, exact ties for the rounding, and values beyond float16's largest."""
    gen = torch.Generator().manual_seed(seed)
    grad = (torch.randn(n, generator=gen) * torch.logspace(-6, 3, n)).to(grad_dtype)
    e = torch.randn(n, generator=gen) * 1e-3
    e[:8] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 7e4, -7e4, 65520.0, 0.0])
    grad[:8] = 0
    return grad, e


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
        torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("grad_dtype,wire", CASES, ids=IDS)
@pytest.mark.parametrize("finite", [True, False])
def test_flush_whole_matches_the_reference_bit_for_bit(grad_dtype, wire, finite):
    grad, e = inputs(grad_dtype)
    out_ref, e_ref = reference.flush_whole(grad, e, wire, finite)
    out = acc.ops.flush_whole(grad, e, wire, torch.tensor(finite))
    assert same(out, out_ref) and same(e, e_ref)
    assert finite or out.isnan().all()


@pytest.mark.parametrize("grad_dtype,wire", CASES, ids=IDS)
def test_flush_whole_without_a_flag_adds(grad_dtype, wire):
    grad, e = inputs(grad_dtype)
    out_ref, e_ref = reference.flush_whole(grad, e, wire)
    assert same(acc.ops.flush_whole(grad, e, wire), out_ref) and same(e, e_ref)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("done", [True, False])
def test_settle_sent_matches_the_reference_bit_for_bit(wire, done):
    _, e = inputs(torch.float32)
    e = e * torch.logspace(-4, 4, e.numel())
    e[:8] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 7e4, -7e4, 65520.0, 0.0])
    expected = reference.settle_sent(e, wire, done)
    acc.ops.settle_sent_(e, wire, torch.tensor(done))
    assert same(e, expected)


def test_a_whole_step_through_the_codecs_helpers_is_unchanged():
    """codecs/_common.py's flush_whole and settle_sent take the kernels for float32 error
    feedback and torch's ops for float64: the same results either way."""
    from accordion_hvd.codecs._common import flush_whole, settle_sent
    from accordion_hvd.levels import DENSE16
    for dtype in (torch.float32, torch.float64):
        grad = torch.randn(3, 50, dtype=dtype)
        e = torch.randn(150, dtype=dtype) * 1e-3
        expected_out, expected_e = reference.flush_whole(grad.reshape(-1), e, torch.float16)
        out = flush_whole(e, grad, DENSE16, torch.tensor(True))
        assert out.shape == grad.shape and same(out.reshape(-1), expected_out) and same(e, expected_e)
        settle_sent(e, torch.float16, torch.tensor(True))
        assert same(e, reference.settle_sent(expected_e, torch.float16))


@pytest.mark.parametrize("call,message", [
    (lambda: acc.ops.flush_whole(torch.randn(4), torch.randn(5), torch.float16), "same shape"),
    (lambda: acc.ops.flush_whole(torch.randn(4).double(), torch.randn(4).double(), torch.float16), "must be float32"),
    (lambda: acc.ops.flush_whole(torch.randn(4), torch.randn(4), torch.int8), "dtype must be float32, float16 or bfloat16"),
    (lambda: acc.ops.flush_whole(torch.randn(4), torch.randn(4), torch.float16, torch.tensor([True])),
     "finite must be a 0-d bool tensor"),
    (lambda: acc.ops.flush_whole(torch.randn(4), torch.randn(8)[::2], torch.float16), "must be contiguous"),
    (lambda: acc.ops.settle_sent_(torch.randn(4), torch.float16, torch.tensor(1)), "done must be a 0-d bool tensor"),
    (lambda: acc.ops.settle_sent_(torch.randn(4).half(), torch.float16, torch.tensor(True)), "must be float32"),
    (lambda: acc.ops.settle_sent_(torch.randn(4), torch.float64, torch.tensor(True)), "dtype must be float32"),
], ids=["shape", "residual-dtype", "wire-dtype", "flag", "strided", "done", "settle-dtype", "settle-wire"])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_opcheck():
    grad, e = inputs(torch.bfloat16, n=1000)
    for finite in (None, torch.tensor(True)):
        opcheck(torch.ops.accordion.flush_whole.default, (grad, e.clone(), torch.float16, finite))
    # not finite: the output is NaN, which the traced-vs-eager comparison cannot call equal
    opcheck(torch.ops.accordion.flush_whole.default, (grad, e.clone(), torch.float16, torch.tensor(False)),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    for done in (True, False):
        opcheck(torch.ops.accordion.settle_sent_.default, (e.clone(), torch.bfloat16, torch.tensor(done)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("grad_dtype,wire", CASES, ids=IDS)
@pytest.mark.parametrize("flag", [True, False])
def test_cuda_matches_cpu(grad_dtype, wire, flag):
    if not acc.with_cuda:
        pytest.skip("accordion_hvd was built without CUDA kernels")
    grad, e = inputs(grad_dtype)
    e_gpu = e.cuda()
    out_gpu = acc.ops.flush_whole(grad.cuda(), e_gpu, wire, torch.tensor(flag, device="cuda"))
    out = acc.ops.flush_whole(grad, e, wire, torch.tensor(flag))
    assert same(out_gpu.cpu(), out) and same(e_gpu.cpu(), e)
    acc.ops.settle_sent_(e_gpu, wire, torch.tensor(flag, device="cuda"))
    acc.ops.settle_sent_(e, wire, torch.tensor(flag))
    assert same(e_gpu.cpu(), e)
    opcheck(torch.ops.accordion.settle_sent_.default, (e_gpu.clone(), wire, torch.tensor(flag, device="cuda")))
