"""accordion::fill_if_ and accordion::restore_if_ (a skipped step's settling, on a device-side
flag) against plain torch."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc


def tensors():
    gen = torch.Generator().manual_seed(1)
    out = [torch.randn(300, 7, generator=gen), torch.randn(5, generator=gen).half(), torch.arange(6)]
    out[0][3, 2] = float("nan")  # what a skipped step's results may hold
    return out


@pytest.mark.parametrize("flag", [True, False])
def test_zeroes_every_tensor_only_when_the_flag_is_set(flag):
    before, after = tensors(), tensors()
    acc.ops.fill_if_(after, torch.tensor(flag))
    for b, a in zip(before, after):
        expected = torch.zeros_like(b) if flag else b
        assert torch.equal(a.nan_to_num(), expected.nan_to_num()) and a.isnan().sum() == expected.isnan().sum()
        assert a.dtype == b.dtype and a.shape == b.shape


def test_non_contiguous_views_are_zeroed_in_place():
    base = torch.randn(8, 6)
    view = base.t()[1:4]
    acc.ops.fill_if_([view], torch.tensor(True))
    assert torch.count_nonzero(base.t()[1:4]) == 0 and torch.count_nonzero(base.t()[0]) == 8


def test_fills_with_the_value_given():
    t = torch.randn(4, 3)
    acc.ops.fill_if_([t], torch.tensor(True), float("nan"))
    assert torch.isnan(t).all()


def test_no_tensors_is_nothing():
    acc.ops.fill_if_([], torch.tensor(True))


@pytest.mark.parametrize("tensors_,flag,error,message", [
    ([torch.randn(3)], torch.tensor([True]), RuntimeError, "flag must be a 0-d bool tensor, got a 1-d Bool"),
    ([torch.randn(3)], torch.tensor(1), RuntimeError, "flag must be a 0-d bool tensor, got a 0-d Long"),
    ([torch.randn(3)], True, TypeError, "flag must be a torch.Tensor, got bool"),
], ids=["1-d", "integer", "python-bool"])
def test_bad_input_names_the_argument(tensors_, flag, error, message):
    with pytest.raises(error, match=message):
        acc.ops.fill_if_(tensors_, flag)


def test_opcheck():
    for flag in (True, False):
        opcheck(torch.ops.accordion.fill_if_.default, ([t.clone() for t in tensors()[:2]], torch.tensor(flag), 0.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("flag", [True, False])
def test_cuda_matches_cpu(flag):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    on_cpu, on_gpu = tensors(), [t.cuda() for t in tensors()]
    acc.ops.fill_if_(on_cpu, torch.tensor(flag))
    acc.ops.fill_if_(on_gpu, torch.tensor(flag, device="cuda"))
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a.nan_to_num(), b.cpu().nan_to_num())


@pytest.mark.parametrize("flag", [True, False])
def test_restore_if_writes_the_values_only_when_the_flag_is_set(flag):
    residual = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    indices = torch.tensor([3, 17, 999, 0], dtype=torch.int32)
    values = torch.tensor([1.5, -2.0, 0.25, 7.0])
    expected = residual.clone()
    if flag:
        expected[indices.long()] = values
    acc.ops.restore_if_(residual, indices, values, torch.tensor(flag))
    assert torch.equal(residual, expected)
    opcheck(torch.ops.accordion.restore_if_.default, (residual.clone(), indices, values, torch.tensor(flag)))


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(5), torch.tensor([1]), torch.ones(1), torch.tensor(True)), "indices must be 1-d int32"),
    ((torch.zeros(5), torch.tensor([1], dtype=torch.int32), torch.ones(2), torch.tensor(True)), "values' length"),
    ((torch.zeros(5).double(), torch.tensor([1], dtype=torch.int32), torch.ones(1).double(), torch.tensor(True)),
     "residual must be float32"),
    ((torch.zeros(5), torch.tensor([1], dtype=torch.int32), torch.ones(1), torch.tensor([True])),
     "flag must be a 0-d bool tensor"),
], ids=["int64-indices", "lengths", "float64", "1-d-flag"])
def test_restore_if_bad_input_names_the_argument(args, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.restore_if_(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("flag", [True, False])
def test_restore_if_cuda_matches_cpu(flag):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    residual = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    indices = torch.randperm(100_000, generator=torch.Generator().manual_seed(4))[:5000].int()
    values = torch.randn(5000)
    on_gpu = residual.cuda()
    acc.ops.restore_if_(on_gpu, indices.cuda(), values.cuda(), torch.tensor(flag, device="cuda"))
    acc.ops.restore_if_(residual, indices, values, torch.tensor(flag))
    assert torch.equal(on_gpu.cpu(), residual)
