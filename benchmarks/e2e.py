"""End to end on the emulated cluster: Accordion against dense, fp16, static compression,
GraVAC, the batch-size mode and PyTorch DDP's PowerSGD hook, on bandwidth-limited links.

    .venv/bin/python benchmarks/e2e.py                      # 100 Mbit/s and 1 Gbit/s, 2 and 4 nodes
    .venv/bin/python benchmarks/e2e.py --rates 100mbit --nodes 2 --only dense,powersgd-accordion

Every method trains the same task (digits, ``--model cnn-wide``: 2.2 M parameters, 8.6 MB of
float32 gradient per step; same seed, data, epochs and learning-rate schedule) with one
worker per emulated node (benchmarks/cluster/: network namespaces, ``tc`` rate limits).
Ours run as ``horovodrun --gloo`` over the nodes with the training CLI; DDP runs as
``torchrun`` on every node (Gloo) with benchmarks/ddp_train.py. For each: time per step
(median; ours split into compression and waiting on our collectives), time to the target
accuracy, final accuracy, floats and bytes sent per rank. A method that fails is recorded
as failed and the others go on; the cluster is torn down whatever happens.

Writes benchmarks/results/e2e.md, e2e.csv and PNGs (accuracy vs wall time and vs bytes sent,
per link rate and node count) under benchmarks/results/e2e/.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from accordion_hvd.cli.plots import plot_curves  # noqa: E402
from machine import cpu_model  # noqa: E402
from report import kept_analysis  # noqa: E402

MODEL_PARAMS = 2_138_506
COMMON = ["--model", "cnn-wide", "--epochs", "10", "--lr-milestones", "7", "--seed", "0", "--no-progress"]
GENTLE, AGGRESSIVE = "powersgd-static-r4", "powersgd-static-r1"
# Environment of a method's horovodrun, where it differs from the default. The busy-wait
# variant exists to measure what accordion_hvd's polite wait (horovod/patches.py) is worth.
METHOD_ENV = {"powersgd-static-r4-spin": {"ACCORDION_HOROVOD_WAIT": "spin"}}
METHODS = {  # name -> (label, how: "hvd" or "cli-ddp" CLI args, or "ddp" rank for PyTorch's hook)
    "dense": ("no compression", ("hvd", ["--codec", "none"])),
    "fp16": ("Horovod fp16", ("hvd", ["--codec", "fp16"])),
    GENTLE: ("PowerSGD static rank 4 (gentle)", ("hvd", ["--codec", "powersgd", "--rank", "4"])),
    AGGRESSIVE: ("PowerSGD static rank 1 (aggressive)", ("hvd", ["--codec", "powersgd", "--rank", "1"])),
    "powersgd-accordion": ("PowerSGD Accordion 1 <-> 4", ("hvd", ["--codec", "powersgd", "--rank", "1",
                                                                  "--critical-rank", "4"])),
    "topk-static-10": ("TopK static 10% (gentle)", ("hvd", ["--codec", "topk", "--ratio", "0.1"])),
    "topk-static-1": ("TopK static 1% (aggressive)", ("hvd", ["--codec", "topk", "--ratio", "0.01"])),
    "topk-accordion": ("TopK Accordion 1% <-> 10%", ("hvd", ["--codec", "topk", "--ratio", "0.01",
                                                             "--critical-ratio", "0.1"])),
    "powersgd-network-aware": ("PowerSGD NetworkAware (1, 4)", ("hvd", ["--codec", "powersgd", "--rank", "1",
                                                                         "--critical-rank", "4", "--policy",
                                                                         "network-aware"])),
    "topk-network-aware": ("TopK NetworkAware (1%, 10%, dense)", ("hvd", ["--codec", "topk", "--ratio", "0.01",
                                                                           "--critical-ratio", "0.1", "--policy",
                                                                           "network-aware"])),
    "gravac": ("TopK GraVAC (10x..1000x)", ("hvd", ["--codec", "topk", "--policy", "gravac",
                                                    "--gravac-window", "20"])),
    "batch-mode": ("Accordion batch size (1 <-> 4 passes), dense", ("hvd", ["--codec", "none", "--batch-mode",
                                                                           "--large-passes", "4"])),
    "powersgd-static-r4-spin": ("PowerSGD static rank 4, Horovod's busy wait", ("hvd", ["--codec", "powersgd",
                                                                                       "--rank", "4"])),
    "ddp-powersgd-r4": ("DDP powerSGD_hook rank 4", ("ddp", 4)),
    "ddp-powersgd-r1": ("DDP powerSGD_hook rank 1", ("ddp", 1)),
    # Our compressor as DDP's comm hook (the CLI's --launcher ddp), and DDP's own 16-bit hook.
    "ddp-fp16": ("DDP fp16_compress_hook", ("cli-ddp", ["--codec", "fp16"])),
    "ddp-ours-r4": ("ours under DDP, PowerSGD static rank 4", ("cli-ddp", ["--codec", "powersgd", "--rank", "4"])),
    "ddp-ours-r1": ("ours under DDP, PowerSGD static rank 1", ("cli-ddp", ["--codec", "powersgd", "--rank", "1"])),
    "ddp-ours-accordion": ("ours under DDP, PowerSGD Accordion 1 <-> 4", ("cli-ddp", ["--codec", "powersgd", "--rank",
                                                                                     "1", "--critical-rank", "4"])),
}


def run_method(cluster, name: str, logdir: Path, timeout: float) -> dict:
    _, (kind, spec) = METHODS[name]
    started = time.monotonic()
    if kind == "hvd":
        result = cluster.horovodrun(["-m", "accordion_hvd.train", *spec, *COMMON, "--logdir", str(logdir)],
                                    timeout=timeout, env=METHOD_ENV.get(name))
        failed = result.returncode != 0 and (result.stdout + result.stderr)[-1500:]
    elif kind == "cli-ddp":
        failed = run_ddp(cluster, ["-m", "accordion_hvd.train", "--launcher", "ddp", *spec, *COMMON,
                                   "--logdir", str(logdir)], timeout)
    else:
        failed = run_ddp(cluster, [str(REPO / "benchmarks" / "ddp_train.py"), "--rank", str(spec), "--bucket-cap-mb", "64", "--logdir",
                                   str(logdir), *[a for a in COMMON if a != "--no-progress"]], timeout)
    row = {"method": name, "seconds": time.monotonic() - started}
    if failed:
        return {**row, "error": failed}
    return {**row, **read_run(logdir, bytes_per_float=2 if name in ("fp16", "ddp-fp16") else 4)}


def run_ddp(cluster, args: list[str], timeout: float):
    """torchrun ARGS on every node at once (static rendezvous at node1); returns False or the error."""
    results = cluster.torchrun(args, timeout=timeout)
    bad = {k: r for k, r in results.items() if r.returncode != 0}
    return bad and "\n".join(f"node{k + 1}: {(r.stdout + r.stderr)[-700:]}" for k, r in bad.items())


def read_run(logdir: Path, bytes_per_float: int) -> dict:
    with open(logdir / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    with open(logdir / "eval.csv") as f:
        evals = list(csv.DictReader(f))
    # Step time: differences of wall_s between steps of one epoch (evaluation pauses excluded).
    gaps = [float(b["wall_s"]) - float(a["wall_s"]) for a, b in zip(steps, steps[1:]) if a["epoch"] == b["epoch"]]
    def median_of(column):
        values = [float(r[column]) for r in steps if r.get(column) not in (None, "", "nan")]
        return statistics.median(values) if values else float("nan")
    return {"steps": len(steps), "step_s": statistics.median(gaps), "compress_s": median_of("compress_s"),
            "comm_s": median_of("comm_s"), "final_accuracy": float(evals[-1]["accuracy"]),
            "floats_sent": int(steps[-1]["floats_sent"]), "bytes_sent": int(steps[-1]["floats_sent"]) * bytes_per_float,
            "curve": [(float(e["wall_s"]), int(e["floats_sent"]) * bytes_per_float, float(e["accuracy"]))
                      for e in evals]}


def time_to(row: dict, target: float) -> float:
    return next((wall for wall, _, acc in row.get("curve", []) if acc >= target), float("nan"))


def table(rows: list[dict], target: float) -> list[str]:
    out = ["| method | time/step (s) | of which compression / our comm (s) | time to "
           f"{100 * target:.0f}% (s) | final accuracy | floats sent / rank | bytes sent / rank |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = METHODS[r["method"]][0]
        if "error" in r:
            out.append(f"| {label} | FAILED: {r['error'].strip().splitlines()[-1][:80]} | | | | | |")
            continue
        ours = not np.isnan(r["compress_s"]) and r["compress_s"] + r["comm_s"] > 0  # else not ours to measure
        split = f"{r['compress_s']:.3f} / {r['comm_s']:.3f}" if ours else ""
        tta = time_to(r, target)
        out.append(f"| {label} | {r['step_s']:.3f} | {split} | {'not reached' if np.isnan(tta) else f'{tta:.0f}'} | "
                   f"{100 * r['final_accuracy']:.2f}% | {r['floats_sent']:,} | {r['bytes_sent'] / 1e6:,.1f} MB |")
    return out


def headline(rows: list[dict], target: float) -> list[str]:
    by = {r["method"]: r for r in rows if "error" not in r}
    acc = by.get("powersgd-accordion")
    if acc is None:
        return ["Accordion PowerSGD did not finish: no comparison."]
    lines = []
    for base, what in (("dense", "no compression"), (GENTLE, "the gentle static level (rank 4)")):
        if base in by:
            a, b = time_to(acc, target), time_to(by[base], target)
            lines.append(f"- time to {100 * target:.0f}% against {what}: {b:.0f} s -> {a:.0f} s "
                         f"(**{b / a:.2f}x**)" if not (np.isnan(a) or np.isnan(b)) else
                         f"- time to {100 * target:.0f}% against {what}: not reached by one of them")
    if GENTLE in by:
        lines.append(f"- final accuracy against the gentle static level: {100 * acc['final_accuracy']:.2f}% vs "
                     f"{100 * by[GENTLE]['final_accuracy']:.2f}% "
                     f"({100 * (acc['final_accuracy'] - by[GENTLE]['final_accuracy']):+.2f} points)")
    for base in (GENTLE, AGGRESSIVE):
        if base in by:
            lines.append(f"- floats sent against {METHODS[base][0]}: {by[base]['floats_sent'] / acc['floats_sent']:.2f}x "
                         "less" if by[base]["floats_sent"] >= acc["floats_sent"] else
                         f"- floats sent against {METHODS[base][0]}: {acc['floats_sent'] / by[base]['floats_sent']:.2f}x more")
    for ours, theirs in ((GENTLE, "ddp-powersgd-r4"), (AGGRESSIVE, "ddp-powersgd-r1"),
                         ("powersgd-accordion", "ddp-powersgd-r4")):
        if ours in by and theirs in by:
            lines.append(f"- time per step, {METHODS[ours][0]} vs {METHODS[theirs][0]}: {by[ours]['step_s']:.3f} s "
                         f"vs {by[theirs]['step_s']:.3f} s ({by[theirs]['step_s'] / by[ours]['step_s']:.2f}x)")
    return lines


def plots(rows: list[dict], out_dir: Path, title: str) -> list[Path]:
    done = [r for r in rows if "error" not in r]
    by_time = {METHODS[r["method"]][0]: (np.array([c[0] for c in r["curve"]]), np.array([c[2] for c in r["curve"]]))
               for r in done}
    by_bytes = {METHODS[r["method"]][0]: (np.array([c[1] for c in r["curve"]]), np.array([c[2] for c in r["curve"]]))
                for r in done}
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_curves(by_time, "wall-clock time (s)", f"test accuracy vs time, {title}", out_dir / "accuracy_vs_time.png"),
            plot_curves(by_bytes, "bytes sent by rank 0 (cumulative)", f"test accuracy vs bytes, {title}",
                        out_dir / "accuracy_vs_bytes.png")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--only", default=",".join(m for m in METHODS if m not in METHOD_ENV),
                   help="comma-separated methods (default: all but the busy-wait variant)")
    p.add_argument("--target", type=float, default=0.96, help="test accuracy for time-to-accuracy")
    p.add_argument("--timeout", type=float, default=900, help="seconds per method")
    p.add_argument("--epochs", type=int, default=10, help="(a shorter run for a quick look; the results use 10)")
    p.add_argument("--out", type=Path, default=RESULTS / "e2e.md")
    args = p.parse_args()
    from cluster import Cluster  # needs root, ip and tc: refuses with one line otherwise

    COMMON[COMMON.index("--epochs") + 1] = str(args.epochs)
    methods = [m for m in args.only.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--only: unknown methods {unknown} (known: {', '.join(METHODS)})")
    all_rows, sections = [], []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for rate in args.rates.split(","):
            rows = []
            with Cluster(nodes, rate=rate, prefix="acce2e-") as cluster, tempfile.TemporaryDirectory() as tmp:
                for name in methods:
                    try:
                        row = run_method(cluster, name, Path(tmp) / name, args.timeout)
                    except Exception as exc:  # a timeout, unreadable output: record it, go on
                        row = {"method": name, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
                    rows.append({**row, "rate": rate, "nodes": nodes})
                    print(f"{nodes} nodes, {rate}: {name}: " + (f"FAILED {row['error'][-300:]}" if "error" in row else
                          f"{row['step_s']:.3f} s/step, accuracy {row['final_accuracy']:.4f}, "
                          f"{row['floats_sent']:,} floats"), flush=True)
            figures = plots(rows, args.out.parent / "e2e" / f"{nodes}nodes-{rate}", f"{nodes} nodes, {rate}")
            sections += [f"## {nodes} nodes, {rate} links", "", *headline(rows, args.target), "",
                         *table(rows, args.target), "",
                         *[f"![{f.stem}]({f.relative_to(args.out.parent)})" for f in figures], ""]
            all_rows += rows
    write_csv(all_rows, args.out.with_suffix(".csv"), args.target)
    header = ["# End to end on the emulated cluster", "",
              f"Machine: {platform.node()}, {cpu_model()}, 2 cores shared by all "
              f"nodes (one worker per node, 1 thread each). Task: digits, model `cnn-wide` ({MODEL_PARAMS:,} "
              f"parameters, {4 * MODEL_PARAMS / 1e6:.1f} MB of float32 gradient per step), `{' '.join(COMMON)}`, "
              f"batch 32 per rank. Target accuracy {100 * args.target:.0f}%. Command: `.venv/bin/python "
              f"benchmarks/e2e.py --rates {args.rates} --nodes {args.nodes}`.", ""]
    args.out.write_text("\n".join(header + sections + kept_analysis(args.out)) + "\n")
    print(f"wrote {args.out}")


def write_csv(rows: list[dict], path: Path, target: float) -> None:
    fields = ["nodes", "rate", "method", "step_s", "compress_s", "comm_s", "time_to_target_s", "final_accuracy",
              "floats_sent", "bytes_sent", "steps", "seconds", "error"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "time_to_target_s": time_to(r, target), "error": r.get("error", "")[-200:]})


if __name__ == "__main__":
    main()
