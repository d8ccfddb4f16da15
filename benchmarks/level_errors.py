"""What NetworkAware's level errors cost at a window's end: PowerSGD's ``level_errors`` for
every layer of ResNet-18 (rank 1, 4 and dense), in float32 products as the codec runs them,
against the same computation in float64 throughout (what it did before), side by side in
one process on one thread, interleaved repeats; and how far the two results are apart.

    .venv/bin/python benchmarks/level_errors.py --out benchmarks/results/level-errors.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import accordion_hvd as acc  # noqa: E402
from accordion_hvd.cli import models  # noqa: E402
from accordion_hvd.levels import CRITICAL, DENSE, NORMAL  # noqa: E402
from machine import cpu_model  # noqa: E402

LEVELS = (NORMAL, CRITICAL, DENSE)


def float64_errors(codec, state, grad) -> list[float]:
    """The codec's level_errors with every product in float64 (its earlier version)."""
    n, m = state.residual.shape
    M = grad.reshape(n, m).to(torch.float64) + state.residual.to(torch.float64)
    ranks = [codec.level_rank(level, state.shape) for level in LEVELS]
    start = codec._fresh_columns(state.name, m, 0, max(ranks), torch.float64, M.device)
    p = torch.linalg.qr(M @ start).Q
    p = torch.linalg.qr(M @ (M.t() @ p)).Q
    kept = torch.cumsum((p.t() @ M).square().sum(dim=1), 0)
    total = float(M.square().sum())
    return [max(0.0, total - float(kept[r - 1])) if r > 0 else 0.0 for r in ranks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "level-errors.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = models.ResNet18(num_classes=10, channels=3)
    codec = acc.PowerSGD(rank=1, critical_rank=4)
    layers = [(n, prm) for n, prm in net.named_parameters() if prm.dim() > 1]
    states = {n: codec.init_state(n, prm.detach()) for n, prm in layers}
    for state in states.values():
        state.residual.copy_(0.1 * torch.randn_like(state.residual))
    grads = {n: torch.randn_like(prm) for n, prm in layers}
    ways = {"float32 products (the codec)": lambda n: codec.level_errors(states[n], grads[n], LEVELS),
            "float64 throughout": lambda n: float64_errors(codec, states[n], grads[n])}
    seconds = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, run in ways.items():
            started = time.perf_counter()
            for n, _ in layers:
                run(n)
            seconds[way].append(time.perf_counter() - started)
    worst = max(abs(a / b - 1) for n, _ in layers
                for a, b in zip(codec.level_errors(states[n], grads[n], LEVELS), float64_errors(codec, states[n],
                                                                                             grads[n])) if b)
    lines = ["# NetworkAware's level errors at a window's end: float32 against float64", "",
             f"Machine: {platform.node()}, {cpu_model()}, {os.cpu_count()} cores, 1 thread. ResNet-18's "
             f"{len(layers)} weight layers, PowerSGD levels rank 1, rank 4 and dense, random gradients and error "
             f"feedback; {args.repeats} interleaved repeats. Command: "
             f"`.venv/bin/python benchmarks/level_errors.py --out {os.path.relpath(args.out, REPO)}`.", "",
             "| computation | seconds per window, median (range) |", "|---|---|"]
    for way, times in seconds.items():
        lines.append(f"| {way} | {statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) |")
    ratio = statistics.median(seconds["float64 throughout"]) / statistics.median(seconds["float32 products (the codec)"])
    lines += ["", f"float64 / float32: {ratio:.2f}x. Largest relative difference of an error between the two: "
              f"{worst:.1e}.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
