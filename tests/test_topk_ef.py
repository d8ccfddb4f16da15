"""accordion::topk_ef (fused TopK with error feedback) and accordion::sparse_average (its
decode) against the plain-torch references in accordion_hvd/reference.py.

The kernel's selection must be the reference's exactly: the same entries (ties to the lower
index), in the same order (ascending index), the same values bit for bit, the same new
residual. Inputs cover both of its paths: spread-out magnitudes (a sampled threshold leaves
O(k) candidates after one pass) and heavily tied ones (a tensor of a handful of distinct
values, where the sample cannot separate k entries and the kernel scans all of g).
"""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference

SIZES = [1, 2, 7, 31, 1000, 65_537, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RATIOS = [0.0, 0.001, 0.01, 0.1, 0.25, 1.0]


def make(n, grad_dtype, seed=0, kind="normal"):
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        grad = torch.randn(n, generator=gen)
        residual = 0.1 * torch.randn(n, generator=gen)
    elif kind == "tied":  # five distinct values: the slow path for large n
        grad = torch.randint(-2, 3, (n,), generator=gen).float()
        residual = torch.zeros(n)
    elif kind == "zeros":
        grad, residual = torch.zeros(n), torch.zeros(n)
    else:
        raise ValueError(kind)
    return grad.to(grad_dtype), residual


def assert_same_selection(grad, residual, k):
    values, indices, new_residual, g_sq, kept_sq = reference.topk_select(grad, residual.clone(), k)
    residual_out = residual.clone()
    v, i, gs, ks = acc.ops.topk_ef(grad, residual_out, k)
    assert v.dtype == torch.float32 and i.dtype == torch.int32 and v.shape == i.shape == (k,)
    assert torch.equal(i, indices), "selected a different set of entries, or not in index order"
    assert torch.equal(v, values), "values differ from g at the selected entries"
    assert torch.equal(residual_out, new_residual), "residual is not g with the kept entries zeroed"
    # g_sq accumulates in float within 2,048-entry blocks (see csrc/cpu/topk_ef.cpp).
    torch.testing.assert_close(gs, g_sq, rtol=2e-5, atol=1e-30)
    torch.testing.assert_close(ks, kept_sq, rtol=1e-12, atol=1e-30)
    return v, i


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(n, grad_dtype, ratio):
    grad, residual = make(n, grad_dtype, seed=n)
    assert_same_selection(grad, residual, min(n, round(ratio * n)))


@pytest.mark.parametrize("k", [1, 5, 1000, 150_000, 299_999])
@pytest.mark.parametrize("kind", ["tied", "zeros"])
def test_heavy_ties_take_the_lowest_indices(kind, k):
    grad, residual = make(300_000, torch.float32, kind=kind)
    assert_same_selection(grad, residual, k)


def test_a_misleading_sample_still_gives_the_exact_answer():
    # Large values exactly where the kernel samples (128 runs of 128, spread evenly) and
    # nowhere else: the sampled bound lets fewer than k entries through, so the kernel must
    # notice and select over all of g.
    n, runs, run = 1_000_000, 128, 128
    grad = torch.rand(n) * 0.01
    for j in range(runs):
        start = j * (n - run) // (runs - 1)
        grad[start:start + run] = 10 + torch.rand(run)
    assert_same_selection(grad, torch.zeros(n), 20_000)


def test_entries_zeroed_early_but_not_kept_are_restored():
    # The first pass zeroes entries at or above a sampled key U that fewer than k entries
    # should reach. Here 2k entries, none of them sampled, share one value above every
    # sampled one: U lies below the threshold, the candidate list is still short enough for
    # the fast path, and the k ties that are not kept must get their value back in e.
    n, k, runs, run = 1 << 20, 10_000, 128, 128
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1))
    sampled = torch.zeros(n, dtype=torch.bool)
    for j in range(runs):
        start = j * (n - run) // (runs - 1)
        sampled[start:start + run] = True
    free = (~sampled).nonzero().squeeze(1)
    spike = free[torch.randperm(len(free), generator=torch.Generator().manual_seed(2))[:2 * k]]
    grad[spike] = 100.0
    _, indices = assert_same_selection(grad, torch.zeros(n), k)
    assert torch.equal(indices.long(), spike.sort().values[:k])


@pytest.mark.parametrize("copies", [3, 300, 30_000])
def test_ties_at_the_threshold_on_the_fast_path(copies):
    # Well-spread magnitudes (so the sample separates k entries and the kernel takes its
    # candidate path) with `copies` entries, scattered over every chunk, set to exactly
    # the k-th largest magnitude, both signs: the kept ones must be the lowest indices,
    # also where the writing walk decides eight records at a time.
    n, k = 1 << 20, 50_000
    gen = torch.Generator().manual_seed(copies)
    grad, residual = torch.randn(n, generator=gen), 0.01 * torch.randn(n, generator=gen)
    threshold = (grad + residual).abs().kthvalue(n - k + 1).values.item()
    where = torch.randperm(n, generator=gen)[:copies]
    grad[where] = threshold * torch.where(torch.rand(copies, generator=gen) < 0.5, -1.0, 1.0)
    residual[where] = 0.0
    values, _ = assert_same_selection(grad, residual, k)
    assert (values.abs() == threshold).sum() >= 1, "no tie at the threshold was kept"


def test_tie_rule_by_hand():
    grad = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.5])
    v, i, _, _ = acc.ops.topk_ef(grad, torch.zeros(6), 2)
    assert sorted(i.tolist()) == [1, 2]  # |-3| at 1, 2 and 4: the two lowest indices win
    v, i, _, _ = acc.ops.topk_ef(grad, torch.zeros(6), 4)
    assert sorted(i.tolist()) == [1, 2, 3, 4]


def test_negative_zero_and_error_feedback_cancellation():
    grad = torch.tensor([0.0, -0.0, 1.0, -1.0])
    residual = torch.tensor([0.0, 0.0, -1.0, 2.0])  # g = [0, -0, 0, 1]
    assert_same_selection(grad, residual, 2)


def test_result_does_not_depend_on_thread_count():
    grad, residual = make(3_000_001, torch.float32, seed=5)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            r = residual.clone()
            outs.append((*acc.ops.topk_ef(grad, r, 30_000), r))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_multidimensional_channels_last_grad():
    grad = torch.randn(16, 8, 3, 3).to(memory_format=torch.channels_last)
    residual = torch.randn(16, 8, 3, 3)
    assert_same_selection(grad, residual, 100)


@pytest.mark.slow
def test_ten_million_entries():
    grad, residual = make(10_000_000, torch.float16, seed=7)
    assert_same_selection(grad, residual, 100_000)


def test_opcheck():
    grad, residual = make(5000, torch.float32)
    opcheck(torch.ops.accordion.topk_ef.default, (grad, residual, 50))
    values, indices, _, _ = acc.ops.topk_ef(grad, residual.clone(), 50)
    opcheck(torch.ops.accordion.sparse_average.default, (values, indices, 5000, 1, torch.float16))


def test_finite_flag():
    """``finite`` True is the plain call; False selects from the residual alone (the gradient,
    here full of NaN, is not added) and leaves the residual as that selection would."""
    grad, residual = make(5000, torch.float32)
    plain = acc.ops.topk_ef(grad, residual.clone(), 50)
    flagged = acc.ops.topk_ef(grad, residual.clone(), 50, torch.tensor(True))
    for a, b in zip(plain, flagged):
        assert torch.equal(a, b)
    after, expected_after = residual.clone(), residual.clone()
    values, indices, g_sq, kept_sq = acc.ops.topk_ef(torch.full_like(grad, float("nan")), after, 50,
                                                     torch.tensor(False))
    expected = acc.ops.topk_ef(torch.zeros_like(grad), expected_after, 50)
    for a, b in zip((values, indices, g_sq, kept_sq), expected):
        assert torch.equal(a, b)
    assert torch.equal(after, expected_after)
    opcheck(torch.ops.accordion.topk_ef.default, (grad, residual.clone(), 50, torch.tensor(False)))


def test_bad_finite_flag_names_the_argument():
    with pytest.raises(RuntimeError, match="finite must be a 0-d bool tensor"):
        acc.ops.topk_ef(torch.randn(5), torch.zeros(5), 1, torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("args,message", [
    ((torch.randn(5), torch.randn(5), 6), r"k must be in \[0, numel = 5\], got 6"),
    ((torch.randn(5), torch.randn(5), -1), r"k must be in \[0, numel = 5\], got -1"),
    ((torch.randn(5).double(), torch.randn(5).double(), 1), "residual must be float32"),
    ((torch.randn(6), torch.randn(3, 2).t(), 1), "same shape"),
    ((torch.randn(2, 3), torch.randn(3, 2).t(), 1), "residual must be contiguous"),
    ((torch.arange(5), torch.zeros(5), 1), "grad must be a floating-point tensor"),
    ((torch.randn(5).to_sparse(), torch.zeros(5), 1), "dense"),
], ids=["k-too-big", "k-negative", "float64", "shape", "noncontiguous-residual", "integer", "sparse"])
def test_topk_bad_input_names_the_problem(args, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        acc.ops.topk_ef(*args)


def test_k_must_be_an_int():
    with pytest.raises(TypeError, match="k must be an int, got float"):
        acc.ops.topk_ef(torch.randn(5), torch.zeros(5), 2.0)


# --- sparse_average -----------------------------------------------------------------------

def gathered(world, n, k, seed=0):
    """What an allgather of `world` ranks' TopK outputs looks like (overlapping indices)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(world * k, generator=gen)
    indices = torch.cat([torch.randperm(n, generator=gen)[:k] for _ in range(world)]).to(torch.int32)
    return values, indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(1, 1), (10, 10), (1000, 10), (1_000_003, 10_000)])
def test_sparse_average_matches_reference(n, k, world, dtype):
    values, indices = gathered(world, n, k, seed=n + world)
    out = acc.ops.sparse_average(values, indices, n, world, dtype)
    expected = reference.sparse_average(values, indices, n, world).to(dtype)
    assert out.dtype == dtype and torch.equal(out, expected)


def test_sparse_average_empty():
    out = acc.ops.sparse_average(torch.zeros(0), torch.zeros(0, dtype=torch.int32), 7, 2)
    assert torch.equal(out, torch.zeros(7))


@pytest.mark.parametrize("args,message", [
    ((torch.ones(2), torch.tensor([0, 7], dtype=torch.int32), 7, 1), r"indices\[1\] = 7 is outside \[0, numel = 7\)"),
    ((torch.ones(1), torch.tensor([-1], dtype=torch.int32), 7, 1), r"indices\[0\] = -1 is outside"),
    ((torch.ones(2), torch.tensor([0, 1]), 7, 1), "indices must be a contiguous int32 tensor"),
    ((torch.ones(2), torch.tensor([0], dtype=torch.int32), 7, 1), "same length"),
    ((torch.ones(2).double(), torch.tensor([0, 1], dtype=torch.int32), 7, 1), "values must be float32"),
    ((torch.ones(2), torch.tensor([0, 1], dtype=torch.int32), 7, 0), "world_size must be >= 1"),
], ids=["index-too-big", "index-negative", "int64-indices", "lengths", "float64-values", "world-0"])
def test_sparse_average_bad_input(args, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.sparse_average(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_average_bad_flag_skips_and_flags_instead_of_raising(dtype):
    """With ``bad`` (a 0-d bool on the device) an index outside the layer is skipped and
    flagged, for the caller to read once per step; the others decode as the reference does."""
    values, indices = gathered(3, 1000, 50, seed=5)
    corrupt = indices.clone()
    corrupt[[4, 77]] = torch.tensor([1000, -3], dtype=torch.int32)
    flag = torch.tensor(False)
    out = acc.ops.sparse_average(values, corrupt, 1000, 3, dtype, flag)
    inside = torch.ones_like(values, dtype=torch.bool)
    inside[[4, 77]] = False
    expected = reference.sparse_average(values[inside], corrupt[inside], 1000, 3).to(dtype)
    assert bool(flag) and torch.equal(out, expected)
    clean = torch.tensor(False)
    assert torch.equal(acc.ops.sparse_average(values, indices, 1000, 3, dtype, clean),
                       acc.ops.sparse_average(values, indices, 1000, 3, dtype)) and not bool(clean)
    opcheck(torch.ops.accordion.sparse_average.default, (values, corrupt, 1000, 3, dtype, torch.tensor(False)))
    with pytest.raises(RuntimeError, match="bad must be a 0-d bool tensor, got a 1-d Bool"):
        acc.ops.sparse_average(values, indices, 1000, 3, dtype, torch.tensor([False]))
