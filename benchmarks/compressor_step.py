"""The compressor's own time per step, without a network: compress + decompress of every
layer of a model's shapes on the in-process simulated channel (one rank, so the collectives
are copies), median over steps. For comparing two versions of the library side by side on
one machine: run it with each on PYTHONPATH, interleaved, several rounds.

    PYTHONPATH=/path/to/checkout .venv/bin/python benchmarks/compressor_step.py --codecs powersgd-r4,topk-1

Prints one CSV line per codec: label, codec, median ms per step, min ms.
"""

from __future__ import annotations

import argparse
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
        comp._channel = channel
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {sorted(CODECS)}")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--label", default="", help="a name for this version, printed first")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.codecs.split(","):
        if name not in CODECS:
            p.error(f"--codecs: unknown {name!r} (known: {', '.join(CODECS)})")
        times = measure(name, args.steps)
        print(f"{args.label},{name},{1000 * statistics.median(times):.2f},{1000 * min(times):.2f}", flush=True)


if __name__ == "__main__":
    main()
