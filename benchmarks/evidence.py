"""The runs of an evidence protocol (benchmarks/protocols/evidence-v1.md), resumable, and their summary.

    .venv/bin/python benchmarks/evidence.py --task digits             # every method, seeds 0-4, folds 0-4
    .venv/bin/python benchmarks/evidence.py --task lm                 # every method, seeds 0-2
    .venv/bin/python benchmarks/evidence.py --task lm --max-runs 3    # the next 3 runs left, then stop
    .venv/bin/python benchmarks/evidence.py --task digits --methods fp16,powersgd-accordion --seeds 0 --folds 0
    .venv/bin/python benchmarks/evidence.py --summarize               # benchmarks/results/evidence-v1.md

Every run happens on 2 emulated nodes at 100 Mbit/s (benchmarks/cluster; needs root), one
rank per node, one thread each, as the protocol fixes; ours under ``horovodrun --gloo``,
PyTorch DDP's ``powerSGD_hook`` under ``torchrun``. A run's records go to
``benchmarks/results/evidence-v1/TASK/METHOD/seedS[-foldK]/``: ``steps.csv``, ``eval.csv``, the
tail of its output (``log.txt``) and ``run.json`` (command, commit, machine, exit status,
seconds). A run whose ``run.json`` exists is not run again, so the runs can be spread over
several sessions and an interrupted one goes on where it stopped. Nothing about a task, a
method or the bar is decided here: it is the protocol's, and a change to it is a new version.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from cluster import Cluster  # noqa: E402

PROTOCOL = "evidence-v1"
OUT = REPO / "benchmarks" / "results" / PROTOCOL
RATE = "100mbit"

TASKS = {  # the protocol's tasks: CLI arguments, seeds, folds, quality column and direction
    "digits": {"args": ["--dataset", "digits", "--model", "cnn", "--epochs", "20", "--lr", "0.02",
                        "--lr-milestones", "15", "--folds", "5"],
               "ddp": ["--model", "cnn", "--epochs", "20", "--lr", "0.02", "--lr-milestones", "15", "--folds", "5"],
               "seeds": range(5), "folds": range(5), "quality": "accuracy", "higher_is_better": True},
    "lm": {"args": ["--dataset", "text", "--model", "lstm", "--epochs", "6", "--lr", "0.5", "--lr-milestones", "4"],
           # One bucket: at DDP's default two, its hook fails on Gloo (protocol, amendment 1).
           "ddp": ["--model", "lstm", "--epochs", "6", "--lr", "0.5", "--lr-milestones", "4",
                   "--bucket-cap-mb", "1000"],
           "seeds": range(3), "folds": (None,), "quality": "perplexity", "higher_is_better": False},
}
COMMON = ["--batch-size", "32", "--interval", "0", "--eta", "0.5", "--no-progress"]
METHODS = {  # name -> (launcher, arguments)
    "dense-fp32": ("horovod", ["--codec", "none"]),
    "fp16": ("horovod", ["--codec", "fp16"]),
    "powersgd-r1": ("horovod", ["--codec", "powersgd", "--rank", "1"]),
    "powersgd-r4": ("horovod", ["--codec", "powersgd", "--rank", "4"]),
    "powersgd-accordion": ("horovod", ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4"]),
    "topk-1": ("horovod", ["--codec", "topk", "--ratio", "0.01"]),
    "topk-10": ("horovod", ["--codec", "topk", "--ratio", "0.1"]),
    "topk-accordion": ("horovod", ["--codec", "topk", "--ratio", "0.01", "--critical-ratio", "0.1"]),
    # Amendment 2: the network-aware policy on the same levels as Accordion.
    "powersgd-network-aware": ("horovod", ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4",
                                           "--policy", "network-aware"]),
    "topk-network-aware": ("horovod", ["--codec", "topk", "--ratio", "0.01", "--critical-ratio", "0.1",
                                       "--policy", "network-aware"]),
    "ddp-powersgd-r1": ("ddp", ["--rank", "1"]),
    "ddp-powersgd-r4": ("ddp", ["--rank", "4"]),
}
# The protocol's bar, per codec: (Accordion, static high, static low).
BAR = {"PowerSGD": ("powersgd-accordion", "powersgd-r4", "powersgd-r1"),
       "TopK": ("topk-accordion", "topk-10", "topk-1")}
# Amendment 2's bar, per codec: (NetworkAware, Accordion).
NETWORK_BAR = {"PowerSGD": ("powersgd-network-aware", "powersgd-accordion"),
               "TopK": ("topk-network-aware", "topk-accordion")}


def run_dir(task: str, method: str, seed: int, fold: int | None) -> Path:
    return OUT / task / method / (f"seed{seed}" if fold is None else f"seed{seed}-fold{fold}")


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+uncommitted" if dirty else "")


def one_run(cluster: Cluster, task: str, method: str, seed: int, fold: int | None, timeout: float) -> dict:
    spec, (launcher, margs) = TASKS[task], METHODS[method]
    where = run_dir(task, method, seed, fold)
    fold_args = [] if fold is None else ["--fold", str(fold)]
    with tempfile.TemporaryDirectory() as tmp:
        if launcher == "horovod":
            args = ["-m", "accordion_hvd.train", *spec["args"], *fold_args, *margs, *COMMON, "--seed", str(seed),
                    "--logdir", tmp]
            started = time.monotonic()
            result = cluster.horovodrun(args, timeout=timeout)
            code, output = result.returncode, result.stdout + result.stderr
            command = f"horovodrun -np 2 -H node1:1,node2:1 --gloo python {' '.join(args[:-1])} DIR"
        else:
            args = [str(REPO / "benchmarks" / "ddp_train.py"), *spec["ddp"], *fold_args, *margs, "--seed", str(seed),
                    "--logdir", tmp]
            started = time.monotonic()
            results = cluster.torchrun(args, timeout=timeout)
            code = max(r.returncode for r in results.values())
            output = "\n".join(r.stdout + r.stderr for _, r in sorted(results.items()))
            command = f"torchrun --nnodes 2 --nproc_per_node 1 ... benchmarks/ddp_train.py {' '.join(args[1:-1])} DIR"
        seconds = time.monotonic() - started
        where.mkdir(parents=True, exist_ok=True)
        for name in ("steps.csv", "eval.csv"):
            if (Path(tmp) / name).exists():
                shutil.copy(Path(tmp) / name, where / name)
    (where / "log.txt").write_text(output[-20000:])
    record = {"protocol": PROTOCOL, "task": task, "method": method, "seed": seed, "fold": fold, "exit": code,
              "seconds": round(seconds, 1), "command": command, "commit": commit(), "machine": machine(),
              "cluster": f"2 emulated nodes, {RATE} links, 1 thread per rank"}
    (where / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def machine() -> str:
    from machine import cpu_model  # benchmarks/machine.py
    return f"{platform.node()}, {cpu_model()}, Python {platform.python_version()}"


def run_all(task: str, methods: list[str], seeds, folds, timeout: float, max_runs: int | None = None) -> None:
    todo = [(m, s, f) for s in seeds for f in folds for m in methods if not (run_dir(task, m, s, f) / "run.json").exists()]
    print(f"{task}: {len(todo)} runs to do" + (f", {min(max_runs, len(todo))} now" if max_runs else ""), flush=True)
    todo = todo[:max_runs] if max_runs else todo  # a session that must stop stops between runs
    with Cluster(2, rate=RATE, prefix="accev-") as cluster:
        for i, (method, seed, fold) in enumerate(todo, 1):
            record = one_run(cluster, task, method, seed, fold, timeout)
            print(f"[{i}/{len(todo)}] {task} {method} seed {seed} fold {fold}: exit {record['exit']}, "
                  f"{record['seconds']:.0f} s", flush=True)


# ---------------------------------------------------------------- summary

def read_run(where: Path, quality: str) -> dict | None:
    record = json.loads((where / "run.json").read_text())
    if record["exit"] != 0 or not (where / "eval.csv").exists():
        return None
    with open(where / "eval.csv") as f:
        evals = list(csv.DictReader(f))
    with open(where / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    walls = [float(r["wall_s"]) for r in steps]
    # The final test score: the run's last line says it (for the LM, eval.csv has validation
    # perplexity per epoch and the test set is scored once at the end).
    final = re.findall(rf"final test {quality}: ([0-9.]+|inf)", (where / "log.txt").read_text())
    return {"quality": float(final[-1]) if final else float(evals[-1][quality]), "floats": int(steps[-1]["floats_sent"]),
            "step_s": statistics.median(b - a for a, b in zip(walls, walls[1:])) if len(walls) > 1 else math.nan,
            "wall_s": float(evals[-1]["wall_s"]), "evals": evals, "commit": record["commit"],
            "cpu": _cpu(record.get("machine", ""))}


def _cpu(machine: str) -> str:
    """The processor in a run's machine line ("vm, AMD EPYC, Python 3.11.7" -> "AMD EPYC")."""
    parts = [p.strip() for p in machine.split(",")]
    return parts[1] if len(parts) > 2 else (machine or "?")


def summarize() -> list[str]:
    lines = [f"# Evidence ({PROTOCOL}): Accordion against its alternatives", "",
             f"Protocol: [`benchmarks/protocols/{PROTOCOL}.md`](../protocols/{PROTOCOL}.md), committed before the "
             "runs. Records: `benchmarks/results/evidence-v1/TASK/METHOD/seedS[-foldK]/` (each with its command, "
             "commit and machine in run.json). Command: `.venv/bin/python benchmarks/evidence.py --task TASK`, then "
             "`--summarize`. Floats sent count elements (fp16's are 2 bytes, the others 4); a median step is "
             "the median gap between consecutive steps' wall_s (the few gaps that span an evaluation do not move it). "
             "Step times compare only between runs of the same commits, made together: the machine is shared, "
             "and the sessions' machines differ (column cpus).", ""]
    for task, spec in TASKS.items():
        quality = spec["quality"]
        runs = {m: {} for m in METHODS}
        failed = {m: 0 for m in METHODS}
        for method in METHODS:
            for where in sorted((OUT / task / method).glob("seed*")) if (OUT / task / method).is_dir() else []:
                if not (where / "run.json").exists():
                    continue
                got = read_run(where, quality)
                if got is None:
                    failed[method] += 1
                else:
                    runs[method][where.name] = got
        if not any(runs.values()) and not any(failed.values()):
            lines += [f"## {task}: no runs yet", ""]
            continue
        lines += [f"## {task}", "",
                  f"| method | runs | failed | {quality}: mean | sd | min - max | floats sent per rank (mean) | "
                  "median step (s) | commits | cpus |", "|---|---|---|---|---|---|---|---|---|---|"]
        for method, got in runs.items():
            if not got and not failed[method]:
                continue
            q = [r["quality"] for r in got.values()]
            mean = statistics.mean(q) if q else math.nan
            sd = statistics.stdev(q) if len(q) > 1 else math.nan
            scale = 100 if quality == "accuracy" else 1
            lines.append(f"| {method} | {len(q)} | {failed[method]} | {scale * mean:.2f} | {scale * sd:.2f} | "
                         f"{scale * min(q, default=math.nan):.2f} - {scale * max(q, default=math.nan):.2f} | "
                         f"{statistics.mean(r['floats'] for r in got.values()) if got else math.nan:,.0f} | "
                         f"{statistics.median(r['step_s'] for r in got.values()) if got else math.nan:.3f} | "
                         f"{', '.join(sorted({r['commit'] for r in got.values()}))} | "
                         f"{', '.join(sorted({r['cpu'] for r in got.values()}))} |")
        if "--bucket-cap-mb" in spec["ddp"]:
            lines += ["", "DDP ran with one bucket here (protocol amendment 1: at its default two, its hook fails "
                      "on Gloo, results/ddp-hook-gloo.md), so it starts communicating only after the whole "
                      "backward pass; a working two-bucket run might step somewhat faster."]
        lines += ["", *time_to_baseline_lines(runs, spec), "", *bar_lines(runs, spec), "",
                  *network_bar_lines(runs, spec), "", *plot_lines(task, runs, spec), ""]
    return lines


def reached_at(evals: list[dict], quality: str, target: float, higher_is_better: bool) -> float | None:
    """Seconds into training of the first evaluation at least as good as ``target``."""
    for row in evals:
        q = float(row[quality])
        if (q >= target) if higher_is_better else (q <= target):
            return float(row["wall_s"])
    return None


def time_to_baseline_lines(runs: dict, spec: dict) -> list[str]:
    """The protocol's time to reach the 16-bit baseline's final quality. The target is the mean
    over fp16's runs of its last evaluation (the column every run logs per epoch: test accuracy
    over the fold for digits, validation perplexity for the LM), so that each run is compared on
    the quantity it logs as it goes; a run that never reaches it is counted, not averaged."""
    quality, higher = spec["quality"], spec["higher_is_better"]
    if not runs["fp16"]:
        return ["Time to the 16-bit baseline's final quality: no fp16 runs yet."]
    target = statistics.mean(float(r["evals"][-1][quality]) for r in runs["fp16"].values())
    scale, unit = (100, "%") if quality == "accuracy" else (1, "")
    out = [f"Time to reach the 16-bit baseline's final {quality} ({scale * target:.2f}{unit}, the mean of fp16's "
           "last evaluations), seconds into training:", "",
           "| method | reached | mean s (runs that reached it) | sd |", "|---|---|---|---|"]
    for method, got in runs.items():
        if not got:
            continue
        times = [t for r in got.values() if (t := reached_at(r["evals"], quality, target, higher)) is not None]
        mean = f"{statistics.mean(times):.1f}" if times else "-"
        sd = f"{statistics.stdev(times):.1f}" if len(times) > 1 else "-"
        out.append(f"| {method} | {len(times)} of {len(got)} | {mean} | {sd} |")
    return out


def plot_lines(task: str, runs: dict, spec: dict) -> list[str]:
    """Mean quality per evaluation (over seeds and folds) against mean floats sent and mean
    time, one line per method: ``evidence-v1/TASK_QUALITY_vs_{floats,time}.png``."""
    sys.path.insert(0, str(REPO))
    from accordion_hvd.cli.plots import plot_curves  # matplotlib only when summarizing
    quality = spec["quality"]
    by_floats, by_time = {}, {}
    for method, got in runs.items():
        if not got:
            continue
        n = min(len(r["evals"]) for r in got.values())
        mean = lambda col: [statistics.mean(float(r["evals"][i][col]) for r in got.values()) for i in range(n)]  # noqa: E731
        q = mean(quality)
        by_floats[method], by_time[method] = (mean("floats_sent"), q), (mean("wall_s"), q)
    if not by_floats:
        return []
    out = []
    for what, curves, xlabel in (("floats", by_floats, "floats sent per rank"), ("time", by_time, "seconds")):
        path = OUT / f"{task}_{quality}_vs_{what}.png"
        plot_curves({m: tuple(map(np.asarray, xy)) for m, xy in curves.items()}, xlabel,
                    f"{task}: {quality} vs {what} (mean over runs)", path, metric=quality)
        out.append(f"![{task} {quality} vs {what}]({PROTOCOL}/{path.name})")
    return out


def bar_lines(runs: dict, spec: dict) -> list[str]:
    """The protocol's three conditions per codec, on the runs present (paired by seed and fold)."""
    sign = 1 if spec["higher_is_better"] else -1
    out = ["| codec | paired runs | 1. within sd or 2% of static high | 2. floats <= 0.6x static high | "
           "3. better than static low by > 2 SE | met |", "|---|---|---|---|---|---|"]
    detectable = []
    for codec, (acc, high, low) in BAR.items():
        keys = sorted(set(runs[acc]) & set(runs[high]) & set(runs[low]))
        if len(keys) < 2:
            out.append(f"| {codec} | {len(keys)} | not enough runs | | | |")
            continue
        qa = [runs[acc][k]["quality"] for k in keys]
        qh = [runs[high][k]["quality"] for k in keys]
        ql = [runs[low][k]["quality"] for k in keys]
        gap = sign * (statistics.mean(qh) - statistics.mean(qa))  # how much worse Accordion is than high
        allowed = max(statistics.stdev(qh), 0.02 * abs(statistics.mean(qh)))
        c1 = gap <= allowed
        ratio = statistics.mean(runs[acc][k]["floats"] for k in keys) / statistics.mean(runs[high][k]["floats"]
                                                                                         for k in keys)
        c2 = ratio <= 0.6
        diff = [sign * (a - b) for a, b in zip(qa, ql)]
        se = statistics.stdev(diff) / math.sqrt(len(diff))
        c3 = statistics.mean(diff) > 2 * se
        out.append(f"| {codec} | {len(keys)} | {'yes' if c1 else 'no'} (worse by {gap:.4f}, allowed {allowed:.4f}) | "
                   f"{'yes' if c2 else 'no'} ({ratio:.2f}x) | {'yes' if c3 else 'no'} (by {statistics.mean(diff):.4f}, "
                   f"2 SE {2 * se:.4f}) | {'**yes**' if c1 and c2 and c3 else 'no'} |")
        gentle = [sign * (h - l) for h, l in zip(qh, ql)]
        detectable.append(f"{codec} {2 * statistics.stdev(gentle) / math.sqrt(len(gentle)):.4f} (static high "
                          f"better than static low by {statistics.mean(gentle):.4f} on average)")
    if detectable:
        out += ["", "The smallest difference this design can detect (twice the standard error of the paired "
                "static high - static low difference): " + "; ".join(detectable) + "."]
    return out


def network_bar_lines(runs: dict, spec: dict) -> list[str]:
    """Amendment 2's bar per codec: NetworkAware's quality within one sd of Accordion's runs
    (or better), at no more floats than Accordion's."""
    sign = 1 if spec["higher_is_better"] else -1
    out = ["NetworkAware against Accordion (amendment 2):", "",
           "| codec | runs (NA, Accordion) | 1. within one sd of Accordion's quality, or better | "
           "2. floats <= Accordion's | met |", "|---|---|---|---|---|"]
    for codec, (na, acc) in NETWORK_BAR.items():
        if len(runs[na]) < 1 or len(runs[acc]) < 2:
            out.append(f"| {codec} | {len(runs[na])}, {len(runs[acc])} | not enough runs | | |")
            continue
        qn = [r["quality"] for r in runs[na].values()]
        qa = [r["quality"] for r in runs[acc].values()]
        gap = sign * (statistics.mean(qa) - statistics.mean(qn))  # how much worse NetworkAware is
        allowed = statistics.stdev(qa)
        ratio = statistics.mean(r["floats"] for r in runs[na].values()) / \
            statistics.mean(r["floats"] for r in runs[acc].values())
        c1, c2 = gap <= allowed, ratio <= 1.0
        out.append(f"| {codec} | {len(qn)}, {len(qa)} | {'yes' if c1 else 'no'} (worse by {gap:.4f}, allowed "
                   f"{allowed:.4f}) | {'yes' if c2 else 'no'} ({ratio:.2f}x) | {'**yes**' if c1 and c2 else 'no'} |")
    return out + _paired_floats(runs)


def _paired_floats(runs: dict) -> list[str]:
    """How far apart NetworkAware's and Accordion's floats are run by run (the same seed and
    fold): a description beside the bar, which the bar does not use."""
    out = []
    for codec, (na, acc) in NETWORK_BAR.items():
        keys = sorted(set(runs[na]) & set(runs[acc]))
        if len(keys) < 2:
            continue
        ratios = [runs[na][k]["floats"] / runs[acc][k]["floats"] for k in keys]
        out.append(f"- {codec}, paired by seed and fold: NetworkAware's floats / Accordion's per run, mean "
                   f"{statistics.mean(ratios):.3f} (sd {statistics.stdev(ratios):.3f}, {min(ratios):.3f}-"
                   f"{max(ratios):.3f}), above 1 in {sum(r > 1 for r in ratios)} of {len(ratios)} runs.")
    return [""] + out if out else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS))
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--seeds", default=None, help="comma-separated (default: the protocol's)")
    p.add_argument("--folds", default=None, help="comma-separated (digits; default: the protocol's)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--max-runs", type=int, default=None, help="do at most N of the runs left, then stop")
    p.add_argument("--summarize", action="store_true", help=f"write benchmarks/results/{PROTOCOL}.md")
    args = p.parse_args()
    if args.task:
        methods = [m for m in args.methods.split(",") if m]
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            p.error(f"--methods: unknown {unknown} (known: {', '.join(METHODS)})")
        spec = TASKS[args.task]
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(spec["seeds"])
        folds = [int(f) for f in args.folds.split(",")] if args.folds and args.task == "digits" else list(spec["folds"])
        if args.max_runs is not None and args.max_runs < 1:
            p.error(f"--max-runs: expected a positive number of runs, got {args.max_runs}")
        run_all(args.task, methods, seeds, folds, args.timeout, args.max_runs)
    if args.summarize or not args.task:
        from results_archive import restore  # the raw runs: unpacked from their archive if missing
        restore(OUT)
        out = REPO / "benchmarks" / "results" / f"{PROTOCOL}.md"
        out.write_text("\n".join(summarize()) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
