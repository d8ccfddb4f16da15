"""The runs of protocol evidence-v3 (benchmarks/protocols/evidence-v3.md), resumable.

    .venv/bin/python benchmarks/evidence_v3.py --setting lstm-100mbit --methods hvd-fp16,ddp-fp16
    .venv/bin/python benchmarks/evidence_v3.py --setting lstm-100mbit --max-runs 2   # the next 2 runs left
    .venv/bin/python benchmarks/evidence_v3.py --status                             # what is done, per cell

A setting is a task on a link rate. Its two 16-bit baselines (Horovod's fp16 compression and
DDP's ``fp16_compress_hook``) run first, 3 seeds, no target; once all six are done the faster
one (shorter mean wall time) sets the setting's target (its mean final validation perplexity)
and cap (twice its mean wall time), frozen in ``SETTING/setting.json``; every other method then
runs with ``--target`` and ``--time-cap``. Every run happens on 2 emulated nodes
(benchmarks/cluster; needs root), one rank per node, one thread each: Horovod's methods under
``horovodrun --gloo``, DDP's and the periodic ones under ``torchrun``. Records per run in
``benchmarks/results/evidence-v3/SETTING/METHOD/seedS/`` as evidence-v2's (``steps.csv``,
``eval.csv``, ``log.txt``, ``run.json``); a run whose ``run.json`` exists is not run again.

Which cells are measured at which rate, and which are computed from the 100 Mbit/s
trajectory and a measured step time, is the protocol's (its "Cells" table); this runner only
runs what it is asked to and refuses a method the protocol does not run at a setting. The
periodic methods run under torchrun with the CLI's ``--sync`` (cli/periodic.py); DiLoCo's H for
``diloco-paper`` and ``diloco-h-ours`` comes from the pilot (``pilot-diloco-h16/64/256``, seed 3,
100 Mbit/s, the standard schedule) through the protocol's amendment into ``DILOCO_H``. Run it from a checkout nobody edits while it runs
(time_to_quality.py's docstring says how): each run records its commit.
"""

from __future__ import annotations

import argparse
import json
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
import evidence_v3_cells as cells  # noqa: E402
from evidence import commit, machine  # noqa: E402

PROTOCOL = "evidence-v3"
OUT = REPO / "benchmarks" / "results" / PROTOCOL
SEEDS = (0, 1, 2)
PILOT_SEED = 3  # never scored (the protocol)
CAP_FACTOR = 2.0

TASKS = {  # evidence-v2's tasks, unchanged, and the held-out one (the protocol, amendment 1)
    "lstm": ["--dataset", "text", "--model", "lstm", "--epochs", "6", "--lr", "0.5", "--lr-milestones", "4"],
    "transformer": ["--dataset", "text", "--model", "transformer", "--optimizer", "adamw", "--epochs", "6",
                    "--lr", "0.001", "--lr-milestones", "4"],
    "heldout": ["--dataset", "torch-source", "--model", "gru", "--optimizer", "adamw", "--epochs", "6",
                "--lr", "0.002", "--lr-milestones", "4"],
}
RATES = ("10mbit", "100mbit", "1gbit")
TASK_RATES = {"lstm": RATES, "transformer": RATES, "heldout": ("10mbit", "100mbit")}
SETTINGS = {f"{task}-{rate}": (task, rate) for task, rates in TASK_RATES.items() for rate in rates}
COMMON = ["--batch-size", "32", "--interval", "0", "--eta", "0.5", "--no-progress", "--evals-per-epoch", "4"]
METHODS = {  # name -> (launcher, CLI arguments), the protocol's table
    "hvd-fp16": ("horovod", ["--codec", "fp16"]),
    "ddp-fp16": ("ddp", ["--launcher", "ddp", "--codec", "fp16"]),
    "default": ("horovod", ["--codec", "default", "--interval", "100"]),
    "quantize-accordion": ("horovod", ["--codec", "quantize", "--bits", "8", "--critical-bits", "16",
                                       "--policy", "accordion", "--interval", "100"]),
    "batch-accordion": ("horovod", ["--codec", "none", "--batch-mode", "--large-passes", "8"]),
    "torch-localsgd": ("ddp", ["--launcher", "ddp", "--codec", "none", "--sync", "torch-localsgd", "--sync-every", "4",
                               "--localsgd-warmup", "100"]),
    "diloco-auto": ("ddp", ["--launcher", "ddp", "--codec", "default", "--interval", "100", "--sync", "diloco",
                            "--sync-every", "auto"]),
    "diloco-paper": ("ddp", []),   # (arguments: method_args_of, with the pilot's H)
    "diloco-h-ours": ("ddp", []),
}
# DiLoCo's H per task, from the pilot: the protocol's amendment names it; until then the two
# methods that use it (their arguments made in method_args) refuse to run.
DILOCO_H: dict[str, int] = {"lstm": 256, "transformer": 256, "heldout": 256}  # amendment 2
PILOT_H = (16, 64, 256)
WITH_H = ("diloco-paper", "diloco-h-ours")


def diloco_args(h: int, ours: bool) -> list[str]:
    return ["--launcher", "ddp", "--codec", "default" if ours else "none", *(["--interval", "100"] if ours else []),
            "--sync", "diloco", "--sync-every", str(h)]


# The pilot (seed 3 only, the standard schedule, never scored): diloco-paper at each H, and
# diloco-auto to fix its ladder.
PILOTS = {f"pilot-diloco-h{h}": ("ddp", diloco_args(h, ours=False)) for h in PILOT_H}
PILOTS["pilot-diloco-auto"] = METHODS["diloco-auto"]
BASELINES = ("hvd-fp16", "ddp-fp16")
# The protocol's cells: where a method runs (the others' figures at 10 Mbit/s and 1 Gbit/s
# are computed from their 100 Mbit/s runs); the 1 Gbit/s check of the faster baseline is seed 0 only.
MEASURED_EVERYWHERE = ("default", "diloco-auto")
# The held-out setting (amendment 3): these methods only; the baselines, torch-localsgd and
# diloco-paper at 100 Mbit/s (their 10 Mbit/s figures computed), default and diloco-auto
# measured at 10 Mbit/s, the setting the bars read.
HELDOUT_METHODS = ("hvd-fp16", "ddp-fp16", "default", "torch-localsgd", "diloco-paper", "diloco-auto")


def run_dir(setting: str, method: str, seed: int) -> Path:
    return OUT / setting / method / f"seed{seed}"


def runs_at(setting: str, method: str) -> bool:
    task, rate = SETTINGS[setting]
    if method in PILOTS:
        return rate == "100mbit" and task != "heldout"
    if task == "heldout":
        return method in HELDOUT_METHODS and (rate == "10mbit") == (method in MEASURED_EVERYWHERE)
    return rate == "100mbit" or method in MEASURED_EVERYWHERE or (rate == "1gbit" and method in BASELINES)


def final_and_wall(where: Path, protocol: str = PROTOCOL) -> tuple[float, float] | None:
    """A finished run's final validation perplexity and wall time (its last evaluation); a run
    of another protocol than ``protocol`` is refused."""
    if not (where / "run.json").exists():
        return None
    record = json.loads((where / "run.json").read_text())
    if record.get("protocol") != protocol:
        raise SystemExit(f"{where}: a run of protocol {record.get('protocol')!r}, not {protocol!r}")
    if record["exit"] != 0 or not (where / "eval.csv").exists():
        return None
    rows = (where / "eval.csv").read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    return float(last[header.index("perplexity")]), float(last[header.index("wall_s")])


def frozen_setting(setting: str) -> dict | None:
    """The setting's target and cap from the faster baseline, computed once all six baseline
    runs are done and then frozen in ``SETTING/setting.json``. The baselines run at 100 Mbit/s;
    at another rate their wall times are computed (evidence_v3_cells: steps x the step-time
    sitting's step at that rate + their evaluations), so those settings wait for the sitting,
    and their cap is twice the computed time, not the 100 Mbit/s one."""
    task, rate = SETTINGS[setting]
    source, path = f"{task}-100mbit", OUT / setting / "setting.json"
    if path.exists():
        return json.loads(path.read_text())
    read = {m: {where: got for s in SEEDS if (got := final_and_wall(where := run_dir(source, m, s))) is not None}
            for m in BASELINES}  # each run's (final perplexity, wall), read once
    if any(len(runs) < len(SEEDS) for runs in read.values()):
        return None
    done = {m: list(runs) for m, runs in read.items()}
    finals = {m: [final for final, _ in runs.values()] for m, runs in read.items()}
    if rate == "100mbit":
        walls = {m: statistics.mean(wall for _, wall in runs.values()) for m, runs in read.items()}
    else:
        sitting = cells.sitting_file(OUT, task)
        if not sitting.exists():
            return None
        times = cells.step_times(sitting)
        walls = {m: statistics.mean(cells.computed_walls(*cells.records(where), cells.step_time(times, rate, m))[-1]
                                    for where in runs) for m, runs in done.items()}
    faster = min(walls, key=walls.get)
    frozen = {"protocol": PROTOCOL, "baseline": faster, "baseline_wall_s": walls[faster], "mean_wall_s": walls,
              "target_perplexity": statistics.mean(finals[faster]), "cap_s": CAP_FACTOR * walls[faster],
              "from": [str(run_dir(source, m, s).relative_to(OUT)) for m in BASELINES for s in SEEDS]}
    if rate != "100mbit":
        frozen["computed"] = f"wall times computed from {source}'s runs and {sitting.relative_to(OUT)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(frozen, indent=1) + "\n")
    return frozen


def one_run(cluster: Cluster, setting: str, method: str, seed: int, timeout: float) -> dict:
    task, rate = SETTINGS[setting]
    launcher, method_args = method_args_of(method, task)
    extra = []
    if method not in BASELINES and method not in PILOTS:  # a pilot runs the standard schedule, no target
        frozen = frozen_setting(setting)
        extra = ["--target", f"{frozen['target_perplexity']:.6f}", "--time-cap", f"{frozen['cap_s']:.1f}"]
    return run_cli(cluster, launcher, [*TASKS[task], *COMMON, *method_args, *extra, "--seed", str(seed)],
                   run_dir(setting, method, seed),
                   {"protocol": PROTOCOL, "setting": setting, "method": method, "seed": seed}, timeout)


def run_cli(cluster: Cluster, launcher: str, cli_args: list[str], where: Path, record: dict, timeout: float) -> dict:
    """Run the training CLI with ``cli_args`` on the cluster's 2 nodes (``launcher``: horovod
    or torchrun); its records into ``where`` (steps.csv, eval.csv, log.txt, run.json: ``record``
    and the run's exit, seconds, command, commit, machine and cluster)."""
    rate = cluster.rate
    with tempfile.TemporaryDirectory() as tmp:
        args = ["-m", "accordion_hvd.train", *cli_args, "--logdir", tmp]
        started, at_commit = time.monotonic(), commit()
        if launcher == "horovod":
            result = cluster.horovodrun(args, timeout=timeout)
            exit_code, output = result.returncode, result.stdout + result.stderr
            launched = "horovodrun -np 2 -H node1:1,node2:1 --gloo python "
        else:
            results = cluster.torchrun(args, timeout=timeout, per_node=1)
            exit_code = next((r.returncode for r in results.values() if r.returncode != 0), 0)
            output = "".join(f"--- node {k + 1} ---\n" * (k > 0) + r.stdout + r.stderr
                             for k, r in sorted(results.items()))
            launched = "torchrun --nnodes 2 --nproc_per_node 1 (node1 and node2) python "
        seconds = time.monotonic() - started
        where.mkdir(parents=True, exist_ok=True)
        for name in ("steps.csv", "eval.csv"):
            if (Path(tmp) / name).exists():
                shutil.copy(Path(tmp) / name, where / name)
    (where / "log.txt").write_text(output[-20000:])
    record = {**record, "exit": exit_code, "seconds": round(seconds, 1), "command": f"{launched}{' '.join(args[:-1])} DIR",
              "commit": at_commit, "machine": machine(),
              "cluster": f"2 emulated nodes, {rate} links, 1 rank per node, 1 thread per rank"}
    (where / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def method_args_of(method: str, task: str) -> tuple[str, list[str]]:
    """(launcher, CLI arguments) of a method or pilot on ``task``."""
    if method in WITH_H:
        if task not in DILOCO_H:
            raise SystemExit(f"{method}: DiLoCo's H for {task} is not fixed yet (the pilot's amendment sets DILOCO_H)")
        return "ddp", diloco_args(DILOCO_H[task], ours=method == "diloco-h-ours")
    return METHODS[method] if method in METHODS else PILOTS[method]


def run_all(setting: str, methods: list[str], seeds: tuple[int, ...], timeout: float, max_runs: int | None) -> None:
    if any(m not in BASELINES and m not in PILOTS for m in methods) and frozen_setting(setting) is None:
        methods = [m for m in methods if m in BASELINES or m in PILOTS]
        print(f"{setting}: the baselines' runs (or, away from 100 Mbit/s, the step-time sitting) are not all done: "
              f"running only {methods} now", flush=True)
    todo = [(m, s) for s in seeds for m in methods if not (run_dir(setting, m, s) / "run.json").exists()]
    todo = todo[:max_runs] if max_runs else todo
    print(f"{setting}: {len(todo)} runs now", flush=True)
    if not todo:
        return
    with Cluster(2, rate=SETTINGS[setting][1], prefix="accv3-") as cluster:
        for i, (method, seed) in enumerate(todo, 1):
            record = one_run(cluster, setting, method, seed, timeout)
            print(f"[{i}/{len(todo)}] {setting} {method} seed {seed}: exit {record['exit']}, "
                  f"{record['seconds']:.0f} s", flush=True)


def status() -> None:
    for setting in SETTINGS:
        cells = []
        for method in METHODS:
            if not runs_at(setting, method):
                continue
            done = sum((run_dir(setting, method, s) / "run.json").exists() for s in SEEDS)
            cells.append(f"{method} {done}/{len(SEEDS)}")
        frozen = frozen_setting(setting)
        target = f"target {frozen['target_perplexity']:.2f} ({frozen['baseline']})" if frozen else "no target yet"
        print(f"{setting}: {target}; " + ", ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS))
    p.add_argument("--methods", default=None, help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                   help=f"comma-separated; {PILOT_SEED} is the pilot seed, never scored")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many runs (resumable)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds one run may take")
    p.add_argument("--status", action="store_true", help="what is done, per setting and method")
    args = p.parse_args()
    if args.status:
        return status()
    if args.setting is None:
        p.error("--setting is required unless --status")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(METHODS)
    unknown = sorted(set(methods) - set(METHODS) - set(PILOTS))
    if unknown:
        p.error(f"--methods: {unknown} unknown; the methods are {list(METHODS)}, the pilots {list(PILOTS)}")
    pilots = [m for m in methods if m in PILOTS]
    if pilots and (set(methods) - set(PILOTS) or args.seeds != str(PILOT_SEED)
                   or SETTINGS[args.setting][1] != "100mbit"):
        p.error(f"the pilots run alone, on --seeds {PILOT_SEED}, at 100 Mbit/s (the protocol)")
    elsewhere = [m for m in methods if not runs_at(args.setting, m)]
    if elsewhere:
        where = [s for s in SETTINGS if all(runs_at(s, m) for m in elsewhere)]
        p.error(f"--methods: {elsewhere} do not run at {args.setting} (the protocol's cells: "
                f"{args.setting}'s figures of theirs are computed, or never made); they run at {where}")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    if any(s not in (*SEEDS, PILOT_SEED) for s in seeds):
        p.error(f"--seeds: the protocol's seeds are {SEEDS} and the pilot seed {PILOT_SEED}")
    run_all(args.setting, methods, seeds, args.timeout, args.max_runs)


if __name__ == "__main__":
    main()
