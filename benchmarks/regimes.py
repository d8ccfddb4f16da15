"""Accordion against static compression: accuracy and floats sent, side by side.

    .venv/bin/python benchmarks/regimes.py                       # digits, 2 ranks, 3 seeds
    .venv/bin/python benchmarks/regimes.py --dataset synthetic --model resnet18 ...

For each codec pair (PowerSGD rank 1 <-> 4, TopK 10% <-> 99%) it trains, under horovodrun
with the same seed, data and steps: the aggressive level alone ("static low"), the gentle
level alone ("static high") and Accordion switching between them, plus uncompressed
training. Every run goes through the training CLI with --logdir, so each has its CSVs and
plots; this script reads the last rows back, writes benchmarks/results/regimes-<dataset>-<epochs>ep.md
and a CSV, and draws one comparison figure per codec (accuracy vs floats sent, vs time).
The bar (issue 4): Accordion within 0.5 points of static high's accuracy, sending at most
half of its floats.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_model
from report import kept_analysis

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent

RUNS = {  # label -> CLI arguments
    "dense": ["--codec", "none"],
    "powersgd static low (rank 1)": ["--codec", "powersgd", "--rank", "1"],
    "powersgd static high (rank 4)": ["--codec", "powersgd", "--rank", "4"],
    "powersgd accordion (1 <-> 4)": ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4"],
    "topk static low (10%)": ["--codec", "topk", "--ratio", "0.1"],
    "topk static high (99%)": ["--codec", "topk", "--ratio", "0.99"],
    "topk accordion (10% <-> 99%)": ["--codec", "topk", "--ratio", "0.1", "--critical-ratio", "0.99"],
}


def run_one(label: str, args: list[str], common: list[str], logdir: Path, np: int, timeout: float) -> dict:
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           sys.executable, "-m", "accordion_hvd.train", *args, *common, "--logdir", str(logdir), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"label": label, "error": (proc.stdout + proc.stderr)[-2000:]}
    with open(logdir / "eval.csv") as f:
        last_eval = list(csv.DictReader(f))[-1]
    with open(logdir / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    levels = [v for row in rows for k, v in row.items() if k.startswith("level/") and v in ("normal", "critical")]
    return {"label": label, "accuracy": float(last_eval["accuracy"]), "floats_sent": int(rows[-1]["floats_sent"]),
            "floats_dense": int(rows[-1]["floats_dense"]), "wall_s": float(last_eval["wall_s"]),
            "critical_share": levels.count("critical") / len(levels) if levels else float("nan"),
            "seconds": time.perf_counter() - started}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default=None)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--extra", default="--lr-milestones 10", help="more CLI arguments, one string")
    p.add_argument("--only", default="", help="run labels containing this text only")
    p.add_argument("--name", default=None,
                   help="results name under benchmarks/results/ (default regimes-DATASET-EPOCHSep)")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    common = ["--dataset", args.dataset, "--epochs", str(args.epochs), *args.extra.split()]
    if args.model:
        common += ["--model", args.model]
    out_dir = RESULTS / (args.name or f"regimes-{args.dataset}-{args.epochs}ep")
    results: dict[str, list[dict]] = {}
    for label, run_args in RUNS.items():
        if args.only and args.only not in label:
            continue
        for seed in seeds:
            logdir = out_dir / "runs" / f"{label.split(' (')[0].replace(' ', '-')}-seed{seed}"
            r = run_one(label, run_args, [*common, "--seed", str(seed)], logdir, args.np, args.timeout)
            print(f"{label:32s} seed {seed}: " + (f"accuracy {r['accuracy']:.4f}  floats {r['floats_sent']:,}  "
                  f"critical {r['critical_share']:.0%}  {r['seconds']:.0f} s" if "error" not in r
                  else "FAILED\n" + r["error"]), flush=True)
            results.setdefault(label, []).append({**r, "seed": seed, "logdir": logdir})
    write_report(args, common, seeds, results, out_dir)


def write_report(args, common, seeds, results, out_dir: Path) -> None:
    from accordion_hvd.cli.plots import compare_runs

    rows, table = [], []
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            table.append(f"| {label} | failed | | | | |")
            continue
        acc = statistics.mean(r["accuracy"] for r in ok)
        floats = statistics.mean(r["floats_sent"] for r in ok)
        dense = ok[0]["floats_dense"]
        crit = statistics.mean(r["critical_share"] for r in ok)
        per_seed = ", ".join(f"{r['accuracy']:.4f}" for r in ok)
        table.append(f"| {label} | {acc:.4f} ({per_seed}) | {floats:,.0f} | {dense / floats:.1f}x | "
                     f"{'' if crit != crit else f'{crit:.0%}'} | {statistics.mean(r['wall_s'] for r in ok):.1f} |")
        rows += [{k: r[k] for k in ("label", "seed", "accuracy", "floats_sent", "floats_dense", "critical_share",
                                    "wall_s")} for r in ok]
    verdicts = []
    for codec in ("powersgd", "topk"):
        def mean(label_part, key):
            runs = [r for label, rs in results.items() if label.startswith(codec) and label_part in label
                    for r in rs if "error" not in r]
            return statistics.mean(r[key] for r in runs) if runs else None
        acc_a, acc_h = mean("accordion", "accuracy"), mean("static high", "accuracy")
        fl_a, fl_h = mean("accordion", "floats_sent"), mean("static high", "floats_sent")
        if None in (acc_a, acc_h, fl_a, fl_h):
            continue
        gap, share = 100 * (acc_h - acc_a), fl_a / fl_h
        met = gap <= 0.5 and share <= 0.5
        verdicts.append(f"- **{codec}**: Accordion {100 * acc_a:.2f}% vs static high {100 * acc_h:.2f}% "
                        f"({gap:+.2f} points behind; bar <= 0.5), sending {share:.1%} of static high's floats "
                        f"(bar <= 50%): **{'met' if met else 'NOT met'}**.")
        for seed in seeds:
            picks = {label: r["logdir"] for label, rs in results.items() if label.startswith(codec)
                     for r in rs if r.get("seed") == seed and "error" not in r}
            picks["dense"] = next((r["logdir"] for r in results.get("dense", []) if r.get("seed") == seed
                                   and "error" not in r), None)
            picks = {k: v for k, v in picks.items() if v is not None}
            if seed == seeds[0] and picks:
                compare_runs(picks, out_dir / f"compare-{codec}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    text = [f"# Accordion vs static compression ({args.dataset}, {args.epochs} epochs, {args.np} ranks)", "",
            f"Machine: {machine}. Command: `.venv/bin/python benchmarks/regimes.py "
            f"{' '.join(sys.argv[1:])}`; every run: `horovodrun -np {args.np} --gloo python -m "
            f"accordion_hvd.train <codec args> {' '.join(common)} --seed S`. Accuracy is the final test "
            f"accuracy, mean over seeds {seeds} (each seed in brackets); floats are those rank 0 sent over "
            f"the whole run (mean over seeds); *critical* is the share of (layer, step) pairs at the gentle "
            f"level; time is training wall time on this shared machine.", "",
            "| run | test accuracy | floats sent | less than dense | critical | time (s) |",
            "| --- | --- | ---: | ---: | ---: | ---: |", *table, "", *verdicts, "",
            f"Per-run CSVs, TensorBoard events and plots (incl. the regime timeline `regimes.png`): "
            f"`{out_dir.relative_to(REPO)}/runs/` (git ignores `runs/`: what is committed of it is each run's "
            f"`eval.csv` and each Accordion run's `regimes.png`); comparison figures: "
            + ", ".join(f"`{d.name}/`" for d in sorted(out_dir.glob("compare-*"))) + "."]
    out_md = out_dir.parent / f"{out_dir.name}.md"
    out_md.write_text("\n".join(text + kept_analysis(out_md)) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
