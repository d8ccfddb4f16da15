"""The runs of the time-to-quality protocol (benchmarks/protocols/evidence-v2.md), resumable,
and their summary.

    .venv/bin/python benchmarks/time_to_quality.py --setting lstm-100mbit             # every method, seeds 0-2
    .venv/bin/python benchmarks/time_to_quality.py --setting lstm-100mbit --methods fp16 --max-runs 1
    .venv/bin/python benchmarks/time_to_quality.py --summarize      # benchmarks/results/evidence-v2.md

A setting is a task on a link rate. Its 16-bit baseline runs first (``fp16``: the standard
schedule, no target); once they are all done the setting's target (their mean final
validation quality) and cap (twice their mean wall time) are computed once and frozen in
``benchmarks/results/evidence-v2/SETTING/setting.json``; every other method then runs with
``--target`` and ``--time-cap`` (train the standard schedule; if the target is not reached
by then, go on at the final learning rate until it is or the cap passes). Every run happens
on 2 emulated nodes (benchmarks/cluster; needs root), one rank per node, one thread each,
under ``horovodrun --gloo``; the HSDP setting (amendment 11) under ``torchrun`` with FSDP2, 2
ranks per node, its baseline FSDP's bfloat16 all-reduce (``hsdp-bf16``) instead of ``fp16``. A run's records go to ``SETTING/METHOD/seedS/``: ``steps.csv``,
``eval.csv``, the tail of its output (``log.txt``) and ``run.json`` (protocol version,
command, commit, machine, exit status, seconds). A run whose ``run.json`` exists is not run
again. The summary reads only runs of this protocol version and refuses any other.

Run the protocol from a checkout nobody edits while it runs (``git worktree add ../runner
HEAD``, with the built extension and ``.venv`` beside it), and copy its run directories back:
each run imports the code when it starts and records the commit, marked ``+uncommitted``
when the tree differs from it, and a change made mid-queue would reach the next run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from cluster import Cluster  # noqa: E402
from evidence import commit, machine  # noqa: E402

PROTOCOL = "evidence-v2"
OUT = REPO / "benchmarks" / "results" / PROTOCOL
SEEDS = (0, 1, 2)
EVALS_PER_EPOCH = 4
CAP_FACTOR = 2.0  # the cap: this times the baseline's mean wall time

TASKS = {  # CLI arguments of the standard schedule, and its length in epochs
    "lstm": {"args": ["--dataset", "text", "--model", "lstm", "--epochs", "6", "--lr", "0.5",
                      "--lr-milestones", "4"], "epochs": 6},
    "transformer": {"args": ["--dataset", "text", "--model", "transformer", "--optimizer", "adamw", "--epochs", "6",
                             "--lr", "0.001", "--lr-milestones", "4"], "epochs": 6},
    # amendment 11: the transformer under FSDP2's HSDP, 2 nodes x 2 ranks; the same global learning
    # rate as the transformer's 2-rank runs (0.0005 x 4 ranks = 0.001 x 2)
    "transformer-hsdp": {"args": ["--launcher", "fsdp", "--nodes", "2", "--dataset", "text", "--model", "transformer",
                                  "--optimizer", "adamw", "--epochs", "6", "--lr", "0.0005", "--lr-milestones", "4"],
                         "epochs": 6, "per_node": 2},
}
SETTINGS = {"lstm-100mbit": ("lstm", "100mbit"), "transformer-100mbit": ("transformer", "100mbit"),
            "transformer-1gbit": ("transformer", "1gbit"), "hsdp-transformer-100mbit": ("transformer-hsdp", "100mbit")}
COMMON = ["--batch-size", "32", "--interval", "0", "--eta", "0.5", "--no-progress",
          "--evals-per-epoch", str(EVALS_PER_EPOCH)]
BASELINES = {"hsdp-transformer-100mbit": "hsdp-bf16"}  # amendment 11; every other setting's is fp16
METHODS = {  # name -> CLI arguments
    "fp16": ["--codec", "fp16"],
    "powersgd-r1": ["--codec", "powersgd", "--rank", "1"],
    "powersgd-r4": ["--codec", "powersgd", "--rank", "4"],
    "powersgd-accordion": ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4"],
    "topk-1": ["--codec", "topk", "--ratio", "0.01"],
    "topk-10": ["--codec", "topk", "--ratio", "0.1"],
    "topk-accordion": ["--codec", "topk", "--ratio", "0.01", "--critical-ratio", "0.1"],
    # amendment 1: acc.AccordionCompressor() as a user got it then (Accordion without a low-rate
    # phase; amendment 3: the default again), its own detection window included; spelled out
    # since amendment 9 (it ran as --codec default --interval 100 --low-rate 0, the same configuration)
    "default-a1": ["--codec", "powersgd", "--rank", "16", "--critical-rank", "32", "--policy", "link-gate",
                   "--interval", "100", "--low-rate", "0"],
    # amendment 2: the same, critical from a tenth of the peak rate down (amendment 3: not the default)
    "default-a2": ["--codec", "powersgd", "--rank", "16", "--critical-rank", "32", "--policy", "link-gate",
                   "--interval", "100", "--low-rate", "0.1"],
    # amendment 4: the 8-bit candidate, inside the default's link gate
    "quantize8-gate": ["--codec", "quantize", "--bits", "8", "--policy", "link-gate", "--interval", "100"],
    # amendment 6: the same codec without the gate (whose 1.25x threshold kept it dense)
    "quantize8": ["--codec", "quantize", "--bits", "8", "--policy", "static", "--interval", "100"],
    # amendment 8: 8 bits in sparse chunks (5% of a step's energy may wait), inside the link gate
    "quantize8s-gate": ["--codec", "quantize", "--bits", "8", "--skip-energy", "0.05", "--policy", "link-gate",
                        "--interval", "100"],
    # amendment 10: the paper's LSTM setting (TopK 2% <-> 99%, a window of 5 epochs: 5 x 224 steps)
    "topk-paper": ["--codec", "topk", "--ratio", "0.02", "--critical-ratio", "0.99", "--interval", "1120"],
    # amendment 11 (HSDP only): FSDP2's own all-reduce with reduce_dtype=bfloat16, the baseline there,
    # and acc.AccordionCompressor() through acc.compress_hsdp (the configuration quantize8s-gate ran)
    "hsdp-bf16": ["--codec", "bf16"],
    "default": ["--codec", "default", "--interval", "100"],
}
HSDP_ONLY = ("hsdp-bf16", "default")
ONLY = {"hsdp-transformer-100mbit": HSDP_ONLY}  # a setting's methods, where not every method runs
QUALITY = "perplexity"  # lower is better, in every setting of this protocol


def run_dir(setting: str, method: str, seed: int) -> Path:
    return OUT / setting / method / f"seed{seed}"


def baseline(setting: str) -> str:
    return BASELINES.get(setting, "fp16")


def methods_of(setting: str) -> tuple[str, ...]:
    return ONLY.get(setting, tuple(m for m in METHODS if m not in HSDP_ONLY))


def baseline_runs(setting: str) -> list[dict]:
    """The baseline's finished runs of a setting (read_run of each)."""
    return [r for s in SEEDS if (r := read_run(run_dir(setting, baseline(setting), s))) is not None]


def frozen_setting(setting: str) -> dict | None:
    """The setting's target and cap, computed once from every baseline run and then frozen."""
    path = OUT / setting / "setting.json"
    if path.exists():
        return json.loads(path.read_text())
    runs = baseline_runs(setting)
    if len(runs) < len(SEEDS) or any(r["diverged"] for r in runs):
        return None
    target = statistics.mean(r["final_valid"] for r in runs)
    wall = statistics.mean(r["wall_s"] for r in runs)
    frozen = {"protocol": PROTOCOL, "target_perplexity": target, "baseline_wall_s": wall,
              "cap_s": CAP_FACTOR * wall, "from": [str(run_dir(setting, baseline(setting), s).relative_to(OUT)) for s in SEEDS]}
    path.write_text(json.dumps(frozen, indent=1) + "\n")
    return frozen


def one_run(cluster: Cluster, setting: str, method: str, seed: int, timeout: float) -> dict:
    task, rate = SETTINGS[setting]
    where = run_dir(setting, method, seed)
    extra = []
    if method != baseline(setting):
        frozen = frozen_setting(setting)
        # the standard epochs; past them, more at the final rate while the target is not reached (the CLI's rule)
        extra = ["--target", f"{frozen['target_perplexity']:.6f}", "--time-cap", f"{frozen['cap_s']:.1f}"]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["-m", "accordion_hvd.train", *TASKS[task]["args"], *COMMON, *METHODS[method], *extra,
                "--seed", str(seed), "--logdir", tmp]
        started, at_commit = time.monotonic(), commit()  # the code the run starts with
        per_node = TASKS[task].get("per_node")
        if per_node:  # torchrun on every node: node 1's output (rank 0's records), then the others'
            results = cluster.torchrun(args, timeout=timeout, per_node=per_node)
            exit_code = next((r.returncode for r in results.values() if r.returncode != 0), 0)
            output = "".join(f"--- node {k + 1} ---\n" * (k > 0) + r.stdout + r.stderr for k, r in sorted(results.items()))
            launched = f"torchrun --nnodes 2 --nproc_per_node {per_node} (node1 and node2) python "
        else:
            result = cluster.horovodrun(args, timeout=timeout)
            exit_code, output = result.returncode, result.stdout + result.stderr
            launched = "horovodrun -np 2 -H node1:1,node2:1 --gloo python "
        seconds = time.monotonic() - started
        where.mkdir(parents=True, exist_ok=True)
        for name in ("steps.csv", "eval.csv"):
            if (Path(tmp) / name).exists():
                shutil.copy(Path(tmp) / name, where / name)
    (where / "log.txt").write_text(output[-20000:])
    record = {"protocol": PROTOCOL, "setting": setting, "method": method, "seed": seed, "exit": exit_code,
              "seconds": round(seconds, 1), "command": f"{launched}{' '.join(args[:-1])} DIR",
              "commit": at_commit, "machine": machine(),
              "cluster": f"2 emulated nodes, {rate} links, {per_node or 1} rank(s) per node, 1 thread per rank"}
    (where / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_all(setting: str, methods: list[str], timeout: float, max_runs: int | None) -> None:
    base = baseline(setting)
    if any(m != base for m in methods) and frozen_setting(setting) is None:
        methods = [m for m in methods if m == base]
        print(f"{setting}: the baseline's runs are not all done: running only {base} now", flush=True)
    todo = [(m, s) for s in SEEDS for m in methods if not (run_dir(setting, m, s) / "run.json").exists()]
    todo = todo[:max_runs] if max_runs else todo
    print(f"{setting}: {len(todo)} runs now", flush=True)
    if not todo:
        return
    with Cluster(2, rate=SETTINGS[setting][1], prefix="accttq-") as cluster:
        for i, (method, seed) in enumerate(todo, 1):
            if method != base and frozen_setting(setting) is None:
                print(f"{setting}: skipping {method}: no frozen target yet", flush=True)
                continue
            record = one_run(cluster, setting, method, seed, timeout)
            print(f"[{i}/{len(todo)}] {setting} {method} seed {seed}: exit {record['exit']}, "
                  f"{record['seconds']:.0f} s", flush=True)


# ---------------------------------------------------------------- summary

def read_run(where: Path) -> dict | None:
    """A finished run's records, or None (not run, or it failed). Refuses another protocol's."""
    if not (where / "run.json").exists():
        return None
    record = json.loads((where / "run.json").read_text())
    if record.get("protocol") != PROTOCOL:
        raise SystemExit(f"{where}: a run of protocol {record.get('protocol')!r}, not {PROTOCOL!r}: "
                         f"results of two protocol versions are never mixed in one table")
    if record["exit"] != 0 or not (where / "eval.csv").exists():
        return None
    with open(where / "eval.csv") as f:
        evals = [r for r in csv.DictReader(f) if r[QUALITY]]
    with open(where / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    log = (where / "log.txt").read_text()
    final = re.findall(r"final test perplexity: ([0-9.]+|inf|nan)", log)
    task = SETTINGS[record["setting"]][0]
    standard = [r for r in evals if int(r["epoch"]) == TASKS[task]["epochs"]]
    walls = [float(r["wall_s"]) for r in steps]
    return {"evals": evals, "wall_s": float(evals[-1]["wall_s"]), "final_valid": float(evals[-1][QUALITY]),
            "standard_valid": float(standard[0][QUALITY]) if standard else math.nan,
            "test": float(final[-1]) if final else math.nan, "floats": int(steps[-1]["floats_sent"]),
            "step_s": statistics.median(b - a for a, b in zip(walls, walls[1:])) if len(walls) > 1 else math.nan,
            "diverged": "diverged" in log, "cpu": record["machine"]}


def reached_at(evals: list[dict], target: float) -> float | None:
    for row in evals:
        if float(row[QUALITY]) <= target:
            return float(row["wall_s"])
    return None


def best_by(evals: list[dict], seconds: float) -> float:
    """The best validation perplexity among the evaluations made by ``seconds``."""
    return min((float(r[QUALITY]) for r in evals if float(r["wall_s"]) <= seconds), default=math.inf)


def summarize() -> list[str]:
    lines = [f"# Time to quality ({PROTOCOL})", "",
             f"Protocol: [`benchmarks/protocols/{PROTOCOL}.md`](../protocols/{PROTOCOL}.md), committed before the runs. "
             f"`.venv/bin/python benchmarks/time_to_quality.py --summarize`; raw runs in [{PROTOCOL}/]({PROTOCOL}/).", ""]
    for setting in SETTINGS:
        frozen = frozen_setting(setting)
        base_method = baseline(setting)
        runs = {m: {s: r for s in SEEDS if (r := read_run(run_dir(setting, m, s))) is not None}
                for m in methods_of(setting)}
        if not any(runs.values()):
            continue
        lines += [f"## {setting}", ""]
        if frozen is None:
            lines += [f"The baseline's runs are not all done ({len(runs[base_method])} of {len(SEEDS)}): no target yet.", ""]
            continue
        target, base = frozen["target_perplexity"], frozen["baseline_wall_s"]
        # amendment 1: the quality every baseline seed delivered (its worst final), a secondary measure
        worst = max(r["standard_valid"] for r in runs[base_method].values())
        lines += [f"Target: validation perplexity {target:.2f} (the mean final validation perplexity of {base_method}'s "
                  f"{len(SEEDS)} runs); the baseline's mean wall time {base:.0f} s; cap {frozen['cap_s']:.0f} s. "
                  f"Secondary (amendment 1): time to {worst:.2f}, the worst of the baseline's final validation "
                  f"perplexities, a quality every baseline run delivered.", "",
                  "| method | runs | reached the target | time to target, mean s (x baseline) | sd s | "
                  f"time to {worst:.2f}, mean s (x baseline) | validation at the "
                  "baseline's time | validation after the standard epochs | test (end of run) | floats sent per rank | "
                  "median step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for method, got in runs.items():
            if not got:
                continue
            times = {s: reached_at(r["evals"], target) for s, r in got.items()}
            hit = [t for t in times.values() if t is not None]
            missed = [f"seed {s}: best {min(float(e[QUALITY]) for e in got[s]['evals']):.2f}"
                      + (", diverged" if got[s]["diverged"] else "") for s, t in times.items() if t is None]
            mean = f"{statistics.mean(hit):.0f} ({statistics.mean(hit) / base:.2f}x)" if len(hit) == len(got) else \
                (f"not reached in {len(missed)} ({'; '.join(missed)})" if missed else "-")
            sd = f"{statistics.stdev(hit):.0f}" if len(hit) > 1 else "-"

            def mean_sd(values):
                values = [v for v in values if math.isfinite(v)]
                return f"{statistics.mean(values):.2f}" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1
                                                           else "") if values else "-"
            to_worst = [t for r in got.values() if (t := reached_at(r["evals"], worst)) is not None]
            worst_cell = (f"{statistics.mean(to_worst):.0f} ({statistics.mean(to_worst) / base:.2f}x)"
                          if len(to_worst) == len(got) else f"{len(to_worst)} of {len(got)} reached")
            lines.append(f"| {method} | {len(got)} | {len(hit)} of {len(got)} | {mean} | {sd} | {worst_cell} | "
                         f"{mean_sd([best_by(r['evals'], base) for r in got.values()])} | "
                         f"{mean_sd([r['standard_valid'] for r in got.values()])} | "
                         f"{mean_sd([r['test'] for r in got.values()])} | "
                         f"{statistics.mean(r['floats'] for r in got.values()):.3g} | "
                         f"{statistics.median(r['step_s'] for r in got.values()):.3f} |")
        lines += ["", f"![validation perplexity against wall time, {setting}]({PROTOCOL}/{setting}.png)", ""]
        plot(setting, runs, target)
    return lines


def plot(setting: str, runs: dict, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for i, (method, got) in enumerate((m, got) for m, got in runs.items() if got):  # colours: the methods run
        for j, (seed, r) in enumerate(sorted(got.items())):
            xs = [float(e["wall_s"]) for e in r["evals"]]
            ys = [float(e[QUALITY]) for e in r["evals"]]
            ax.plot(xs, ys, styles[i % len(styles)], color=f"C{i}", alpha=0.8, label=method if j == 0 else None)
    ax.axhline(target, color="black", linewidth=1, label=f"target {target:.2f}")
    ax.set(xlabel="wall time, s", ylabel="validation perplexity", title=f"{setting} ({PROTOCOL})",
           ylim=(target * 0.9, target * 2))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / f"{setting}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS))
    p.add_argument("--methods", default=None, help="comma-separated, of: " + ", ".join(METHODS) +
                   "; default: every method of the setting (" + ", ".join(HSDP_ONLY) + " are HSDP's only)")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many runs (resumable)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds one run may take")
    p.add_argument("--summarize", action="store_true")
    args = p.parse_args()
    if args.summarize:
        from results_archive import restore  # the raw runs: unpacked from their archive if missing
        restore(OUT)
        (REPO / "benchmarks" / "results" / f"{PROTOCOL}.md").write_text("\n".join(summarize()) + "\n")
        print(f"wrote benchmarks/results/{PROTOCOL}.md")
        return
    if args.setting is None:
        p.error("--setting is required unless --summarize")
    allowed = methods_of(args.setting)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(allowed)
    unknown = sorted(set(methods) - set(allowed))
    if unknown:
        p.error(f"--methods: {unknown} not run on {args.setting}; its methods are {list(allowed)}")
    run_all(args.setting, methods, args.timeout, args.max_runs)


if __name__ == "__main__":
    main()
