"""Step time of the same methods under two checkouts of the package, interleaved: did a
change of the code (not of the method) cost time?

    .venv/bin/python benchmarks/code_ab.py --before /path/to/old/checkout --rounds 5 \\
        --out benchmarks/results/engine-split-step-time.md

Each run is the checkout's own benchmarks/step_worker.py on the emulated cluster, as in
benchmarks/step_time.py: the worker puts its checkout's root first on ``sys.path``, so it
imports that checkout's package (each needs its built ``accordion_hvd/_C*.so``; the
worker's own file must be the same in both, which the script checks).
In every round each method runs once under each checkout, back to back, the order
alternating between rounds (before-after, after-before, ...), so slow phases of this shared
machine hit both alike; ratios are taken within a round. Reported: per method, the median
step under each, the per-round ratios after/before (median, range) and in how many rounds
the new code was faster; every run is in the CSV beside the report.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from machine import cpu_model  # noqa: E402
from step_time import check, read, why  # noqa: E402
from step_worker import DDP, LAST, METHODS  # noqa: E402

def run(cluster, method: str, model: str, out: Path, tree: Path, timeout: float) -> float:
    from cluster import IFACE

    out.unlink(missing_ok=True)
    args = [str(tree / "benchmarks" / "step_worker.py"), "--method", method, "--model", model, "--steps", str(LAST + 2), "--out", str(out)]
    env = {"PYTHONPATH": str(tree)}  # (the worker's own sys.path entry decides; this agrees with it)
    if method in DDP:
        torchrun = str(Path(cluster.python).parent / "torchrun")
        check(cluster.exec_everywhere(lambda k: [torchrun, "--nnodes", str(cluster.nodes), "--nproc_per_node", "1",
                                                 "--node_rank", str(k), "--master_addr", "node1",
                                                 "--master_port", "29533", *args],
                                      timeout=timeout, env={"GLOO_SOCKET_IFNAME": IFACE, **env}))
    else:
        result = cluster.horovodrun(args, timeout=timeout, env=env)
        if result.returncode != 0:
            raise RuntimeError(why((result.stdout or "") + (result.stderr or "")))
    return read(out)["step_s"]


def _commit(tree: Path) -> str:
    """The checkout's commit, as the report names it (a path of this machine says nothing)."""
    import subprocess
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the old checkout's root")
    p.add_argument("--after", type=Path, default=REPO, help="the new checkout's root (default: this one)")
    p.add_argument("--methods", default="ours-accordion,ours-topk1,ddp-ours-accordion")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "code-ab.md")
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown} (known: {', '.join(METHODS)})")
    from cluster import Cluster

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {side: _commit(tree) for side, tree in trees.items()}
    workers = {side: (tree / "benchmarks" / "step_worker.py").read_bytes() for side, tree in trees.items()}
    if workers["before"] != workers["after"]:
        p.error("benchmarks/step_worker.py differs between the checkouts: the runs would not measure the same thing")
    raw = args.out.with_suffix("")
    raw.mkdir(parents=True, exist_ok=True)
    rows = []
    with Cluster(args.nodes, rate=args.rate, prefix="accab-") as cluster:
        for round_ in range(args.rounds):
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for method in methods:
                for side in order:
                    out = raw / f"r{round_}-{method}-{side}.json"
                    try:
                        seconds, error = run(cluster, method, args.model, out, trees[side], args.timeout), ""
                    except Exception as exc:  # a timeout, a crash: recorded, the rounds go on
                        seconds, error = None, f"{type(exc).__name__}: {exc}"[:900]
                    rows.append({"round": round_, "method": method, "side": side, "step_s": seconds, "error": error})
                    print(f"round {round_ + 1}/{args.rounds}: {method} {side}: "
                          + (f"FAILED {error}" if seconds is None else f"{seconds:.4f} s/step"), flush=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# Step time after a change of code, against before", "",
             f"Machine: {platform.node()}, {cpu_model()}, {os.cpu_count()} cores shared by {args.nodes} emulated "
             f"nodes at {args.rate} (one worker per node, 1 thread each). {args.model}, synthetic batches of 32 per "
             f"worker; median of steps 4-{LAST} of each run (benchmarks/step_worker.py). Before: commit "
             f"{commits['before']}; after: commit {commits['after']}. {args.rounds} rounds, each method under both, the order alternating. "
             f"Command: `.venv/bin/python benchmarks/code_ab.py --before <a checkout of {commits['before']}> --methods {args.methods} "
             f"--model {args.model} --nodes {args.nodes} --rate {args.rate} --rounds {args.rounds} --out "
             f"{os.path.relpath(args.out, REPO)}`. Every run: `{os.path.relpath(args.out.with_suffix('.csv'), REPO)}`.",
             "", "| method | before: step (s), median (range) | after | after / before, per round: median (range) "
             "| rounds where after was faster | failed runs |", "|---|---|---|---|---|---|"]
    for method in methods:
        by = {(r["round"], r["side"]): r["step_s"] for r in rows if r["method"] == method}
        before = [by[(k, "before")] for k in range(args.rounds) if by.get((k, "before")) is not None]
        after = [by[(k, "after")] for k in range(args.rounds) if by.get((k, "after")) is not None]
        ratios = [by[(k, "after")] / by[(k, "before")] for k in range(args.rounds)
                  if by.get((k, "after")) is not None and by.get((k, "before")) is not None]
        failed = sum(1 for r in rows if r["method"] == method and r["step_s"] is None)

        def spread(values, fmt=".4f"):
            return "-" if not values else \
                f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"
        lines.append(f"| {method} | {spread(before)} | {spread(after)} | {spread(ratios, '.3f')}x | "
                     f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {failed} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
