"""Kernel microbenchmarks: our accordion:: ops against the plain-torch pipeline they replace,
against a plain copy of the same tensor and against the memory-traffic floor, measured side
by side in one run.

    .venv/bin/python benchmarks/kernels.py                 # CPU, writes results/kernels-cpu.md
    .venv/bin/python benchmarks/kernels.py --device cuda   # GPU, writes results/kernels-cuda-<gpu>.md
    .venv/bin/python benchmarks/kernels.py --ops quantize --out results/kernels-quantize-cpu.md
                                     # only the cases whose name holds one of --ops, to the file --out

*copy* is the time of a plain device copy of an n-entry float32 tensor; *floor* is the
bytes an op must move divided by the copy bandwidth. Buffers rotate through a pool larger
than the last-level cache, so no timing is served from cache; an op that changes its
inputs (error feedback) gets them restored, untimed, half a pool ahead of their next use.
Machines here are shared and noisy: read the ratios (measured back to back), not the
absolute times.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.codecs._common import flush_whole_in_torch, settle_sent_in_torch
from accordion_hvd.codecs.quantize import dequantize_flat, quantize_flat
import kernel_chunks as chunks
from machine import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
POOL_BYTES = 512 << 20  # rotate through at least this much memory (> any L2/LLC here)


@dataclass
class Case:
    """One op: how to make inputs, ours, torch's, the bytes it must move, and (for ops that
    change their inputs) how to restore them."""
    name: str
    make: Callable[[int, torch.dtype, torch.device], tuple]
    ours: Callable
    torch_pipeline: Callable
    bytes_moved: Callable[[int, torch.dtype], int]
    restore: Callable | None = None
    max_n: int | None = None  # sizes above it are left out (their inputs are made on the CPU: slow at 1e8)


def _bytes(dtype):
    return torch.finfo(dtype).bits // 8


def _ef_add_inputs(n, dtype, device):
    return torch.randn(n, device=device).to(dtype), torch.randn(n, device=device, dtype=torch.float32)


def _topk_inputs(n, dtype, device):
    grad, residual = _ef_add_inputs(n, dtype, device)
    residual.mul_(0.1)
    return grad, residual, residual.clone()  # the last: pristine residual, for restore


def _torch_topk(grad, residual, k):
    """What a user writes with torch alone: add, abs, topk, gather, zero."""
    residual.add_(grad)
    idx = residual.abs().topk(k, sorted=False).indices
    values = residual[idx]
    residual[idx] = 0
    return values, idx


def _topk_case(ratio):
    def k_of(n):
        return max(1, math.ceil(ratio * n))
    return Case(
        f"topk_ef {100 * ratio:g}%", _topk_inputs,
        ours=lambda g, r, _: acc.ops.topk_ef(g, r, k_of(g.numel())),
        torch_pipeline=lambda g, r, _: _torch_topk(g, r, k_of(g.numel())),
        # read grad and residual, write residual, write k values and indices
        bytes_moved=lambda n, dt: n * (_bytes(dt) + 8) + 8 * k_of(n),
        restore=lambda g, r, pristine: r.copy_(pristine))


def _sparse_inputs(ratio, world=4):
    def make(n, dtype, device):
        k = max(1, math.ceil(ratio * n))
        values = torch.randn(world * k, device=device)
        indices = torch.cat([torch.randperm(n, device=device)[:k] for _ in range(world)]).to(torch.int32)
        return values, indices, n, world, dtype
    return make


def _sparse_case(ratio, world=4):
    return Case(
        f"sparse_average {ratio:.0%} x{world} ranks", _sparse_inputs(ratio, world),
        ours=lambda v, i, n, w, dt: acc.ops.sparse_average(v, i, n, w, dt),
        torch_pipeline=lambda v, i, n, w, dt: reference.sparse_average(v, i, n, w).to(dt),
        # write the dense output, read the gathered entries
        bytes_moved=lambda n, dt: n * _bytes(dt) + 8 * world * max(1, math.ceil(ratio * n)))


def _quantize_inputs(n, dtype, device):
    grad, residual = _ef_add_inputs(n, dtype, device)
    residual.mul_(0.1)
    return grad, residual, residual.clone()  # the last: pristine residual, for restore


def _torch_quantize(grad, residual, bits, chunk=512):
    """What the codec computes in plain torch (codecs/quantize.py's unfused path): e += grad,
    per-chunk absmax scales, round, the payload bytes."""
    codec = acc.Quantize(bits, chunk=chunk)
    g = residual.add_(grad)
    q, scales = quantize_flat(g, bits, chunk)
    pad = codec.payload_bytes(q.numel(), bits) - 4 * scales.numel() - q.numel() * q.element_size()
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8), torch.zeros(pad, dtype=torch.uint8)])


def _quantize_case(bits):
    return Case(
        f"quantize_ef_ {bits} bits", _quantize_inputs,
        ours=lambda g, r, _: acc.ops.quantize_ef_(g, r, bits, 512),
        torch_pipeline=lambda g, r, _: _torch_quantize(g, r, bits),
        # read grad and residual, write residual, write the payload
        bytes_moved=lambda n, dt: n * (_bytes(dt) + 8) + n * bits // 8 + 4 * -(-n // 512),
        restore=lambda g, r, pristine: r.copy_(pristine))


def _quantize_average_inputs(bits, world=4):
    def make(n, dtype, device):
        rows = torch.stack([acc.ops.quantize_ef_(torch.randn(n), torch.zeros(n), bits, 512) for _ in range(world)])
        return rows.to(device), n, bits, dtype
    return make


def _quantize_average_case(bits, world=4):
    def torch_average(rows, n, b, dt):
        codec = acc.Quantize(b, chunk=512)
        total = torch.zeros(n, device=rows.device)
        for row in rows:
            total += dequantize_flat(*codec._parts(row, n, b), n, codec.chunk)
        return (total / rows.shape[0]).to(dt)
    return Case(
        f"quantize_average {bits} bits x{world} ranks", _quantize_average_inputs(bits, world),
        ours=lambda rows, n, b, dt: acc.ops.quantize_average(rows, n, b, 512, dt),
        torch_pipeline=torch_average,
        # read every rank's payload, write the dense output
        bytes_moved=lambda n, dt: world * (n * bits // 8 + 4 * -(-n // 512)) + n * _bytes(dt))


EF_ADD = Case("ef_add_ (grad -> fp32 residual)", _ef_add_inputs,  # in place: residual += grad
              ours=lambda g, r: acc.ops.ef_add_(g, r),
              torch_pipeline=lambda g, r: r.add_(g),
              bytes_moved=lambda n, dt: n * (_bytes(dt) + 4 + 4))


def _wire(dtype):
    """A layer sent whole at 16-bit dense travels in float16, or in its own 16-bit dtype."""
    return torch.float16 if dtype == torch.float32 else dtype


FLUSH_WHOLE = Case("flush_whole (sent whole in 16 bits)",
                   lambda n, dt, dev: (*_ef_add_inputs(n, dt, dev), torch.tensor(True, device=dev)),
                   ours=lambda g, e, f: acc.ops.flush_whole(g, e, _wire(g.dtype), f),
                   torch_pipeline=lambda g, e, f: flush_whole_in_torch(e, g, _wire(g.dtype), f),
                   bytes_moved=lambda n, dt: n * (_bytes(dt) + 4 + 4 + _bytes(_wire(dt))))
SETTLE_SENT = Case("settle_sent_ (what 16 bits rounded away)",
                   lambda n, dt, dev: (torch.randn(n, device=dev), _wire(dt), torch.tensor(True, device=dev)),
                   ours=acc.ops.settle_sent_, torch_pipeline=settle_sent_in_torch,
                   bytes_moved=lambda n, dt: n * (4 + 4))
CHUNKS_STEP = Case(f"quantize_chunks step {chunks.BITS} bits, skip {chunks.SKIP}", chunks.step_inputs,
                   ours=chunks.step_ours, torch_pipeline=chunks.step_torch, bytes_moved=chunks.step_bytes,
                   restore=chunks.step_restore)
CHUNKS_AVERAGE = Case(f"quantize_chunks_average {chunks.BITS} bits x{chunks.WORLD} ranks", chunks.average_inputs,
                      ours=chunks.average_ours, torch_pipeline=chunks.average_torch, bytes_moved=chunks.average_bytes)
CASES = {
    "cpu": [EF_ADD, FLUSH_WHOLE, SETTLE_SENT, _topk_case(0.01), _topk_case(0.10), _sparse_case(0.01), _sparse_case(0.10),
            _quantize_case(8), _quantize_average_case(8), CHUNKS_STEP, CHUNKS_AVERAGE],
    # The GPU issue's grid: ratios 0.1% to 25%.
    "cuda": [EF_ADD, FLUSH_WHOLE, SETTLE_SENT] + [_topk_case(r) for r in (0.001, 0.01, 0.10, 0.25)]
            + [_sparse_case(0.01), _sparse_case(0.10)]
            + [replace(c, max_n=10 ** 7) for c in (_quantize_case(8), _quantize_average_case(8), CHUNKS_STEP,
                                                   CHUNKS_AVERAGE)],
}
DEFAULT_SIZES = {"cpu": "1e6,1e7", "cuda": "1e6,1e7,1e8"}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, pool, device, reps, restore=None):
    """Median seconds of fn(*args) over reps calls, cycling through the input pool."""
    for args in pool[:2]:
        fn(*args)  # warm-up
    if restore:
        for args in pool:
            restore(*args)
    times = []
    for i in range(reps):
        args = pool[i % len(pool)]
        sync(device)
        if device.type == "cuda":  # device time between two events: no host-sync overhead
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        if restore:  # untimed, and far from the next use of these buffers
            restore(*pool[(i + len(pool) // 2) % len(pool)])
    return statistics.median(times)


def peak_extra_bytes(fn, args, device):
    """Device memory an op allocates beyond its inputs at its peak (outputs and workspace
    included); CUDA only (the caching allocator keeps the count)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn(*args)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak


def copy_bandwidth(n_bytes, device, reps):
    """Bytes per second of a plain device copy of n_bytes (read + write counted)."""
    count = max(2, POOL_BYTES // max(n_bytes, 1))
    pool = [(torch.zeros(n_bytes, dtype=torch.uint8, device=device),  # pages touched up front
             torch.ones(n_bytes, dtype=torch.uint8, device=device)) for _ in range(count)]
    seconds = time_fn(lambda dst, src: dst.copy_(src), pool, device, reps)
    return 2 * n_bytes / seconds


def tensor_bytes(args):
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


# --- PowerSGD: all layers of a model, one step of compression compute ------------------------

RESNET18 = ([(64, 3, 7, 7)] + [(64, 64, 3, 3)] * 4
            + [(128, 64, 3, 3), (128, 128, 3, 3), (128, 64, 1, 1), (128, 128, 3, 3), (128, 128, 3, 3)]
            + [(256, 128, 3, 3), (256, 256, 3, 3), (256, 128, 1, 1), (256, 256, 3, 3), (256, 256, 3, 3)]
            + [(512, 256, 3, 3), (512, 512, 3, 3), (512, 256, 1, 1), (512, 512, 3, 3), (512, 512, 3, 3)]
            + [(1000, 512)])


BERT_BASE = ([(30522, 768), (512, 768), (2, 768)]
             + [(768, 768)] * 4 * 12 + [(3072, 768), (768, 3072)] * 12 + [(768, 768)])
MODELS = {"ResNet-18": RESNET18, "BERT-base": BERT_BASE}


def powersgd_step_layers(codec, states, grads, flags=None):
    """The codec's layer-by-layer path, with averaging the identity (one rank)."""
    ps = [codec.start(s, g) for s, g in zip(states, grads)]
    qs = codec.middle(states, ps)
    out = [codec.finish(s, q, g) for s, q, g in zip(states, qs, grads)]
    for s in states:
        codec.settle(s)
    return out


def _split(flat, shapes):
    return [t.view(s) for t, s in zip(torch.split(flat, [a * b for a, b in shapes]), shapes)]


def powersgd_step_ours(codec, states, grads, flags):
    """The codec's bucket path, the one the exchange takes (all layers as one bucket; the
    averaging the identity): one call per phase. ``flags``: (finite per layer, True), made
    once, as the exchange has them on the device."""
    finite, done = flags
    p = codec.bucket.start_many(states, grads, finite)
    qt = codec.bucket.middle_many(states, _split(p, [(s.residual.shape[0], s.rank) for s in states]))
    out = codec.bucket.finish_many(states, _split(qt, [(s.rank, s.residual.shape[1]) for s in states]), grads, None)
    codec.bucket.settle_many(states, done)
    return out


def powersgd_step_reference(layers, orthogonalize=reference.orthogonalize_):
    """Per layer, in plain torch, as one would write it from the paper."""
    out = []
    for grad, e, q in layers:
        m = grad.reshape(e.shape) + e
        p = orthogonalize(m @ q)
        q_new = m.t() @ p
        m_hat = p @ q_new.t()
        e.copy_(m - m_hat)
        out.append(m_hat.view(grad.shape))
    return out


def _hook_orthogonalize(p):
    """PyTorch's PowerSGD hook orthogonalizes each tensor's P as a batch of one (its default,
    batch_tensors_with_same_shape=False): Gram-Schmidt in torch ops for rank <= 2, else QR."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
    _orthogonalize(p.unsqueeze(0), 1e-8)
    return p


def powersgd_step_hook(layers):
    """The compression math of DDP's powerSGD_hook on the same tensors, allreduce left out."""
    return powersgd_step_reference(layers, _hook_orthogonalize)


def bench_powersgd(shapes, rank, reps, device):
    codec = acc.PowerSGD(rank=rank, min_compression_rate=1.0)
    shapes = [s for s in shapes if codec.compressible(torch.Size(s))]
    copies = max(2, POOL_BYTES // (8 * sum(math.prod(s) for s in shapes)))
    pool_ours, pool_ref = [], []
    for _ in range(copies):
        grads = [torch.randn(s, device=device) for s in shapes]
        states = [codec.init_state(f"layer{i}", g) for i, g in enumerate(grads)]
        flags = (torch.ones(len(states), dtype=torch.bool, device=device), torch.tensor(True, device=device))
        assert all(codec.encodes_many(s) for s in states)
        pool_ours.append((codec, states, grads, flags))
        pool_ref.append(([(g.clone(), s.residual.clone(), s.q.clone()) for g, s in zip(grads, states)],))
    ours = time_fn(powersgd_step_ours, pool_ours, device, reps)
    layers = time_fn(powersgd_step_layers, pool_ours, device, reps)
    # On the GPU the peer is PyTorch's own hook; on the CPU the plain per-layer reference.
    ref = time_fn(powersgd_step_hook if device.type == "cuda" else powersgd_step_reference, pool_ref, device, reps)
    params = sum(math.prod(s) for s in shapes)
    state_floats = sum(s.residual.numel() + s.q.numel() for s in pool_ours[0][1])
    return params, len(shapes), ours, layers, ref, state_floats


def topk_model_ours(grads, residuals, ks):
    return acc.ops.topk_ef_many(grads, residuals, ks)


def topk_model_torch(grads, residuals, ks):
    return [_torch_topk(g, r, k) for g, r, k in zip(grads, residuals, ks)]


def bench_topk_model(shapes, ratio, reps, device, bandwidth):
    """Every layer of a model in one ``topk_ef_many`` call (what the exchange does per bucket,
    here the whole model as one bucket) against the torch pipeline layer by layer; float32
    gradients. Returns (parameters, layers, ours, torch, floor) in seconds."""
    numels = [math.prod(s) for s in shapes]
    ks = [max(1, math.ceil(ratio * n)) for n in numels]
    params = sum(numels)
    pool = []
    for _ in range(max(2, POOL_BYTES // (8 * params))):
        grads = [torch.randn(n, device=device) for n in numels]
        residuals = [0.1 * torch.randn(n, device=device) for n in numels]
        pool.append((grads, residuals, ks))
    pristine = [[r.clone() for r in residuals] for _, residuals, _ in pool]
    index = {id(args[1]): i for i, args in enumerate(pool)}

    def restore(grads, residuals, ks):
        for r, p in zip(residuals, pristine[index[id(residuals)]]):
            r.copy_(p)
    ours = time_fn(topk_model_ours, pool, device, reps, restore)
    ref = time_fn(topk_model_torch, pool, device, reps, restore)
    floor = (12 * params + 8 * sum(ks)) / bandwidth  # grad read, e read and written, k values and indices
    return params, len(shapes), ours, ref, floor


def machine_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


POWERSGD_FLOOR_BYTES_PER_PARAM = 28

PSGD_NOTES = {
    "cpu": ["", "*torch* is the same math layer by layer in plain torch. It allocates three "
            "gradient-sized temporaries per layer, and its time depends on whether glibc serves them "
            "from the heap or maps fresh pages (page faults) for each: about 18 ms (rank 1) in some "
            "processes, 30 to 35 ms in others, run to run. `MALLOC_MMAP_THRESHOLD_=1000000000` pins it "
            "to the fast case. Ours allocates nothing gradient-sized and takes the same time either "
            "way. Read the fast-case ratio as the bar."],
    "cuda": ["", "*torch* is the compression math of PyTorch's own `powerSGD_hook` on the same tensors "
             "(its `_orthogonalize`: Gram-Schmidt in torch ops for rank <= 2, batched QR above; "
             "epsilon 1e-8; one tensor per batch, its default), allreduce left out."],
}

MEMORY_NOTES = [
    "", "## Extra memory per compressed layer", "",
    "- Both codecs: the error-feedback buffer, one float32 tensor of the layer's size (the "
    "only gradient-sized state).",
    "- PowerSGD: Q (m x r floats) kept between steps, P (n x r) during a step; M = grad + e is "
    "formed in the error-feedback buffer and M_hat written into the spent gradient, so a "
    "float32 step allocates nothing gradient-sized (a 16-bit gradient needs one float32 "
    "M_hat during `finish`).",
    "- TopK on the CPU: per step, the k values and int32 indices sent (8k bytes) and, inside the "
    "kernel, an 8-byte record (key, sign, index) per candidate, about 1.15 k of them and never "
    "more than 3k + 65,536 (past that the kernel scans g instead), plus room for a copy of the "
    "band around the threshold: at most 16 (3k + 65,536) bytes.",
    "- TopK on CUDA: the 8k output bytes and a workspace: the candidate slices, 8 bytes x "
    "(1.3 k/n + 1%) of n + 2 KiB per block, and about 40 KiB of histograms and per-block "
    "counters; the table's *peak extra* column measures it.",
    "- Decoding writes one dense float32 vector (plus its copy in the gradient's dtype when "
    "that is 16-bit).",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", help="comma-separated element counts (default: 1e6,1e7 on cpu, "
                   "1e6,1e7,1e8 on cuda)")
    p.add_argument("--dtypes", default="float16,float32")
    p.add_argument("--ops", default="", help="only cases whose name contains one of these (comma-separated)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, help="markdown file to write (default: results/kernels-<device>.md)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU on this machine")
    args.sizes = args.sizes or DEFAULT_SIZES[device.type]
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    wanted = [w for w in args.ops.split(",") if w]
    cases = [c for c in CASES[device.type] if not wanted or any(w in c.name for w in wanted)]

    rows = []
    for case in cases:
        for n in sizes:
            if case.max_n is not None and n > case.max_n:
                continue
            for dtype in dtypes:
                one = max(tensor_bytes(case.make(n, dtype, device)), case.bytes_moved(n, dtype))
                pool = [case.make(n, dtype, device) for _ in range(max(4, POOL_BYTES // one))]
                ours = time_fn(case.ours, pool, device, args.reps, case.restore)
                ref = time_fn(case.torch_pipeline, pool, device, args.reps, case.restore)
                extra = peak_extra_bytes(case.ours, pool[0], device)
                del pool
                bandwidth = copy_bandwidth(n * 4, device, args.reps)
                copy = 2 * n * 4 / bandwidth
                floor = case.bytes_moved(n, dtype) / bandwidth
                rows.append((case.name, n, str(dtype).removeprefix("torch."), ours, ref, copy, floor, bandwidth,
                             extra))
                print(f"{case.name:34s} n={n:>10,d} {rows[-1][2]:9s} ours {ours*1e3:8.3f} ms  "
                      f"torch {ref*1e3:8.3f} ms ({ref/ours:5.2f}x)  ours/copy {ours/copy:5.2f}  "
                      f"ours/floor {ours/floor:4.2f}", flush=True)

    psgd_rows = []
    if not wanted or any("powersgd" in w for w in wanted):
        models = MODELS if device.type == "cuda" else {"ResNet-18": RESNET18}
        ranks = (1, 2, 4, 8) if device.type == "cuda" else (1, 4)
        bandwidth = copy_bandwidth(64 << 20, device, args.reps)
        for model, shapes in models.items():
            for rank in ranks:
                params, layers, ours, by_layer, ref, state = bench_powersgd(shapes, rank, args.reps, device)
                floor = POWERSGD_FLOOR_BYTES_PER_PARAM * params / bandwidth
                psgd_rows.append((model, rank, params, layers, ours, by_layer, ref, state, floor))
                print(f"powersgd {model} rank {rank}: ours {ours*1e3:.3f} ms (layer by layer "
                      f"{by_layer*1e3:.3f} ms), torch {ref*1e3:.3f} ms ({ref/ours:.2f}x), ours/floor "
                      f"{ours/floor:.2f}", flush=True)

    model_rows = []
    if not wanted or any(w in "topk_ef_many" for w in wanted):
        bandwidth = copy_bandwidth(64 << 20, device, args.reps)
        models = MODELS if device.type == "cuda" else {"ResNet-18": RESNET18}
        for model, shapes in models.items():
            for ratio in (0.001, 0.01, 0.1, 0.25) if device.type == "cuda" else (0.01, 0.1):
                params, layers, ours, ref, floor = bench_topk_model(shapes, ratio, args.reps, device, bandwidth)
                model_rows.append((model, ratio, params, layers, ours, ref, floor))
                print(f"topk_ef_many {model} {100 * ratio:g}%: ours {ours*1e3:.3f} ms, torch {ref*1e3:.3f} ms "
                      f"({ref/ours:.2f}x), ours/floor {ours/floor:.2f}", flush=True)

    name = machine_name(device)
    cuda = device.type == "cuda"
    lines = [
        f"# Kernel benchmarks ({device.type})", "",
        f"Machine: {name}; torch {torch.__version__}. Command: "
        f"`.venv/bin/python benchmarks/kernels.py --device {device.type} --sizes {args.sizes} "
        f"--dtypes {args.dtypes} --reps {args.reps}{' --ops ' + args.ops if args.ops else ''}`. Median of {args.reps} calls, inputs rotating "
        f"through at least {POOL_BYTES >> 20} MiB. *copy* = a plain copy of an n-entry float32 "
        f"tensor, measured in the same run; *floor* = bytes the op must move / that copy's "
        f"bandwidth." + (" Device times between CUDA events; *peak extra* = the most device memory "
                         "the op held beyond its inputs (outputs and workspace included)." if cuda else
                         " On CPUs a copy also reads its destination before writing it (write-allocate), "
                         "which an in-place op does not pay twice: ours/floor can dip below 1."), "",
        "| op | n | grad dtype | ours (ms) | torch (ms) | torch / ours | copy (ms) | ours / copy | "
        "floor (ms) | ours / floor | copy GB/s |" + (" peak extra (MiB) |" if cuda else ""),
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if cuda else ""),
    ]
    for op, n, dt, ours, ref, copy, floor, bw, extra in rows:
        lines.append(f"| {op} | {n:.0e} | {dt} | {ours*1e3:.3f} | {ref*1e3:.3f} | {ref/ours:.2f}x | "
                     f"{copy*1e3:.3f} | {ours/copy:.2f} | {floor*1e3:.3f} | {ours/floor:.2f} | {bw/1e9:.1f} |"
                     + (f" {extra / 2**20:.1f} |" if cuda else ""))
    if model_rows:
        lines += ["", "## TopK for every layer of a model in one call", "",
                  "`topk_ef_many` over all the model's weight matrices as one bucket (float32 gradients), "
                  "against the torch pipeline (add, abs, topk, gather, zero) layer by layer. *floor* = (12 "
                  "bytes per parameter + 8 per kept entry) / copy bandwidth: grad read, e read and written, "
                  "values and indices written.", "",
                  "| model | ratio | layers | parameters | ours (ms) | torch (ms) | torch / ours | floor (ms) | "
                  "ours / floor |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for model, ratio, params, layers, ours, ref, floor in model_rows:
            lines.append(f"| {model} | {100 * ratio:g}% | {layers} | {params:,} | {ours*1e3:.3f} | {ref*1e3:.3f} | "
                         f"{ref/ours:.2f}x | {floor*1e3:.3f} | {ours/floor:.2f} |")
    if psgd_rows:
        lines += ["", "## PowerSGD compression compute, all layers of a model", "",
                  "One step with averaging left out (one rank): error-feedback add, P = MQ, "
                  "orthogonalization, Q = M^T P, M_hat = PQ^T, e = M - M_hat. *ours* is the path the "
                  "exchange takes, the bucket ops with every layer in one bucket: `start_many` (the add "
                  "fused with P = MQ), `middle_many` (one Gram-Schmidt call, then Q^T = P^T M), "
                  "`finish_many` (M_hat into the spent gradient), `settle_many`. *by layer* is the "
                  "codec's layer-by-layer path (`start`, `middle`, `finish`, `settle`), which float64 "
                  "layers and ranks above 16 take. On the CPU the products go through BLAS; on GPUs "
                  "*ours* is our segmented kernels, *by layer* and *torch* cuBLAS. *floor* = 28 bytes per "
                  "parameter / copy bandwidth: grad read, e read and written by the add fused into the "
                  "first product, e read by the second product, e read and written and M_hat written by "
                  "the last step."]
        lines += PSGD_NOTES[device.type]
        lines += ["", "| model | rank | layers | parameters | ours (ms) | by layer (ms) | torch (ms) | torch / ours | "
                  "floor (ms) | ours / floor | state kept (floats) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for model, rank, params, layers, ours, by_layer, ref, state, floor in psgd_rows:
            lines.append(f"| {model} | {rank} | {layers} | {params:,} | {ours*1e3:.3f} | {by_layer*1e3:.3f} | "
                         f"{ref*1e3:.3f} | {ref/ours:.2f}x | {floor*1e3:.3f} | {ours/floor:.2f} | "
                         f"{state:,} (= parameters + {state - params:,}) |")
    lines += MEMORY_NOTES
    out = args.out or RESULTS / (f"kernels-{device.type}.md" if device.type == "cpu" else
                                 f"kernels-cuda-{name.replace(' ', '_')}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
