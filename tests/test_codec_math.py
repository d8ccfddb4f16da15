"""The math the codecs promise, checked through AccordionCompressor on the in-process
simulated world (accordion_hvd/comm/simulated.py): no Horovod, no processes.

What each test proves (tests/test_compressor_simulated.py already covers one-step by-hand
PowerSGD, 4-step error-feedback conservation, 2-rank step-1 TopK with torch.topk and
identical results across ranks; these go further):

* PowerSGD is warm-started power iteration: on a FIXED per-rank gradient, with the error
  feedback reset every step, the result converges to the best rank-r approximation of the
  mean gradient (truncated SVD). Fails if Q is not carried over between steps (the result
  would stay at the first step's rough approximation) or if P / Q are not averaged.
* Error feedback keeps compression unbiased over time: over 200 steps of gradients with a
  fixed full-rank mean part, the gap between the running sum of true mean gradients and the
  running sum of applied updates equals the mean residual and stays bounded. Without error
  feedback the rank-r tail is lost every step and the gap grows linearly; a control test
  shows that the same metric catches exactly that.
* TopK equals accordion_hvd.reference (topk_select, then sparse_average) bit for bit, on 3
  ranks, over several steps with residuals carried over and with deliberate ties in
  magnitude; at ratio 1.0 (forced through the compressed path) it is the dense mean, bit
  for bit.
"""

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.comm import SimulatedWorld


def run_steps(world_size, make_codec, steps, grad_fn, after_step=None):
    """Every simulated rank compresses grad_fn(rank, step) (a dict name -> tensor), does what
    Horovod does in between (averages what compress returned), decompresses, then calls
    after_step(compressor). Returns per rank: (list of per-step results, compressor)."""
    def worker(rank, channel):
        comp = acc.AccordionCompressor(make_codec(), channel=channel)
        history = []
        for step in range(steps):
            grads = grad_fn(rank, step)
            sent = {n: comp.compress_named(n, g) for n, g in grads.items()}
            reduced = {n: channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                       for n in sorted(sent)}
            history.append({n: comp.decompress(reduced[n], sent[n][1]) for n in sorted(sent)})
            if after_step is not None:
                after_step(comp)
        return history, comp
    return SimulatedWorld(world_size).run(worker)


def reset_error_feedback(comp):
    for state in comp.engine.layers.values():
        state.residual.zero_()


# --- PowerSGD: warm-started power iteration --------------------------------------------------
def test_powersgd_without_error_feedback_converges_to_the_best_rank_r_approximation():
    world, n, m, rank = 3, 32, 48, 2
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    # A clear spectral gap after the 2nd singular value: 8, 4 | 0.5, 0.45, ...
    s = torch.tensor([8.0, 4.0] + [0.5 * 0.9 ** i for i in range(n - 2)], dtype=torch.float64)
    mean = u @ torch.diag(s) @ v[:, :n].t()
    # Per-rank gradients differ (noise that cancels in the mean) and are fixed over steps.
    noise = [torch.randn(n, m, generator=gen, dtype=torch.float64) for _ in range(world)]
    grads = [(mean + x - sum(noise) / world).float() for x in noise]

    true_mean = sum(g.double() for g in grads) / world
    uu, ss, vh = torch.linalg.svd(true_mean)
    best = uu[:, :rank] @ torch.diag(ss[:rank]) @ vh[:rank]

    # A fresh tensor every step, as autograd makes: the codec may reuse the gradient's memory
    # for its result (PowerSGD writes M_hat there).
    results = run_steps(world, lambda: acc.PowerSGD(rank=rank), 30, lambda r, t: {"w": grads[r].clone()},
                        after_step=reset_error_feedback)
    rel_err = [((h["w"].double() - best).norm() / best.norm()).item() for h in results[0][0]]
    assert rel_err[0] > 0.1, f"one step should be far from converged (from a random Q): {rel_err[0]}"
    assert rel_err[-1] < 1e-5, f"did not converge to the truncated SVD: relative error per step {rel_err}"


# --- PowerSGD: error feedback over many steps ------------------------------------------------
STEPS, SHAPE = 200, (24, 40)
_MEAN_PART = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))


def biased_grads(rank, step):
    """A fixed full-rank part (what compression without feedback loses for good) plus noise."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": _MEAN_PART + torch.randn(SHAPE, generator=gen)}


def gap_norms(results, world):
    """||sum_t true mean_t - sum_t applied_t|| after every step, and the final gap."""
    applied = torch.zeros(SHAPE, dtype=torch.float64)
    true = torch.zeros(SHAPE, dtype=torch.float64)
    norms = []
    for t in range(STEPS):
        applied += results[0][0][t]["w"].double()
        true += sum(biased_grads(r, t)["w"].double() for r in range(world)) / world
        norms.append((true - applied).norm().item())
    return norms, true - applied


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_error_feedback_keeps_the_running_sum_on_track(rank):
    world = 3
    results = run_steps(world, lambda: acc.PowerSGD(rank=rank), STEPS, biased_grads)
    norms, gap = gap_norms(results, world)
    mean_residual = sum(c.engine.layers["w"].residual.double() for _, c in results) / world
    torch.testing.assert_close(gap, mean_residual, rtol=0, atol=1e-3)  # nothing lost, over 200 steps
    early = max(norms[:50])
    assert norms[-1] < 1.5 * early, f"the gap keeps growing: max over steps 1-50 {early:.1f}, step 200 {norms[-1]:.1f}"
    assert max(norms) < 1.5 * early, f"the gap keeps growing: max over steps 1-50 {early:.1f}, overall {max(norms):.1f}"


def test_without_error_feedback_the_same_gap_grows_linearly():
    """Control for the test above: reset the residual every step and the gap at step 200 is
    about 4x the gap at step 50, so the bound above really detects missing error feedback."""
    results = run_steps(3, lambda: acc.PowerSGD(rank=1), STEPS, biased_grads, after_step=reset_error_feedback)
    norms, _ = gap_norms(results, 3)
    assert norms[-1] > 3 * norms[49], (norms[49], norms[-1])


# --- TopK: exact against the reference -------------------------------------------------------
TOPK_SHAPES = {"w2d": (24, 40), "conv": (8, 3, 5, 5)}


def quantized_grads(rank, step):
    """Multiples of 1/4 in [-2, 2]: many exact ties in magnitude (also across the k-th place),
    and every sum exact in float32."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randint(-8, 9, s, generator=gen).float() / 4 for n, s in TOPK_SHAPES.items()}


@pytest.mark.parametrize("grad_fn", [quantized_grads,
                                     lambda r, t: {n: torch.randn(s, generator=torch.Generator().manual_seed(1000 * t + r))
                                                   for n, s in TOPK_SHAPES.items()}],
                         ids=["ties", "normal"])
def test_topk_equals_the_reference_over_steps_with_residuals(grad_fn):
    world, steps, ratio = 3, 5, 0.1
    codec = acc.TopK(ratio=ratio)
    results = run_steps(world, lambda: acc.TopK(ratio=ratio), steps, grad_fn)
    residual = {(r, n): torch.zeros(torch.Size(s).numel()) for r in range(world) for n, s in TOPK_SHAPES.items()}
    for t in range(steps):
        for n, s in TOPK_SHAPES.items():
            k = codec.level_k(acc.levels.NORMAL, torch.Size(s).numel())
            values, indices = [], []
            for r in range(world):
                v, i, residual[r, n], _, _ = reference.topk_select(grad_fn(r, t)[n].reshape(-1), residual[r, n], k)
                values.append(v)
                indices.append(i)
            expected = reference.sparse_average(torch.cat(values), torch.cat(indices), residual[0, n].numel(), world)
            for r in range(world):
                assert torch.equal(results[r][0][t][n], expected.view(s)), (t, n, r)
    for r in range(world):
        for n in TOPK_SHAPES:
            assert torch.equal(results[r][1].engine.layers[n].residual, residual[r, n]), (r, n)


def test_topk_ties_go_to_the_lower_index():
    """A gradient where the k-th place is a tie: the lower indices must win, on every rank."""
    grad = torch.zeros(10, 10)
    grad.view(-1)[[3, 17, 42, 58, 71, 99]] = torch.tensor([5.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    results = run_steps(2, lambda: acc.TopK(ratio=0.03), 1, lambda r, t: {"w": grad.clone()})  # k = 3
    expected = torch.zeros(100)
    expected[[3, 17, 42]] = torch.tensor([5.0, -1.0, 1.0])
    assert torch.equal(results[0][0][0]["w"].reshape(-1), expected)
    assert torch.equal(results[0][1].engine.layers["w"].residual, grad.reshape(-1) - expected)


@pytest.mark.parametrize("world", [2, 3])
def test_topk_at_full_ratio_is_the_dense_mean_exactly(world):
    steps = 3

    def grads(r, t):
        return {n: torch.randn(s, generator=torch.Generator().manual_seed(1000 * t + r)) for n, s in TOPK_SHAPES.items()}

    results = run_steps(world, lambda: acc.TopK(ratio=1.0, min_compression_rate=0.5), steps, grads)
    comp = results[0][1]
    assert all(comp.stats()["layers"][n]["level"] == "normal" for n in TOPK_SHAPES)  # really compressed
    for t in range(steps):
        for n in TOPK_SHAPES:
            # The simulated channel's dense average: the rank-order sum, divided by the size.
            dense = torch.stack([grads(r, t)[n] for r in range(world)]).sum(0) / world
            assert torch.equal(results[0][0][t][n], dense), (t, n)
    assert all(torch.count_nonzero(c.engine.layers[n].residual) == 0 for _, c in results for n in TOPK_SHAPES)
