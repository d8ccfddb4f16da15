"""The runs of protocol evidence-v4 (benchmarks/protocols/evidence-v4.md), per machine, resumable.

    .venv/bin/python benchmarks/evidence_v4.py --sitting lstm                    # this machine's step-time sitting
    .venv/bin/python benchmarks/evidence_v4.py --setting lstm-100mbit --methods ddp-fp16
    .venv/bin/python benchmarks/evidence_v4.py --setting lstm-10mbit --methods diloco-v4
    .venv/bin/python benchmarks/evidence_v4.py --sitting-peers lstm              # the peers' sitting (amendment 1)
    .venv/bin/python benchmarks/evidence_v4.py --setting lstm-100mbit --methods default,torch-localsgd,diloco-paper
    .venv/bin/python benchmarks/evidence_v4.py --status                          # what is done on this machine
    .venv/bin/python benchmarks/evidence_v4.py --machine amd-epyc-vm-b --sitting heldout  # a VM of its own (amendment 4)

evidence-v3's tasks, emulated cluster, CLI and records (benchmarks/evidence_v3.py ``run_cli``),
with one difference in where things go: every run, sitting, target, cap and floor belongs to
**the machine it was measured on** (its CPU model, benchmarks/machine.py), under
``benchmarks/results/evidence-v4/MACHINE/``. The sessions that run these do not always get the
same CPU, and a time measured on one is never compared with a time measured on another.

On a machine: the sitting of a task first (the compute-only step and the baselines' steps at
every rate), then the baseline's 3 seeds at 100 Mbit/s (they set the target: its mean final
validation perplexity; and the cap: the smaller of twice its mean wall time, computed away from
100 Mbit/s, and 4x the compute floor, frozen in ``SETTING/setting.json``), then the method,
measured at every rate with ``--target`` and ``--time-cap``; the peers (amendment 1) likewise, those
whose trajectory in steps does not depend on the link (``COMPUTED``) at 100 Mbit/s only, their
other rates computed from the peers' sitting. Run it from a checkout nobody edits while it runs:
each run records its commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from cluster import Cluster  # noqa: E402
import evidence_v3 as v3  # noqa: E402
import evidence_v3_cells as cells  # noqa: E402
from machine import cpu_model, cpu_signature  # noqa: E402

PROTOCOL = "evidence-v4"
SEEDS, PILOT_SEED = (0, 1, 2), 3
CAP_FACTOR, CAP_FLOORS = 2.0, 4.0
TASKS = ("lstm", "transformer", "heldout")
RATES = ("10mbit", "100mbit", "1gbit")
# the held-out task (amendment 2, v3's GRU on torch's source): scored at 10 Mbit/s; its 100 Mbit/s
# setting holds the runs its computed cells come from
TASK_RATES = {"lstm": RATES, "transformer": RATES, "heldout": ("10mbit", "100mbit")}
SETTINGS = {f"{task}-{rate}": (task, rate) for task in TASKS for rate in TASK_RATES[task]}
HELDOUT = "heldout"
BASELINE = "ddp-fp16"
METHODS = {
    "ddp-fp16": v3.METHODS["ddp-fp16"],
    "hvd-fp16": v3.METHODS["hvd-fp16"],  # only if the sitting shows its step faster (the protocol)
    # acc.DiLoCo(model, opt) as the library's defaults are at the protocol's commit, with the
    # compressor's windows of 16 rounds (the CLI's --interval; acc.DiLoCo's own default compressor)
    "diloco-v4": ("ddp", ["--launcher", "ddp", "--codec", "default", "--interval", "16", "--sync", "diloco"]),
    # the peers (amendment 1): v3's definitions; diloco-paper's H is v3's pilot's (method_args)
    "default": v3.METHODS["default"],
    "torch-localsgd": v3.METHODS["torch-localsgd"],
    "diloco-paper": ("ddp", []),
}
PEERS = ("default", "torch-localsgd", "diloco-paper")
# Methods whose trajectory in steps does not depend on the link: measured at 100 Mbit/s only,
# their times at the other rates computed from a sitting (v3's rule); the others run at every rate.
COMPUTED = ("ddp-fp16", "hvd-fp16", "torch-localsgd", "diloco-paper")
SITTING_METHODS = ("floor", "ddp-fp16", "hvd-fp16")
# the peers' sitting: the floor and the computed peers, by their sitting names (v3's: localsgd-p4, diloco-h256)
PEER_SITTING_METHODS = ("floor", *(cells.SITTING_METHOD[m] for m in COMPUTED if m in PEERS))


def machine_slug(model: str | None = None) -> str:
    """The CPU model as a folder name: "Intel(R) Xeon(R) Processor @ 2.80GHz" -> "intel-xeon-processor-2.80ghz"."""
    text = (model or cpu_model()).lower().replace("(r)", "").replace("(tm)", "").replace("@", " ")
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in text).split())


OUT = REPO / "benchmarks" / "results" / PROTOCOL / machine_slug()


def run_dir(setting: str, method: str, seed: int) -> Path:
    return OUT / setting / method / f"seed{seed}"


def method_args(method: str, task: str) -> tuple[str, list[str]]:
    """(launcher, CLI arguments) of a method on ``task``."""
    return v3.method_args_of(method, task) if method == "diloco-paper" else METHODS[method]


def peers_sitting(out: Path, task: str) -> Path:
    """The peers' sitting of a task on a machine (amendment 1), beside the task's own."""
    return out / f"step-time-peers-{cells.SITTING_MODEL[task]}.csv"


def step_times(out: Path, task: str) -> dict[tuple[str, str], float] | None:
    """(rate, sitting method) -> median step, from the task's sitting and the peers' sitting on
    one machine (the task's sitting wins where both have a method: its floor sets the floor)."""
    task_sitting, peers = cells.sitting_file(out, task), peers_sitting(out, task)
    if not task_sitting.exists():
        return None
    return {**(cells.step_times(peers) if peers.exists() else {}), **cells.step_times(task_sitting)}


def cpu_of(machine: str) -> str:
    """The CPU model of a run.json's ``machine`` ("host, CPU, Python x.y")."""
    parts = machine.split(", ")
    return parts[1] if len(parts) > 2 else machine


def setting_of(out: Path, setting: str) -> dict | None:
    """Target, cap and floor of a setting from the runs and sitting under ``out`` (one machine's
    folder), once the baseline's 3 runs at 100 Mbit/s and the task's sitting are there (the
    protocol, "Settings, baseline, target, floor, cap"); None before. Writes nothing."""
    task, rate = SETTINGS[setting]
    source = f"{task}-100mbit"
    runs = [out / source / BASELINE / f"seed{s}" for s in SEEDS]
    finals = [v3.final_and_wall(where, PROTOCOL) for where in runs]
    sitting_csv = cells.sitting_file(out, task)
    if any(f is None for f in finals) or not sitting_csv.exists():
        return None
    times = cells.step_times(sitting_csv)
    if (rate, "floor") not in times or (rate, BASELINE) not in times:  # (the sitting's rounds at the rate failed)
        return None
    records = [cells.records(where) for where in runs]
    if rate == "100mbit":
        wall = statistics.mean(w for _, w in finals)
    else:
        step_s = cells.step_time(times, rate, BASELINE)
        wall = statistics.mean(cells.computed_walls(e, w, step_s)[-1] for e, w in records)
    floor = cells.floor_seconds(records, times[(rate, "floor")])
    machines = {cpu_of(json.loads((where / "run.json").read_text())["machine"]) for where in runs}
    if len(machines) > 1:  # (a run copied into another machine's folder)
        raise SystemExit(f"{out / source / BASELINE}: runs of {sorted(machines)} in one machine's folder")
    frozen = {"protocol": PROTOCOL, "machine": ", ".join(sorted(machines)), "baseline": BASELINE,
              "baseline_wall_s": wall, "target_perplexity": statistics.mean(f for f, _ in finals), "floor_s": floor,
              "cap_s": min(CAP_FACTOR * wall, CAP_FLOORS * floor),
              "from": [str(where.relative_to(out)) for where in runs], "sitting": sitting_csv.name}
    if rate != "100mbit":
        frozen["computed"] = f"the baseline's wall time computed from {source}'s runs and {sitting_csv.name}"
    return frozen


def frozen_setting(setting: str) -> dict | None:
    """``setting_of`` this machine's folder, frozen in ``SETTING/setting.json`` the first time it
    exists (before the first run that reads its target and cap)."""
    path = OUT / setting / "setting.json"
    if path.exists():
        return json.loads(path.read_text())
    frozen = setting_of(OUT, setting)
    if frozen is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(frozen, indent=1) + "\n")
    return frozen


def run_sitting(task: str, rounds: int, peers: bool = False) -> None:
    """The task's step-time sitting on this machine (benchmarks/step_time.py, interleaved rounds),
    or with ``peers`` the peers' sitting (amendment 1)."""
    out = (peers_sitting(OUT, task) if peers else cells.sitting_file(OUT, task)).with_suffix(".md")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_time.py"), "--models",
                    cells.SITTING_MODEL[task], "--nodes", "2", "--rates", ",".join(TASK_RATES[task]),
                    "--rounds", str(rounds), "--methods", ",".join(PEER_SITTING_METHODS if peers else SITTING_METHODS),
                    "--out", str(out)], check=True)


def run_all(setting: str, methods: list[str], seeds: tuple[int, ...], timeout: float) -> None:
    task, rate = SETTINGS[setting]
    todo = [(m, s) for s in seeds for m in methods if not (run_dir(setting, m, s) / "run.json").exists()]
    print(f"{setting} on {OUT.name}: {len(todo)} runs now", flush=True)
    with Cluster(2, rate=rate, prefix="accv4-") as cluster:
        for method, seed in todo:
            launcher, args = method_args(method, task)
            extra = []
            if method not in ("ddp-fp16", "hvd-fp16") and seed != PILOT_SEED:  # the baselines set the target
                frozen = frozen_setting(setting)
                if frozen is None:
                    raise SystemExit(f"{setting}: no target yet on this machine (the baseline's runs at 100 Mbit/s "
                                     f"and the sitting of {task} come first)")
                extra = ["--target", f"{frozen['target_perplexity']:.6f}", "--time-cap", f"{frozen['cap_s']:.1f}"]
            # "cpu": family, model, stepping beside run.json's CPU name, which two VMs shared (amendment 3)
            record = v3.run_cli(cluster, launcher, [*v3.TASKS[task], *v3.COMMON, *args, *extra,
                                                    "--seed", str(seed)], run_dir(setting, method, seed),
                                {"protocol": PROTOCOL, "setting": setting, "method": method, "seed": seed,
                                 "cpu": cpu_signature()}, timeout)
            print(f"{setting} {method} seed {seed}: exit {record['exit']}, {record['seconds']:.0f} s", flush=True)


def main() -> None:
    global OUT  # every function here reads the machine's folder from OUT (--machine)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=sorted(SETTINGS))
    p.add_argument("--methods", default="diloco-v4", help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--seeds", default="0,1,2", help=f"comma-separated; {PILOT_SEED} is the pilot seed, never scored")
    p.add_argument("--sitting", choices=TASKS, help="run this task's step-time sitting on this machine")
    p.add_argument("--sitting-peers", choices=TASKS, help="run the peers' step-time sitting of this task (amendment 1)")
    p.add_argument("--rounds", type=int, default=3, help="the sitting's interleaved rounds")
    p.add_argument("--timeout", type=float, default=7200, help="seconds one run may take")
    p.add_argument("--status", action="store_true")
    p.add_argument("--machine", default=OUT.name,
                   help="this machine's folder under benchmarks/results/evidence-v4/ (default: the CPU model, "
                        f"here {OUT.name!r}); amendment 4: a VM told apart from another of the same CPU model "
                        "(instances/README.md) keeps its own folder, e.g. amd-epyc-vm-b")
    args = p.parse_args()
    if not args.machine or args.machine != Path(args.machine).name or args.machine in (".", "..", "instances"):
        p.error(f"--machine: a plain folder name other than 'instances', not {args.machine!r}")
    OUT = OUT.parent / args.machine
    if args.status:
        for setting in SETTINGS:
            done = {m: sum((run_dir(setting, m, s) / "run.json").exists() for s in SEEDS) for m in METHODS}
            frozen = frozen_setting(setting)
            print(f"{OUT.name} {setting}: " + (f"target {frozen['target_perplexity']:.2f}, floor {frozen['floor_s']:.0f} s"
                                               if frozen else "no target yet") + "; " +
                  ", ".join(f"{m} {n}/3" for m, n in done.items() if n))
        return
    if args.sitting or args.sitting_peers:
        return run_sitting(args.sitting or args.sitting_peers, args.rounds, peers=bool(args.sitting_peers))
    if args.setting is None:
        p.error("--setting, --sitting, --sitting-peers or --status")
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS):
        p.error(f"--methods: {sorted(set(methods) - set(METHODS))} unknown; the methods are {list(METHODS)}")
    task, rate = SETTINGS[args.setting]
    if task == HELDOUT and rate == "100mbit" and set(methods) - set(COMPUTED):
        p.error(f"{sorted(set(methods) - set(COMPUTED))} run at {HELDOUT}-10mbit; {HELDOUT}-100mbit holds the "
                "runs of the computed methods (amendment 2)")
    if rate != "100mbit" and set(methods) & set(COMPUTED):
        p.error(f"{sorted(set(methods) & set(COMPUTED))} run at 100 Mbit/s; their times at the other rates are "
                "computed (the protocol)")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    if any(s not in (*SEEDS, PILOT_SEED) for s in seeds):
        p.error(f"--seeds: the protocol's seeds are {SEEDS} and the pilot seed {PILOT_SEED}")
    run_all(args.setting, methods, seeds, args.timeout)


if __name__ == "__main__":
    main()
