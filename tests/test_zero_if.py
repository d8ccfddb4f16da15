"""accordion::zero_if_ (zero a skipped step's tensors on a device-side flag) against plain torch."""

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
    acc.ops.zero_if_(after, torch.tensor(flag))
    for b, a in zip(before, after):
        expected = torch.zeros_like(b) if flag else b
        assert torch.equal(a.nan_to_num(), expected.nan_to_num()) and a.isnan().sum() == expected.isnan().sum()
        assert a.dtype == b.dtype and a.shape == b.shape


def test_non_contiguous_views_are_zeroed_in_place():
    base = torch.randn(8, 6)
    view = base.t()[1:4]
    acc.ops.zero_if_([view], torch.tensor(True))
    assert torch.count_nonzero(base.t()[1:4]) == 0 and torch.count_nonzero(base.t()[0]) == 8


def test_no_tensors_is_nothing():
    acc.ops.zero_if_([], torch.tensor(True))


@pytest.mark.parametrize("tensors_,flag,error,message", [
    ([torch.randn(3)], torch.tensor([True]), RuntimeError, "flag must be a 0-d bool tensor, got a 1-d Bool"),
    ([torch.randn(3)], torch.tensor(1), RuntimeError, "flag must be a 0-d bool tensor, got a 0-d Long"),
    ([torch.randn(3)], True, TypeError, "flag must be a torch.Tensor, got bool"),
], ids=["1-d", "integer", "python-bool"])
def test_bad_input_names_the_argument(tensors_, flag, error, message):
    with pytest.raises(error, match=message):
        acc.ops.zero_if_(tensors_, flag)


def test_opcheck():
    for flag in (True, False):
        opcheck(torch.ops.accordion.zero_if_.default, ([t.clone() for t in tensors()[:2]], torch.tensor(flag)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("flag", [True, False])
def test_cuda_matches_cpu(flag):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    on_cpu, on_gpu = tensors(), [t.cuda() for t in tensors()]
    acc.ops.zero_if_(on_cpu, torch.tensor(flag))
    acc.ops.zero_if_(on_gpu, torch.tensor(flag, device="cuda"))
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a.nan_to_num(), b.cpu().nan_to_num())
