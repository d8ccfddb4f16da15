"""accordion::orthogonalize_ (batched Gram-Schmidt) against the plain-torch reference."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference

SHAPES = [(1, 1), (5, 1), (64, 2), (512, 4), (4608, 8), (3, 3), (1000, 16)]


def matrices(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonalize_matches_reference_in_one_call(dtype):
    ps = matrices(dtype)
    expected = [reference.orthogonalize_(p.clone()) for p in ps]
    acc.ops.orthogonalize_(ps)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for got, want in zip(ps, expected):
        torch.testing.assert_close(got, want, **tol)


def test_columns_come_out_orthonormal():
    ps = matrices(torch.float64, seed=1)
    acc.ops.orthogonalize_(ps)
    for p in ps:
        r = min(p.shape)  # more columns than rows: only the first n can be independent
        gram = p[:, :r].t() @ p[:, :r]
        torch.testing.assert_close(gram, torch.eye(r, dtype=p.dtype), rtol=0, atol=1e-6)  # eps shrinks norms by eps/norm


def test_zero_columns_stay_finite():
    p = torch.zeros(10, 3)
    p[:, 1] = torch.arange(10.0)
    acc.ops.orthogonalize_([p])
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p[:, 1].norm(), torch.tensor(1.0), rtol=1e-6, atol=0)
    assert p[:, 0].abs().max() == 0 and p[:, 2].abs().max() < 1e-6


def test_empty_list_and_empty_matrix():
    assert acc.ops.orthogonalize_([]) == []
    acc.ops.orthogonalize_([torch.zeros(0, 2), torch.ones(3, 1)])


@pytest.mark.parametrize("ps,message", [
    ([torch.randn(4)], r"ps\[0\] must be a dense 2-d tensor"),
    ([torch.randn(4, 2), torch.randn(4, 2).half()], r"ps\[1\] must be float32 or float64"),
    ([torch.randn(2, 4).t()], r"ps\[0\] must be contiguous"),
])
def test_orthogonalize_bad_input(ps, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.orthogonalize_(ps)


def test_orthogonalize_negative_eps():
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        acc.ops.orthogonalize_([torch.randn(3, 2)], eps=-1.0)


def test_opcheck():
    opcheck(torch.ops.accordion.orthogonalize_.default, ([torch.randn(20, 3), torch.randn(7, 2)], 1e-8))
