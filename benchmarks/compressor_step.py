"""The compressor's own time per step, without a network: compress + decompress of every
layer of a model's shapes on the in-process simulated channel (one rank, so the collectives
are copies), median over steps. For comparing two versions of the library side by side on
one machine: run it with each on PYTHONPATH, interleaved, several rounds.

    PYTHONPATH=/path/to/checkout .venv/bin/python benchmarks/compressor_step.py --codecs powersgd-r4,topk-1

Prints one CSV line per codec: label, codec, median ms per step, min ms. With ``--table
CSV`` (rows ``round,version,codec,median_ms,min_ms`` from such runs, two versions) it prints
the Markdown table of the second version's time over the first's, per codec: the median of
the per-round ratios and their range.
"""

from __future__ import annotations

import argparse
import collections
import csv
import statistics
import time

import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld

# CIFAR-style ResNet-18's weight shapes (the compressed layers), as benchmarks/kernels.py has them.
RESNET18 = ([(64, 3, 3, 3)] + [(64, 64, 3, 3)] * 4
            + [(128, 64, 3, 3), (128, 128, 3, 3), (128, 64, 1, 1), (128, 128, 3, 3), (128, 128, 3, 3)]
            + [(256, 128, 3, 3), (256, 256, 3, 3), (256, 128, 1, 1), (256, 256, 3, 3), (256, 256, 3, 3)]
            + [(512, 256, 3, 3), (512, 512, 3, 3), (512, 256, 1, 1), (512, 512, 3, 3), (512, 512, 3, 3)]
            + [(10, 512)])
CODECS = {
    "powersgd-r1": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1), policy="static"),
    "powersgd-r4": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=4), policy="static"),
    "powersgd-accordion": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=1000),
    "topk-1": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.01), policy="static"),
    "topk-accordion": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.01, critical_ratio=0.1), interval=1000),
}


def measure(name: str, steps: int) -> list[float]:
    shapes = {f"layer{i}.weight": s for i, s in enumerate(RESNET18)}
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}

    def worker(rank, channel):
        comp = CODECS[name]()
        comp.engine.use_planes(channel)
        times = []
        for _ in range(steps):
            step = {n: g.clone() for n, g in grads.items()}  # the compressor consumes its input
            started = time.perf_counter()
            sent = {n: comp.compress_named(n, step[n]) for n in reversed(list(step))}  # backward order
            for n, (out, ctx) in sent.items():
                comp.decompress(out, ctx)
            times.append(time.perf_counter() - started)
        return times[3:]  # the first steps agree on settings and layouts
    return SimulatedWorld(1).run(worker)[0]


def table(path: str) -> list[str]:
    """Per codec: each version's median ms (median over rounds) and the per-round ratio."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    versions = list(dict.fromkeys(r["version"] for r in rows))
    if len(versions) != 2:
        raise SystemExit(f"--table: expected two versions in {path}, got {versions}")
    first, second = versions
    by = collections.defaultdict(dict)
    for r in rows:
        by[r["codec"]].setdefault(r["round"], {})[r["version"]] = float(r["median_ms"])
    out = [f"| codec | rounds | {first}: ms per step | {second}: ms per step | {second} / {first}: median | range |",
           "|---|---|---|---|---|---|"]
    for codec, rounds in by.items():
        paired = [v for v in rounds.values() if first in v and second in v]
        ratios = [v[second] / v[first] for v in paired]
        out.append(f"| {codec} | {len(paired)} | {statistics.median(v[first] for v in paired):.1f} | "
                   f"{statistics.median(v[second] for v in paired):.1f} | {statistics.median(ratios):.3f} | "
                   f"{min(ratios):.3f} - {max(ratios):.3f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {sorted(CODECS)}")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--label", default="", help="a name for this version, printed first")
    p.add_argument("--table", metavar="CSV", help="print the comparison table of a CSV of runs instead")
    args = p.parse_args()
    if args.table:
        print("\n".join(table(args.table)))
        return
    torch.set_num_threads(1)
    for name in args.codecs.split(","):
        if name not in CODECS:
            p.error(f"--codecs: unknown {name!r} (known: {', '.join(CODECS)})")
        times = measure(name, args.steps)
        print(f"{args.label},{name},{1000 * statistics.median(times):.2f},{1000 * min(times):.2f}", flush=True)


if __name__ == "__main__":
    main()
