"""Time per step against PyTorch DDP's PowerSGD hook, repeated and interleaved.

    .venv/bin/python benchmarks/step_time.py                     # 4 nodes, 100 Mbit/s and 1 Gbit/s, 5 rounds
    .venv/bin/python benchmarks/step_time.py --nodes 2 --rates 100mbit --rounds 3

benchmarks/e2e.py runs every method once; on this shared 2-core machine one run's median
step time moves by 10% from run to run, as much as the differences it is asked to show.
This benchmark answers one question of the end-to-end issue, "is our step at least as fast
as DDP's PowerSGD hook at the same rank?", with enough repeats to read it: each round runs
every method once, back to back on the same emulated cluster (same task as e2e.py, fewer
epochs: only the step time matters), and the ratio DDP / ours is taken within each round,
so slow phases of the machine hit both sides of a ratio alike. Reported: each method's
median step time over the rounds with its range, and the median and range of the per-round
ratios.

Writes benchmarks/results/step-time.md and step-time.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the task, the methods and how to run them)
from machine import cpu_model  # noqa: E402
from report import kept_analysis  # noqa: E402

PAIRS = [("powersgd-static-r4", "ddp-powersgd-r4"), ("powersgd-static-r1", "ddp-powersgd-r1"),
         ("powersgd-accordion", "ddp-powersgd-r4"), ("powersgd-static-r4-spin", "ddp-powersgd-r4")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--nodes", default="4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--out", type=Path, default=e2e.RESULTS / "step-time.md")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    from cluster import Cluster  # needs root, ip and tc: refuses with one line otherwise

    e2e.COMMON[e2e.COMMON.index("--epochs") + 1] = str(args.epochs)
    methods = list(dict.fromkeys(m for pair in PAIRS for m in pair))
    rows, sections = [], []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for rate in args.rates.split(","):
            step = {m: [] for m in methods}  # per round; None where the run failed
            with Cluster(nodes, rate=rate, prefix="accstep-") as cluster, tempfile.TemporaryDirectory() as tmp:
                for round_ in range(args.rounds):
                    for name in methods:
                        try:
                            row = e2e.run_method(cluster, name, Path(tmp) / f"{name}-{round_}", args.timeout)
                        except Exception as exc:  # a timeout, unreadable output: record it, go on
                            row = {"method": name, "error": f"{type(exc).__name__}: {exc}"}
                        seconds = None if "error" in row else row["step_s"]
                        step[name].append(seconds)
                        rows.append({"nodes": nodes, "rate": rate, "round": round_, "method": name,
                                     "step_s": seconds, "error": row.get("error", "")[-200:]})
                        print(f"{nodes} nodes, {rate}, round {round_ + 1}/{args.rounds}: {name}: "
                              + (f"FAILED {row['error'][-300:]}" if seconds is None else f"{seconds:.4f} s/step"),
                              flush=True)
            sections += [f"## {nodes} nodes, {rate} links", "", *section(step)]
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["nodes", "rate", "round", "method", "step_s", "error"])
        writer.writeheader()
        writer.writerows(rows)
    header = ["# Time per step against DDP's PowerSGD hook", "",
              f"Machine: {platform.node()}, {cpu_model()}, 2 cores shared by all "
              f"nodes (one worker per node, 1 thread each). Task as in e2e.md (digits, `cnn-wide`, "
              f"{e2e.MODEL_PARAMS:,} parameters), `{' '.join(e2e.COMMON)}`. {args.rounds} rounds; in each, "
              "every method ran once, back to back. Command: `.venv/bin/python benchmarks/step_time.py "
              f"--rates {args.rates} --nodes {args.nodes} --rounds {args.rounds} --epochs {args.epochs} "
              f"--out {os.path.relpath(args.out, e2e.REPO)}`.", "",
              "*DDP / ours* > 1 means our step is the faster one; it is computed within each round.", ""]
    args.out.write_text("\n".join(header + sections + kept_analysis(args.out)) + "\n")
    print(f"wrote {args.out}")


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "failed"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def section(step: dict[str, list]) -> list[str]:
    out = ["| method | step, median (range) over rounds (s) | failed runs |", "|---|---|---|"]
    for name, values in step.items():
        done = [v for v in values if v is not None]
        out.append(f"| {e2e.METHODS[name][0]} | {spread(done, '.4f')} | {len(values) - len(done)} |")
    out += ["", "| ours | DDP | DDP / ours, median (range) over rounds | rounds where ours was faster |",
            "|---|---|---|---|"]
    for ours, theirs in PAIRS:
        ratios = [t / o for o, t in zip(step[ours], step[theirs]) if o is not None and t is not None]
        faster = sum(r > 1 for r in ratios)
        out.append(f"| {e2e.METHODS[ours][0]} | {e2e.METHODS[theirs][0]} | {spread(ratios, '.3f')}x | "
                   f"{faster} of {len(ratios)} |")
    return out + [""]


if __name__ == "__main__":
    main()
