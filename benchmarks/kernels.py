"""Kernel microbenchmarks: our accordion:: ops against the plain-torch pipeline they replace
and against the memory-traffic floor, measured side by side in one run.

    .venv/bin/python benchmarks/kernels.py                 # CPU, writes results/kernels-cpu.md
    .venv/bin/python benchmarks/kernels.py --device cuda   # GPU, writes results/kernels-cuda-<gpu>.md

The floor of a memory-bound op is the bytes it must move divided by the bandwidth of a
plain device copy, measured in the same run. Buffers rotate through a pool larger than the
last-level cache, so no timing is served from cache. Machines here are shared and noisy:
read the ratios (measured back to back), not the absolute times.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import accordion_hvd as acc

RESULTS = Path(__file__).resolve().parent / "results"
POOL_BYTES = 256 << 20  # rotate through at least this much memory (> any L2/LLC here)


@dataclass
class Case:
    """One op at one size: how to make inputs, ours, torch's, and the bytes it must move."""
    name: str
    make: Callable[[int, torch.dtype, torch.device], tuple]
    ours: Callable
    torch_pipeline: Callable
    bytes_moved: Callable[[int, torch.dtype], int]


def _ef_add_inputs(n, dtype, device):
    return torch.randn(n, device=device).to(dtype), torch.randn(n, device=device, dtype=torch.float32)


CASES = [
    # Half-precision gradient into a float32 residual, in place: residual += grad.
    Case("ef_add_ (grad -> fp32 residual)", _ef_add_inputs,
         ours=lambda g, r: acc.ops.ef_add_(g, r),
         torch_pipeline=lambda g, r: r.add_(g),
         bytes_moved=lambda n, dt: n * (torch.finfo(dt).bits // 8 + 4 + 4)),
]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, pool, device, reps):
    """Median seconds of fn(*args) over reps calls, cycling through the input pool."""
    for args in pool[:2]:
        fn(*args)  # warm-up
    times = []
    for i in range(reps):
        args = pool[i % len(pool)]
        sync(device)
        t0 = time.perf_counter()
        fn(*args)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(n_bytes, device, reps):
    """Bytes per second of a plain device copy of n_bytes (read + write counted)."""
    count = max(2, POOL_BYTES // max(n_bytes, 1))
    pool = [(torch.zeros(n_bytes, dtype=torch.uint8, device=device),  # pages touched up front
             torch.ones(n_bytes, dtype=torch.uint8, device=device)) for _ in range(count)]
    seconds = time_fn(lambda dst, src: dst.copy_(src), pool, device, reps)
    return 2 * n_bytes / seconds


def machine_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="1e6,1e7", help="comma-separated element counts")
    p.add_argument("--dtypes", default="float16,bfloat16,float32")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, help="markdown file to write (default: results/kernels-<device>.md)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU on this machine")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]

    rows = []
    for case in CASES:
        for n in sizes:
            for dtype in dtypes:
                one = sum(t.numel() * t.element_size() for t in case.make(1, dtype, device))
                pool = [case.make(n, dtype, device) for _ in range(max(2, POOL_BYTES // (one * n)))]
                ours = time_fn(case.ours, pool, device, args.reps)
                ref = time_fn(case.torch_pipeline, pool, device, args.reps)
                bandwidth = copy_bandwidth(n * 4, device, args.reps)
                floor = case.bytes_moved(n, dtype) / bandwidth
                rows.append((case.name, n, str(dtype).removeprefix("torch."), ours, ref, floor, bandwidth))
                print(f"{case.name:34s} n={n:>10,d} {rows[-1][2]:9s} ours {ours*1e3:8.3f} ms  "
                      f"torch {ref*1e3:8.3f} ms  ({ref/ours:4.2f}x)  floor {floor*1e3:8.3f} ms "
                      f"(ours/floor {ours/floor:4.2f})", flush=True)

    name = machine_name(device)
    lines = [
        f"# Kernel benchmarks ({device.type})", "",
        f"Machine: {name}; torch {torch.__version__}. Command: "
        f"`.venv/bin/python benchmarks/kernels.py --device {device.type} --sizes {args.sizes} "
        f"--dtypes {args.dtypes} --reps {args.reps}`. Median of {args.reps} calls, inputs rotating "
        f"through {POOL_BYTES >> 20} MiB. *floor* = bytes the op must move / bandwidth of a plain "
        f"copy measured in the same run. On CPUs a copy also reads its destination before writing "
        f"it (write-allocate), which an in-place op does not pay twice: ours/floor can dip below 1.", "",
        "| op | n | grad dtype | ours (ms) | torch (ms) | torch / ours | floor (ms) | ours / floor | copy GB/s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op, n, dt, ours, ref, floor, bw in rows:
        lines.append(f"| {op} | {n:.0e} | {dt} | {ours*1e3:.3f} | {ref*1e3:.3f} | {ref/ours:.2f}x | "
                     f"{floor*1e3:.3f} | {ours/floor:.2f} | {bw/1e9:.1f} |")
    out = args.out or RESULTS / (f"kernels-{device.type}.md" if device.type == "cpu" else
                                 f"kernels-cuda-{name.replace(' ', '_')}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
