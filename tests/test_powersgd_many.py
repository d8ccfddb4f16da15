"""PowerSGD for a whole bucket: accordion::powersgd_p_many, _qt_many, _finish_many_ and
_settle_many_ against the plain-torch reference (accordion_hvd/reference.py), their checks,
and the exchange's use of them: a fixed number of calls per bucket, whatever the layer
count, with the same results as the layer-by-layer path."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import ops, reference
from accordion_hvd.codecs.powersgd import PowerSGD
from accordion_hvd.comm.simulated import SimulatedWorld
from dispatch_count import CountOps

# ResNet-style matrices (n x m) and ranks, with a one-row layer, a short row and rank 16.
SHAPES = [(64, 27, 1), (64, 576, 4), (128, 1152, 2), (10, 512, 16), (1, 40, 1), (300, 7, 3)]
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 sums of up to 1152 products of order 1, summed in another order


def bucket(device="cpu", seed=0, grad_dtype=torch.float32):
    """(grads as the model has them, residuals n x m, Q^T r x m) for SHAPES."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, m, generator=gen).to(grad_dtype) for n, m, _ in SHAPES]
    grads[0] = grads[0].view(64, 3, 3, 3)  # a conv's gradient: the ops take any shape of n * m entries
    residuals = [0.1 * torch.randn(n, m, generator=gen) for n, m, _ in SHAPES]
    qts = [torch.randn(r, m, generator=gen) for n, m, r in SHAPES]
    return [t.to(device) for t in grads], [t.to(device) for t in residuals], [t.to(device) for t in qts]


def split(flat, shapes):
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset:offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return out


def p_shapes():
    return [(n, r) for n, m, r in SHAPES]


def qt_shapes():
    return [(r, m) for n, m, r in SHAPES]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_p_many_is_the_reference_layer_by_layer(grad_dtype):
    grads, residuals, qts = bucket(grad_dtype=grad_dtype)
    expected = [reference.powersgd_p(g, e.clone(), q) for g, e, q in zip(grads, residuals, qts)]
    payload = ops.powersgd_p_many(grads, residuals, qts)
    assert payload.dtype == torch.float32 and payload.numel() == sum(n * r for n, r in p_shapes())
    for i, (p, (m, ep)) in enumerate(zip(split(payload, p_shapes()), expected)):
        assert torch.equal(residuals[i], m), f"layer {i}: e holds M = grad + e exactly"
        torch.testing.assert_close(p, ep, **TOL, msg=f"layer {i}")


def test_p_many_a_layer_flagged_not_finite_sends_nan_and_keeps_its_residual():
    grads, residuals, qts = bucket()
    grads[1][3, 5] = float("inf")
    finite = torch.tensor([True, False, True, True, False, True])
    before = [e.clone() for e in residuals]
    payload = ops.powersgd_p_many(grads, residuals, qts, finite)
    for i, p in enumerate(split(payload, p_shapes())):
        if finite[i]:
            assert torch.equal(residuals[i], before[i] + grads[i].reshape(before[i].shape)) and p.isfinite().all(), f"layer {i}"
        else:
            assert torch.equal(residuals[i], before[i]) and p.isnan().all(), f"layer {i}: e untouched, P NaN"


def test_qt_many_finish_and_settle_are_the_reference():
    grads, residuals, qts = bucket(seed=1)
    ps = [torch.randn(n, r) for n, r in p_shapes()]
    qt_payload = ops.powersgd_qt_many(ps, residuals)
    for i, qt in enumerate(split(qt_payload, qt_shapes())):
        torch.testing.assert_close(qt, reference.powersgd_qt(ps[i], residuals[i]), **TOL, msg=f"layer {i}")
    qt_avgs = [torch.randn(r, m) for r, m in qt_shapes()]
    outs = [torch.empty(n * m) for n, m, _ in SHAPES]
    ops.powersgd_finish_many_(residuals, outs, qts, ps, qt_avgs, torch.tensor(True))
    before = [e.clone() for e in residuals]
    for i in range(len(SHAPES)):
        torch.testing.assert_close(outs[i].view(residuals[i].shape), reference.powersgd_approx(ps[i], qt_avgs[i]),
                                   **TOL, msg=f"layer {i}")
        assert torch.equal(qts[i], qt_avgs[i]), f"layer {i}: Q^T is the average now"
    ops.powersgd_settle_many_(residuals, ps, qts, torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(residuals, before)), "a skipped step settles nothing"
    ops.powersgd_settle_many_(residuals, ps, qts, torch.tensor(True))
    for i in range(len(SHAPES)):
        torch.testing.assert_close(residuals[i], before[i] - reference.powersgd_approx(ps[i], qts[i]), **TOL)


def test_finish_many_when_not_ok_gives_zeros_and_keeps_q():
    grads, residuals, qts = bucket(seed=2)
    ps = [torch.full((n, r), float("nan")) for n, r in p_shapes()]
    kept = [q.clone() for q in qts]
    outs = [torch.ones(n * m) for n, m, _ in SHAPES]
    ops.powersgd_finish_many_(residuals, outs, qts, ps, [torch.full_like(q, float("nan")) for q in qts],
                              torch.tensor(False))
    assert all((o == 0).all() for o in outs) and all(torch.equal(a, b) for a, b in zip(qts, kept))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_finish_many_writes_a_16_bit_gradient_rounded_once(out_dtype):
    _, residuals, qts = bucket(seed=3)
    ps = [torch.randn(n, r) for n, r in p_shapes()]
    outs = [torch.empty(n, m, dtype=out_dtype) for n, m, _ in SHAPES]
    ops.powersgd_finish_many_(residuals, outs, [q.clone() for q in qts], ps, qts)
    for i in range(len(SHAPES)):
        expected = reference.powersgd_approx(ps[i], qts[i]).to(out_dtype)
        torch.testing.assert_close(outs[i], expected, rtol=1e-2, atol=1e-2, msg=f"layer {i}")


def test_opcheck():
    grads, residuals, qts = bucket()
    finite = torch.tensor([True] * len(SHAPES))  # (a NaN output would compare unequal to itself)
    opcheck(torch.ops.accordion.powersgd_p_many.default, ([g.reshape(-1) for g in grads],
                                                          [e.clone() for e in residuals], qts, finite))
    ps = [torch.randn(n, r) for n, r in p_shapes()]
    opcheck(torch.ops.accordion.powersgd_qt_many.default, (ps, residuals))
    outs = [torch.empty(n * m) for n, m, _ in SHAPES]
    opcheck(torch.ops.accordion.powersgd_finish_many_.default,
            (residuals, outs, [q.clone() for q in qts], ps, qts, torch.tensor(True)))
    opcheck(torch.ops.accordion.powersgd_settle_many_.default,
            ([e.clone() for e in residuals], ps, qts, torch.tensor(True)))


@pytest.mark.parametrize("args,message", [
    (([torch.randn(4, 3)], [torch.zeros(4, 3)], [torch.zeros(17, 3)]), r"rank must be in \[1, 16\], got 17"),
    (([torch.randn(4, 3)], [torch.zeros(4, 3)], [torch.zeros(1, 2)]), r"Q\^T \(r x m\)"),
    (([torch.randn(5)], [torch.zeros(4, 3)], [torch.zeros(1, 3)]), "grad must be a contiguous tensor of 12 entries"),
    (([torch.randn(4, 3)], [torch.zeros(4, 3).double()], [torch.zeros(1, 3)]), "every residual must be float32"),
    (([torch.randn(4, 3)], [torch.zeros(4, 3)], [torch.zeros(1, 3)], torch.tensor(True)),
     "finite must be a 1-d bool tensor of 1 flags"),
    (([torch.randn(4, 3)], [torch.zeros(4, 3), torch.zeros(4, 3)], [torch.zeros(1, 3)]), "same length"),
], ids=["rank", "qt-shape", "grad-numel", "float64", "0-d-finite", "lengths"])
def test_bad_input_names_the_argument(args, message):
    with pytest.raises(RuntimeError, match=message):
        ops.powersgd_p_many(*args)


def test_bad_input_of_the_later_phases():
    e, q = torch.zeros(4, 3), torch.zeros(1, 3)
    with pytest.raises(RuntimeError, match=r"P \(n x r\)"):
        ops.powersgd_qt_many([torch.zeros(5, 1)], [e])
    with pytest.raises(RuntimeError, match="out must be a contiguous float32, float16 or bfloat16 tensor of 12"):
        ops.powersgd_finish_many_([e], [torch.zeros(11)], [q], [torch.zeros(4, 1)], [q])
    with pytest.raises(RuntimeError, match="ok must be a 0-d bool tensor"):
        ops.powersgd_finish_many_([e], [torch.zeros(12)], [q], [torch.zeros(4, 1)], [q], torch.tensor([True]))
    with pytest.raises(RuntimeError, match="flag must be a 0-d bool tensor"):
        ops.powersgd_settle_many_([e], [torch.zeros(4, 1)], [q], torch.tensor([True]))
    with pytest.raises(ValueError, match="residuals must hold at least one tensor"):
        ops.powersgd_p_many([], [], [])


# --- the exchange: a fixed number of calls per bucket -------------------------------------------

def run_steps(shapes, steps=3, codec=lambda: acc.PowerSGD(rank=2), count=False, per_layer=False, world=2):
    """Per rank, per step: the results (and, with ``count``, the ops dispatched) of a PowerSGD
    compressor on the simulated channel, used as Horovod would. ``per_layer``: the bucket ops
    switched off (every layer through the layer-by-layer path)."""
    def grads_of(rank, step):
        gen = torch.Generator().manual_seed(100 * step + rank)
        return {n: torch.randn(s, generator=gen).to(d) for n, (s, d) in shapes.items()}

    def worker(rank, channel):
        c = codec()
        if per_layer:
            c.bucket.encodes_many = lambda state: False
        comp = acc.AccordionCompressor(c, policy="static")
        comp.engine.use_planes(channel)
        out = []
        for step in range(steps):
            grads = grads_of(rank, step)
            with CountOps() as mode:
                sent = {n: comp.compress_named(n, g) for n, g in grads.items()}
                results = {}
                for n in sorted(sent):
                    averaged = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                    results[n] = comp.decompress(averaged.clone(), sent[n][1])
            out.append((results, {k: v for k, v in mode.counts.items() if k.startswith(("accordion.", "aten.mm",
                                                                                         "aten.addmm"))}))
        return out

    return SimulatedWorld(world).run(worker)


def test_a_bucket_takes_one_call_per_phase_whatever_its_layer_count():
    few = run_steps({f"l{i}": ((32, 48), torch.float32) for i in range(2)})[0]
    many = run_steps({f"l{i}": ((32, 48), torch.float32) for i in range(12)})[0]
    for step in (1, 2):  # the first step agrees on the layout; every later one is the same
        for op in ("powersgd_p_many", "powersgd_qt_many", "powersgd_finish_many_", "powersgd_settle_many_",
                   "orthogonalize_"):
            assert few[step][1].get(f"accordion.{op}") == many[step][1].get(f"accordion.{op}") == 1, op
        assert "aten.mm" not in many[step][1] and "aten.addmm" not in many[step][1], many[step][1]


def test_the_bucket_ops_give_the_layer_by_layer_results():
    """Three steps, error feedback and warm start included, with a bucket mixing the kinds
    of layers the bucket ops leave to the per-layer path (float64, rank above 16)."""
    shapes = {"a": ((32, 48), torch.float32), "b": ((40, 30), torch.float64), "c": ((64, 64), torch.float32),
              "d": ((16, 64), torch.float16)}
    for codec in (lambda: acc.PowerSGD(rank=2), lambda: acc.PowerSGD(rank=20, min_compression_rate=1.0)):
        bucketed, layered = run_steps(shapes, codec=codec), run_steps(shapes, codec=codec, per_layer=True)
        for rank in range(2):
            for step in range(3):
                for n in shapes:
                    got, expected = bucketed[rank][step][0][n], layered[rank][step][0][n]
                    assert got.dtype == expected.dtype == shapes[n][1]
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5,
                                               msg=f"rank {rank}, step {step}, layer {n}")


def test_encodes_many_leaves_float64_high_rank_and_dense_layers_to_the_per_layer_path():
    codec = PowerSGD(rank=4)
    assert codec.bucket.encodes_many(codec.init_state("a", torch.zeros(32, 48)))
    assert not codec.bucket.encodes_many(codec.init_state("b", torch.zeros(32, 48, dtype=torch.float64)))
    assert not codec.bucket.encodes_many(codec.init_state("c", torch.zeros(32, 48), acc.levels.DENSE))
    high = PowerSGD(rank=17, min_compression_rate=1.0)
    assert not high.bucket.encodes_many(high.init_state("d", torch.zeros(64, 64)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(grad_dtype):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    finite = [True, False, True, True, True, True]
    cpu, gpu = bucket(grad_dtype=grad_dtype), bucket("cuda", grad_dtype=grad_dtype)
    p_cpu = ops.powersgd_p_many(*cpu, torch.tensor(finite))
    p_gpu = ops.powersgd_p_many(*gpu, torch.tensor(finite, device="cuda"))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu[1], gpu[1])), "M = grad + e bit for bit"
    torch.testing.assert_close(p_gpu.cpu(), p_cpu, equal_nan=True, **TOL)
    ps = split(p_cpu.nan_to_num(), p_shapes())
    q_cpu = ops.powersgd_qt_many(ps, cpu[1])
    q_gpu = ops.powersgd_qt_many([p.cuda() for p in ps], gpu[1])
    torch.testing.assert_close(q_gpu.cpu(), q_cpu, **TOL)
    qt_avgs = split(q_cpu, qt_shapes())
    for ok in (True, False):
        outs_cpu = [torch.empty(n * m, dtype=grad_dtype) for n, m, _ in SHAPES]
        outs_gpu = [o.cuda() for o in outs_cpu]
        qts_cpu, qts_gpu = [q.clone() for q in cpu[2]], [q.clone() for q in gpu[2]]
        ops.powersgd_finish_many_(cpu[1], outs_cpu, qts_cpu, ps, qt_avgs, torch.tensor(ok))
        ops.powersgd_finish_many_(gpu[1], outs_gpu, qts_gpu, [p.cuda() for p in ps], [q.cuda() for q in qt_avgs],
                                  torch.tensor(ok, device="cuda"))
        for a, b in zip(outs_cpu, outs_gpu):
            torch.testing.assert_close(b.cpu(), a, rtol=1e-2 if grad_dtype != torch.float32 else 1e-5, atol=1e-4)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(qts_cpu, qts_gpu))
    for flag in (False, True):
        ops.powersgd_settle_many_(cpu[1], ps, qt_avgs, torch.tensor(flag))
        ops.powersgd_settle_many_(gpu[1], [p.cuda() for p in ps], [q.cuda() for q in qt_avgs],
                                  torch.tensor(flag, device="cuda"))
        for a, b in zip(cpu[1], gpu[1]):
            torch.testing.assert_close(b.cpu(), a, **TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_more_layers_than_one_launch_holds():
    """More layers than one launch's table (csrc/cuda/kernels.h: kLayersPerLaunch)."""
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    gen = torch.Generator().manual_seed(5)
    dims = torch.randint(1, 300, (70, 2), generator=gen).tolist()
    grads = [torch.randn(n, m, generator=gen) for n, m in dims]
    residuals = [torch.randn(n, m, generator=gen) for n, m in dims]
    qts = [torch.randn(1 + (n + m) % 8, m, generator=gen) for n, m in dims]
    gpu_res = [e.cuda() for e in residuals]
    p_cpu = ops.powersgd_p_many(grads, residuals, qts)
    p_gpu = ops.powersgd_p_many([g.cuda() for g in grads], gpu_res, [q.cuda() for q in qts])
    torch.testing.assert_close(p_gpu.cpu(), p_cpu, **TOL)
    ps = split(p_cpu, [(n, q.shape[0]) for (n, m), q in zip(dims, qts)])
    q_cpu = ops.powersgd_qt_many(ps, residuals)
    q_gpu = ops.powersgd_qt_many([p.cuda() for p in ps], gpu_res)
    torch.testing.assert_close(q_gpu.cpu(), q_cpu, rtol=1e-4, atol=1e-3)


def test_a_state_dict_is_a_copy_that_later_steps_leave_alone():
    """``finish_many`` sets each layer's Q^T in place: a checkpoint (or Elastic's commit)
    taken before a step must not change with it."""
    shapes = {f"l{i}": ((32, 48), torch.float32) for i in range(3)}

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=2), policy="static")
        comp.engine.use_planes(channel)
        saved = None
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            sent = {n: comp.compress_named(n, torch.randn(s, generator=gen)) for n, (s, _) in shapes.items()}
            for n in sorted(sent):
                averaged = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                comp.decompress(averaged.clone(), sent[n][1])
            if step == 1:
                saved = comp.state_dict()
                frozen = {k: v.clone() for k, v in _tensors(saved).items()}
        return all(torch.equal(v, frozen[k]) for k, v in _tensors(saved).items())

    assert all(SimulatedWorld(2).run(worker))


def _tensors(tree, prefix=""):
    """Every tensor in a nested state_dict, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out
