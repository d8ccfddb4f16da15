"""Where each method's step goes, from the per-run JSON of benchmarks/step_time.py.

    .venv/bin/python benchmarks/phases.py benchmarks/results/step-time --setting resnet18-2n-100mbit
    .venv/bin/python benchmarks/phases.py benchmarks/results/step-time --setting resnet18-2n-100mbit --rev c1fcd45

Per run: the median over steps 4-12 of forward, backward (Horovod's hooks and our
``compress`` included), optimizer step (Horovod's waits, our ``decompress``, SGD) and, for
ours, the compressor's own seconds of compression math and of waiting on its collectives;
then the median over the rounds; and, for runs that recorded it (from commit bc14dd6), where
each worker's CPU went (``cpu_cells``). ``--rev`` reads the JSON as committed at that git revision
(to compare with an earlier engine measured the same way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = range(3, 12)  # steps 4-12, as step_time.py's step_s
COLUMNS = ("forward", "backward", "step", "compress", "comm")


def load(folder: Path, setting: str, rev: str | None) -> dict[str, list[dict]]:
    """method -> its runs' JSON, for the files ``<setting>-r<round>-<method>.json``."""
    if rev is None:
        files = {p.name: p.read_text() for p in folder.glob(f"{setting}-r*-*.json")}
    else:
        rel = folder.resolve().relative_to(REPO)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{rel}"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.split()
        files = {n: subprocess.run(["git", "show", f"{rev}:{rel}/{n}"], cwd=REPO, check=True, capture_output=True,
                                   text=True).stdout
                 for n in names if n.startswith(f"{setting}-r") and n.endswith(".json")}
    runs: dict[str, list[dict]] = {}
    for name, text in sorted(files.items()):
        method = name[len(setting) + 2:-len(".json")].split("-", 1)[1]
        runs.setdefault(method, []).append(json.loads(text))
    return runs


def medians(runs: list[dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"step_s": statistics.median(r["step_s"] for r in runs)}
    for column in COLUMNS:
        per_run = []
        for r in runs:
            source = r["phases"] if column in ("forward", "backward", "step") else r.get("ours") or []
            if len(source) > max(STEPS):
                per_run.append(statistics.median(source[k][column] for k in STEPS))
        out[column] = statistics.median(per_run) if per_run else None
    return out


def cpu_cells(runs: list[dict]) -> list[str]:
    """Training (main) thread CPU, other threads' CPU, training thread off the CPU, and the other threads by
    name: per step, mean of the ranks, median over the runs."""
    def per_rank(r: dict) -> list[dict]:
        return [x["cpu"] for x in (r.get("ranks") or [r]) if x.get("cpu")]

    def med(fn) -> float:
        return statistics.median(statistics.fmean(fn(c) for c in per_rank(r)) for r in runs)
    if not all(per_rank(r) for r in runs):
        return ["-"] * 4
    names = sorted({n for r in runs for c in per_rank(r) for n in c["others_by_name"]})
    by_name = {n: med(lambda c, n=n: c["others_by_name"].get(n, 0.0)) for n in names}
    return [f"{med(lambda c: c['main']):.3f}", f"{med(lambda c: c['others']):.3f}",
            f"{med(lambda c: c['wall'] - c['main']):.3f}",
            ", ".join(f"{n} {v * 1e3:.0f} ms" for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])
                      if v >= 5e-4) or "-"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--setting", required=True, help="e.g. resnet18-2n-100mbit")
    p.add_argument("--rev", help="read the JSON as committed at this git revision")
    args = p.parse_args()
    if args.rev is None:
        from results_archive import restore  # the raw runs: unpacked from their archive if missing
        restore(args.folder)
    runs = load(args.folder, args.setting, args.rev)
    if not runs:
        raise SystemExit(f"no runs of {args.setting} in {args.folder}" + (f" at {args.rev}" if args.rev else ""))
    print("| method | runs | step | forward | backward | optimizer step | our math | our waits | training thread CPU "
          "| other threads' CPU | training thread off the CPU | other threads by name |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for method, method_runs in runs.items():
        m = medians(method_runs)
        cells = [f"{m[c]:.3f}" if m[c] is not None else "-" for c in ("step_s", *COLUMNS)]
        print(f"| {method} | {len(method_runs)} | " + " | ".join(cells + cpu_cells(method_runs)) + " |")


if __name__ == "__main__":
    main()
