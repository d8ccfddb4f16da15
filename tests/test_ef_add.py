"""accordion::ef_add_ (the error-feedback add, in place: residual += grad) against its
plain-torch reference."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference

SIZES = [0, 1, 2, 7, 31, 32769, 1_000_003]
SAME_DTYPE = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
MIXED = [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)]
DTYPE_PAIRS = [(d, d) for d in SAME_DTYPE] + MIXED


def added(grad, residual):
    """The kernel's ``grad + residual`` on a copy of the residual (the op is in place)."""
    out = residual.contiguous().clone()
    acc.ops.ef_add_(grad, out)
    return out


def make(n, grad_dtype, residual_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    residual = torch.randn(n, generator=gen).to(residual_dtype)
    return grad, residual


@pytest.mark.parametrize("grad_dtype,residual_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference_bit_for_bit(n, grad_dtype, residual_dtype):
    grad, residual = make(n, grad_dtype, residual_dtype)
    out = added(grad, residual)
    expected = reference.ef_add(grad, residual)
    assert out.dtype == residual_dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("grad_dtype,residual_dtype", DTYPE_PAIRS)
def test_inplace_updates_residual_only(grad_dtype, residual_dtype):
    grad, residual = make(10_007, grad_dtype, residual_dtype, seed=1)
    grad_before, expected = grad.clone(), reference.ef_add(grad, residual)
    result = acc.ops.ef_add_(grad, residual)
    assert result is residual
    assert torch.equal(residual, expected)
    assert torch.equal(grad, grad_before)


@pytest.mark.slow
def test_ten_million_elements():
    grad, residual = make(10_000_000, torch.float32, torch.float32, seed=2)
    assert torch.equal(added(grad, residual), reference.ef_add(grad, residual))


def test_multidimensional_and_channels_last_grad():
    grad = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    residual = torch.randn(8, 3, 5, 5)
    assert torch.equal(added(grad, residual), reference.ef_add(grad, residual))


def test_noncontiguous_residual_refused():
    grad = torch.randn(6, 4)
    residual = torch.randn(4, 6).t()
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        acc.ops.ef_add_(grad, residual)


@pytest.mark.parametrize("grad,residual,message", [
    (torch.randn(5), torch.randn(6), "same shape"),
    (torch.randn(5), torch.randn(5).half(), "residual must have grad's dtype"),
    (torch.randn(5).double(), torch.randn(5), "residual must have grad's dtype"),
    (torch.arange(5), torch.arange(5), "grad must be a floating-point tensor"),
    (torch.randn(5).to_sparse(), torch.randn(5), "dense"),
], ids=["shape", "half-residual", "double-grad", "integer", "sparse"])
def test_bad_input_names_the_problem(grad, residual, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        acc.ops.ef_add_(grad, residual)


def test_non_tensor_argument():
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got list"):
        acc.ops.ef_add_([1.0], torch.randn(1))


@pytest.mark.parametrize("grad_dtype,residual_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_opcheck(grad_dtype, residual_dtype):
    grad, residual = make(1000, grad_dtype, residual_dtype)
    opcheck(torch.ops.accordion.ef_add_.default, (grad, residual.clone()))


@pytest.mark.parametrize("grad_dtype,residual_dtype", DTYPE_PAIRS)
def test_finite_flag_adds_or_leaves_the_residual(grad_dtype, residual_dtype):
    """``finite`` (0-d bool on the device): True is the plain add, False leaves the residual
    exactly as it was, even for a gradient full of NaN."""
    grad, residual = make(1000, grad_dtype, residual_dtype)
    added = acc.ops.ef_add_(grad, residual.clone(), torch.tensor(True))
    assert torch.equal(added, reference.ef_add(grad, residual))
    poisoned = grad.clone()
    poisoned[::7] = float("nan")
    kept = acc.ops.ef_add_(poisoned, residual.clone(), torch.tensor(False))
    assert torch.equal(kept, residual)


@pytest.mark.parametrize("finite,message", [
    (torch.tensor([True]), "finite must be a 0-d bool tensor, got a 1-d Bool"),
    (torch.tensor(1.0), "finite must be a 0-d bool tensor, got a 0-d Float"),
], ids=["1-d", "float"])
def test_bad_finite_flag_names_the_argument(finite, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.ef_add_(torch.randn(4), torch.zeros(4), finite)


@pytest.mark.parametrize("grad_dtype,residual_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_opcheck_with_finite_flag(grad_dtype, residual_dtype):
    grad, residual = make(1000, grad_dtype, residual_dtype)
    for flag in (True, False):
        opcheck(torch.ops.accordion.ef_add_.default, (grad, residual.clone(), torch.tensor(flag)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("grad_dtype,residual_dtype", DTYPE_PAIRS)
def test_cuda_matches_cpu(grad_dtype, residual_dtype):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    grad, residual = make(1_000_003, grad_dtype, residual_dtype, seed=3)
    out = added(grad.cuda(), residual.cuda()).cpu()
    assert torch.equal(out, reference.ef_add(grad, residual))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_finite_flag_matches_cpu():
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    grad, residual = make(100_003, torch.float16, torch.float32, seed=4)
    grad[::11] = float("inf")
    for flag in (True, False):
        on_gpu = acc.ops.ef_add_(grad.cuda(), residual.cuda(), torch.tensor(flag, device="cuda")).cpu()
        on_cpu = acc.ops.ef_add_(grad, residual.clone(), torch.tensor(flag))
        assert torch.equal(on_gpu, on_cpu), flag
