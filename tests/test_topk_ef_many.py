"""accordion::topk_ef_many (a bucket's TopK in one call) and accordion::restore_many_if_,
against the one-layer op they batch (itself tested against the plain-torch reference in
test_topk_ef.py), and the exchange's use of them: one call per bucket, whatever the layer
count."""

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.comm.simulated import SimulatedWorld
from dispatch_count import CountOps

NAN = float("nan")


def bucket(device="cpu", seed=0, grad_dtype=torch.float32):
    """Layers of a bucket as the codec passes them: flat gradients and float32 residuals,
    sizes from one entry to a ResNet-style conv, with ties and a layer at k = 0 and k = n."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1728, 73728, 5120, 7, 1, 4096]
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    grads[5] = torch.randint(-3, 4, (4096,), generator=gen).to(grad_dtype)  # many ties
    residuals = [0.1 * torch.randn(n, generator=gen) for n in sizes]
    residuals[5].zero_()
    ks = [17, 737, 51, 7, 0, 300]
    return [g.to(device) for g in grads], [r.to(device) for r in residuals], ks


def parts(payload, ks):
    """Each layer's (values, indices) inside a payload."""
    out, offset = [], 0
    for k in ks:
        out.append((payload[offset:offset + 4 * k].view(torch.float32), payload[offset + 4 * k:offset + 8 * k].view(torch.int32)))
        offset += 8 * k
    return out


def one_by_one(grads, residuals, ks, finite=None):
    """The same work with the one-layer op: (values, indices, g_sq, kept_sq) per layer."""
    out = []
    for i, (g, r, k) in enumerate(zip(grads, residuals, ks)):
        flag = None if finite is None else finite[i]
        out.append(acc.ops.topk_ef(g, r, k, flag))
    return out


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equals_the_one_layer_op_layer_by_layer(grad_dtype):
    grads, residuals, ks = bucket(grad_dtype=grad_dtype)
    expected_residuals = [r.clone() for r in residuals]
    expected = one_by_one(grads, expected_residuals, ks)
    payload, g_sq, kept_sq = acc.ops.topk_ef_many(grads, residuals, ks)
    assert payload.dtype == torch.uint8 and payload.numel() == 8 * sum(ks)
    assert g_sq.dtype == kept_sq.dtype == torch.float64 and g_sq.shape == kept_sq.shape == (len(ks),)
    for i, ((v, ix), (ev, eix, eg, ek)) in enumerate(zip(parts(payload, ks), expected)):
        assert torch.equal(v, ev) and torch.equal(ix, eix), f"layer {i}"
        assert torch.equal(residuals[i], expected_residuals[i]), f"layer {i}"
        assert g_sq[i].item() == eg.item() and kept_sq[i].item() == ek.item(), f"layer {i}"


def test_a_layer_flagged_not_finite_sends_nan_and_keeps_its_residual():
    grads, residuals, ks = bucket()
    finite = torch.tensor([True, False, True, True, True, False])
    before = [r.clone() for r in residuals]
    expected_residuals = [r.clone() for r in residuals]
    expected = one_by_one(grads, expected_residuals, ks, [torch.tensor(bool(f)) for f in finite])
    payload, g_sq, kept_sq = acc.ops.topk_ef_many(grads, residuals, ks, finite)
    for i, ((v, ix), (ev, eix, *_)) in enumerate(zip(parts(payload, ks), expected)):
        assert torch.equal(ix, eix), f"layer {i}: the selection of the residual alone"
        if finite[i]:
            assert torch.equal(v, ev) and torch.equal(residuals[i], expected_residuals[i])
        else:
            assert v.isnan().all() and torch.equal(residuals[i], before[i]), f"layer {i}: e untouched"


@pytest.mark.parametrize("flags", [[True] * 6, [False] * 6, [True, False, True, False, True, True]])
def test_restore_puts_the_flagged_layers_back(flags):
    grads, residuals, ks = bucket(seed=1)
    whole = [r + g for r, g in zip(residuals, grads)]  # g = grad + e, what e holds after a restore
    payload, *_ = acc.ops.topk_ef_many(grads, residuals, ks)
    after = [r.clone() for r in residuals]
    acc.ops.restore_many_if_(residuals, payload, ks, torch.tensor(flags))
    for i, flag in enumerate(flags):
        assert torch.equal(residuals[i], whole[i] if flag else after[i]), f"layer {i}"


def test_opcheck():
    grads, residuals, ks = bucket()
    finite = torch.tensor([True, False, True, True, True, True])
    opcheck(torch.ops.accordion.topk_ef_many.default, (grads, [r.clone() for r in residuals], ks, finite))
    payload, *_ = acc.ops.topk_ef_many(grads, [r.clone() for r in residuals], ks)
    opcheck(torch.ops.accordion.restore_many_if_.default,
            ([r.clone() for r in residuals], payload, ks, torch.tensor([True, False] * 3)))


@pytest.mark.parametrize("args,message", [
    (([torch.randn(4)], [torch.zeros(4), torch.zeros(4)], [1]), "must have the same length, got 1, 2 and 1"),
    (([torch.randn(4)], [torch.zeros(4)], [5]), r"ks\[0\] must be in \[0, numel = 4\], got 5"),
    (([torch.randn(4)], [torch.zeros(4).double()], [1]), "residual must have grad's dtype, or float32"),
    (([torch.randn(4)], [torch.zeros(5)], [1]), "same shape"),
    (([torch.randn(4)], [torch.zeros(4)], [1], torch.tensor(True)), "finite must be a 1-d bool tensor of 1 flags"),
    (([torch.randn(4)], [torch.zeros(4)], [1], torch.tensor([1])), "finite must be a 1-d bool tensor"),
], ids=["lengths", "k", "float64-residual", "shapes", "0-d-finite", "int-finite"])
def test_bad_input_names_the_argument(args, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.topk_ef_many(*args)


def test_no_layers_is_an_error():
    with pytest.raises(ValueError, match="grads must hold at least one tensor"):
        acc.ops.topk_ef_many([], [], [])


@pytest.mark.parametrize("args,message", [
    (([torch.zeros(4)], torch.zeros(8, dtype=torch.uint8), [2], torch.tensor([True])), r"8 \* sum\(ks\) = 16 bytes"),
    (([torch.zeros(4)], torch.zeros(16, dtype=torch.uint8), [2], torch.tensor(True)), "flags must be a 1-d bool"),
    (([torch.zeros(4)], torch.zeros(8, dtype=torch.uint8), [1, 0], torch.tensor([True])), "same length"),
], ids=["payload-size", "0-d-flags", "lengths"])
def test_restore_bad_input_names_the_argument(args, message):
    with pytest.raises(RuntimeError, match=message):
        acc.ops.restore_many_if_(*args)


def test_restore_rejects_an_index_outside_the_layer():
    payload = torch.cat([torch.tensor([1.0]).view(torch.uint8), torch.tensor([9], dtype=torch.int32).view(torch.uint8)])
    with pytest.raises(RuntimeError, match=r"index 9 of layer 0 is outside \[0, 4\)"):
        acc.ops.restore_many_if_([torch.zeros(4)], payload, [1], torch.tensor([True]))


# --- the exchange: one call per bucket ------------------------------------------------------

def encode_calls(layers: int, steps: int = 3) -> list[dict]:
    """Per step: the accordion ops one rank's TopK compressor dispatches, 2 ranks, ``layers``
    layers in one bucket (simulated channel, used as Horovod would)."""
    shapes = {f"l{i}": (32, 48) for i in range(layers)}

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.TopK(ratio=0.05), policy="static")
        comp.engine.use_planes(channel)
        per_step = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
            with CountOps() as mode:
                sent = {n: comp.compress_named(n, g) for n, g in grads.items()}
                for n in sorted(sent):
                    averaged = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                    comp.decompress(averaged.clone(), sent[n][1])
            per_step.append({k: v for k, v in mode.counts.items() if k.startswith("accordion.")})
        return per_step

    return SimulatedWorld(2).run(worker)[0]


def test_a_bucket_is_encoded_in_one_call_whatever_its_layer_count():
    few, many = encode_calls(2), encode_calls(12)
    for step in (1, 2):  # the first step agrees on the layout; every later one is the same
        assert few[step].get("accordion.topk_ef_many") == many[step].get("accordion.topk_ef_many") == 1
        assert "accordion.topk_ef" not in many[step]
        assert few[step].get("accordion.restore_many_if_") == many[step].get("accordion.restore_many_if_") == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(grad_dtype):
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    finite = [True, False, True, True, True, True]
    on_cpu, on_gpu = bucket(grad_dtype=grad_dtype), bucket("cuda", grad_dtype=grad_dtype)
    cpu = acc.ops.topk_ef_many(*on_cpu, torch.tensor(finite))
    gpu = acc.ops.topk_ef_many(*on_gpu, torch.tensor(finite, device="cuda"))
    assert torch.equal(cpu[0], gpu[0].cpu())  # bytes: both write the quiet NaN 0x7fc00000 for the poisoned layer
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu[1], on_gpu[1]))
    # g_sq: the CPU kernel adds squares in float lanes within a block (csrc/cpu/topk_pass1.h,
    # relative error below 2e-5, as test_topk_ef.py holds it to the reference); CUDA in double
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=2e-5, atol=0)
    torch.testing.assert_close(gpu[2].cpu(), cpu[2], rtol=1e-12, atol=0)
    flags = [True, False, False, True, True, True]
    acc.ops.restore_many_if_(on_cpu[1], cpu[0], on_cpu[2], torch.tensor(flags))
    acc.ops.restore_many_if_(on_gpu[1], gpu[0], on_gpu[2], torch.tensor(flags, device="cuda"))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu[1], on_gpu[1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cuda_more_layers_than_one_launch_holds():
    """More layers than one launch's segment table (csrc/cuda/topk_ef.cu: kMaxSegments)."""
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 20_000, (100,), generator=gen)]
    residuals = [torch.zeros_like(g) for g in grads]
    ks = [max(0, g.numel() // 20) for g in grads]
    gpu_res = [r.cuda() for r in residuals]  # before the CPU call, which updates `residuals`
    cpu = acc.ops.topk_ef_many(grads, residuals, ks)
    gpu = acc.ops.topk_ef_many([g.cuda() for g in grads], gpu_res, ks)
    assert torch.equal(cpu[0], gpu[0].cpu())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(residuals, gpu_res))


def test_a_bucket_mixing_float32_and_float64_layers():
    """float64 layers have no kernel and are encoded one by one; a bucket holding both kinds
    sends both, each layer the average of every rank's top k (checked against the reference
    over three steps, error feedback included)."""
    shapes = {"a": ((32, 48), torch.float32), "b": ((40, 30), torch.float64), "c": ((16, 64), torch.float32)}
    ratio, steps, world = 0.05, 3, 2

    def grads_of(rank, step):
        gen = torch.Generator().manual_seed(100 * step + rank)
        return {n: torch.randn(s, generator=gen).to(dtype) for n, (s, dtype) in shapes.items()}

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.TopK(ratio=ratio), policy="static")
        comp.engine.use_planes(channel)
        out = []
        for step in range(steps):
            grads = grads_of(rank, step)
            sent = {n: comp.compress_named(n, g) for n, g in grads.items()}
            results = {}
            for n in sorted(sent):
                averaged = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                results[n] = comp.decompress(averaged.clone(), sent[n][1])
            out.append(results)
        return out

    got = SimulatedWorld(world).run(worker)
    residuals = {r: {n: torch.zeros(s, dtype=d).reshape(-1) for n, (s, d) in shapes.items()} for r in range(world)}
    for step in range(steps):
        for n, (shape, dtype) in shapes.items():
            k = acc.TopK(ratio=ratio).level_k(acc.levels.NORMAL, residuals[0][n].numel())
            picked = []
            for r in range(world):
                values, indices, residuals[r][n], *_ = reference.topk_select(
                    grads_of(r, step)[n].reshape(-1), residuals[r][n], k)
                picked.append((values, indices))
            expected = reference.sparse_average(torch.cat([v for v, _ in picked]),
                                                    torch.cat([i for _, i in picked]), residuals[0][n].numel(), world)
            for r in range(world):
                assert got[r][step][n].dtype == dtype
                torch.testing.assert_close(got[r][step][n].reshape(-1), expected.to(dtype), rtol=1e-6, atol=1e-7,
                                           msg=f"step {step}, layer {n}, rank {r}")
