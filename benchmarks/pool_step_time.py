"""Every round of every step-time file, pooled: the figure the README quotes.

    .venv/bin/python benchmarks/pool_step_time.py      # writes benchmarks/results/step-time-pooled.md

Reads every ``benchmarks/results/*.csv`` and ``benchmarks/results/archive/*.csv`` (the superseded
files keep their rounds in the pool) that benchmarks/step_time.py wrote (columns model,
nodes, rate, round, method, step_s), takes ours / peer within each round of each file (the
pairs of step_time.PAIRS), and pools the ratios per setting and pair over all files: median,
range, n, and in how many rounds ours was faster, beside each file's own median so that no
single file is chosen after the fact. Files measure the engine as it was when they ran (each
one's .md says when and how); a round in which either side failed is left out and counted.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from step_time import PAIRS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ARCHIVE = RESULTS / "archive"  # superseded files: still pooled
COLUMNS = {"model", "nodes", "rate", "round", "method", "step_s"}


def rounds_of(path: Path) -> dict[tuple, dict[str, float | None]]:
    """(model, nodes, rate, round) -> method -> step seconds (None: failed)."""
    out: dict[tuple, dict[str, float | None]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["model"], int(row["nodes"]), row["rate"], int(row["round"]))
            out.setdefault(key, {})[row["method"]] = float(row["step_s"]) if row["step_s"] else None
    return out


def pooled() -> list[str]:
    pools: dict[tuple, list[tuple[str, float]]] = {}  # (model, nodes, rate, ours, peer) -> (file, ratio)
    failed: dict[tuple, int] = {}
    files = []
    for path in sorted([*RESULTS.glob("*.csv"), *ARCHIVE.glob("*.csv")], key=lambda p: p.name):
        with open(path, newline="") as f:
            header = set(next(csv.reader(f), []))
        if not COLUMNS <= header:
            continue
        files.append(path.name)
        for (model, nodes, rate, _), steps in rounds_of(path).items():
            for ours, peer in PAIRS:
                if ours not in steps or peer not in steps:
                    continue
                key = (model, nodes, rate, ours, peer)
                if steps[ours] is None or steps[peer] is None:
                    failed[key] = failed.get(key, 0) + 1
                    continue
                pools.setdefault(key, []).append((path.stem, steps[ours] / steps[peer]))
    lines = ["# Step time, every round pooled", "",
             f"`.venv/bin/python benchmarks/pool_step_time.py`: every round of the {len(files)} step-time files in "
             "this folder and its archive/ (benchmarks/step_time.py's CSVs), ours / peer taken within each round, pooled per "
             "setting and pair. *ours / peer* < 1: our step is shorter. Each file's .md names its machine, "
             "command and the engine it measured (older files measured older engines).", "",
             "| model | nodes | link | ours | peer | ours / peer: median (range) | rounds (n) | ours faster in | "
             "failed rounds | per file: median (rounds) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(pools):
        ratios = [r for _, r in pools[key]]
        by_file: dict[str, list[float]] = {}
        for name, r in pools[key]:
            by_file.setdefault(name, []).append(r)
        per_file = "; ".join(f"{name} {statistics.median(v):.3f} ({len(v)})" for name, v in by_file.items())
        model, nodes, rate, ours, peer = key
        lines.append(f"| {model} | {nodes} | {rate} | {ours} | {peer} | {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f})x | {len(ratios)} | {sum(r < 1 for r in ratios)} | "
                     f"{failed.get(key, 0)} | {per_file} |")
    return lines


def main() -> None:
    out = RESULTS / "step-time-pooled.md"
    out.write_text("\n".join(pooled()) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
