"""The one runner of an evidence protocol written as data (benchmarks/protocols/NAME.toml).

    .venv/bin/python benchmarks/protocol.py evidence-v5 plan                     # every run, in order, done or not
    .venv/bin/python benchmarks/protocol.py evidence-v5 run --task transformer --methods ddp-fp16
    .venv/bin/python benchmarks/protocol.py evidence-v5 freeze --task transformer  # after the baseline's seeds
    .venv/bin/python benchmarks/protocol.py evidence-v5 run --task transformer --methods ours-adamw --seeds 0
    .venv/bin/python benchmarks/protocol.py evidence-v5 pack                     # raw runs into the archive

A **run** is the training CLI (``python -m accordion_hvd.train``) with the task's, the protocol's
and the method's flags, on 2 ranks, one thread each. Its **trajectory** (steps.csv: per optimizer
step what crossed the wire; eval.csv: the validation score at each evaluation) is what the
protocol scores; its wall time is computed from the trajectory and a sitting's costs (the
protocol's accounting), never read from the run. So a method whose decisions read no clock
(``clock = false``) runs once on this machine's own loopback and its trajectory serves every
rate; one that reads a clock (the link gate, a link-aware interval) runs on the emulated cluster
(benchmarks/cluster, needs root) at each rate it is scored at.

Order and freezing: the baseline's seeds run first, on the schedule and then on at the final
learning rate to ``extend`` times it; ``freeze`` then writes the task's target (the mean of their
finals at the schedule's end), the schedule's length, each method's ``--freeze-step``, and the
step cap of every other run (``cap_floors`` times the baseline's mean steps to the target: no
method's step costs less than the compute floor's, so a run past that many steps is past the
cap in time) into ``benchmarks/results/NAME/TASK.json``; every later run of the task is read
against that file. A method with a ``commit`` runs from a git worktree of that commit, built
there. Each run records its command, commit, exit and seconds in run.json; a run with a
run.json is done (delete its folder to run it again); a run that diverges is recorded so and the
runner goes on. Raw runs live in ``benchmarks/results/NAME/runs/`` (git-ignored) and go into one
archive per protocol (``pack``: benchmarks/results_archive.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
import results_archive  # noqa: E402
from cluster import Cluster  # noqa: E402

PYTHON = sys.executable
TIMEOUT_S = 6 * 3600  # one run, at the slowest rate and the cap


class Protocol:
    """A protocol's data (benchmarks/protocols/NAME.toml) and where its runs go."""

    def __init__(self, name: str) -> None:
        path = REPO / "benchmarks" / "protocols" / f"{name}.toml"
        if not path.exists():
            raise SystemExit(f"no protocol data {path.relative_to(REPO)}")
        self.data = tomllib.loads(path.read_text())
        self.name = self.data["name"]
        self.results = REPO / "benchmarks" / "results" / self.name
        self.tasks, self.methods = self.data["tasks"], self.data["methods"]

    def rates_of(self, task: str, method: str) -> list[str]:
        """The rates a method's trajectory is run at: every scored one if it reads a clock, else
        one run on this machine's loopback ("any")."""
        return self.tasks[task]["rates"] if self.methods[method]["clock"] else ["any"]

    def run_dir(self, task: str, method: str, rate: str, seed: int) -> Path:
        return self.results / "runs" / task / method / rate / f"seed{seed}"

    def frozen_path(self, task: str) -> Path:
        return self.results / f"{task}.json"

    def frozen(self, task: str) -> dict | None:
        path = self.frozen_path(task)
        return json.loads(path.read_text()) if path.exists() else None

    def plan(self, task: str) -> list[tuple[str, str, int]]:
        """(method, rate, seed) of every run of ``task``, in the protocol's order: the baseline's
        seeds, then every other method seed by seed."""
        base = self.data["baseline"]
        runs = [(base, rate, seed) for seed in self.data["seeds"] for rate in self.rates_of(task, base)]
        for method in self.tasks[task]["methods"]:
            if method != base:
                runs += [(method, rate, seed) for seed in self.data["seeds"] for rate in self.rates_of(task, method)]
        return runs


def set_flag(flags: list[str], name: str, value: str) -> list[str]:
    if name in flags:
        i = flags.index(name)
        return [*flags[:i + 1], value, *flags[i + 2:]]
    return [*flags, name, value]


def one_node(flags: list[str], ranks: int) -> list[str]:
    """One process with the whole global batch, the same step size: batch size and learning
    rate times the ranks (the CLI scales the learning rate by its world size, here 1)."""
    flags = set_flag(flags, "--batch-size", str(int(flags[flags.index("--batch-size") + 1]) * ranks))
    return set_flag(flags, "--lr", f"{float(flags[flags.index('--lr') + 1]) * ranks:g}")


def schedule_steps(proto: Protocol, task: str) -> tuple[int, int]:
    """(optimizer steps per epoch, steps of the schedule) of ``task`` on the protocol's ranks,
    as the CLI counts them (its data loaded here, no training)."""
    from accordion_hvd.cli.options import parse_args
    from accordion_hvd.cli.task import load_data
    args = parse_args([*proto.tasks[task]["flags"], *proto.data["common"]])
    per_epoch = (len(load_data(args).train.y) // proto.data["ranks"]) // args.batch_size
    return per_epoch, per_epoch * args.epochs


def cli_args(proto: Protocol, task: str, method: str, seed: int) -> list[str]:
    """The CLI's arguments of one run (without --logdir)."""
    spec, frozen = proto.methods[method], proto.frozen(task)
    flags = [*proto.tasks[task]["flags"], *proto.data["common"], *spec["flags"], "--seed", str(seed)]
    if method == "one-node":
        flags = one_node(flags, proto.data["ranks"])
    if method == proto.data["baseline"]:  # the schedule, then on at the final learning rate (module doc)
        extended = math.ceil(proto.data["extend"] * schedule_steps(proto, task)[1])
        return [*flags, "--target", "1e-9", "--max-steps", str(extended)]
    if frozen is None:
        raise SystemExit(f"{task}: run the baseline's seeds and `freeze` before {method} (the target and cap)")
    if "freeze" in spec:
        flags += ["--freeze-step", str(frozen["freeze_steps"][method])]
    return [*flags, "--target", f"{frozen['target']:.6f}", "--max-steps", str(frozen["cap_steps"])]


def worktree(commit: str) -> Path:
    """A git worktree of ``commit`` with its extension built (build/worktrees/COMMIT)."""
    where = REPO / "build" / "worktrees" / commit
    if not (where / ".git").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=REPO, check=True)
    if not list((where / "accordion_hvd").glob("_C*.so")):
        subprocess.run([PYTHON, "setup.py", "-q", "build_ext", "--inplace"], cwd=where, check=True)
    return where


def launch(launcher: str, args: list[str], rate: str, ranks: int, cwd: Path) -> tuple[int, str, str]:
    """Run ``python ARGS`` under the launcher; (exit code, output, what was launched)."""
    env = {"PYTHONPATH": str(cwd)}
    if rate == "any":  # this machine's loopback
        full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        bin_dir = Path(PYTHON).parent
        if launcher == "horovod":
            cmd = [str(bin_dir / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", PYTHON, *args]
        else:
            cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "1" if launcher == "one-node" else str(ranks),
                   "--master_port", "29561", *args]
        out = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=TIMEOUT_S)
        return out.returncode, out.stdout + out.stderr, " ".join(Path(c).name if c == PYTHON else c for c in cmd)
    if launcher == "one-node":
        raise SystemExit("one-node runs on no link: its method must have clock = false")
    with Cluster(ranks, rate=rate, prefix="accp-") as cluster:
        if launcher == "horovod":
            done = cluster.horovodrun(args, timeout=TIMEOUT_S, env=env, cwd=cwd)
            return done.returncode, done.stdout + done.stderr, f"horovodrun -np {ranks} --gloo (emulated nodes) python"
        results = cluster.torchrun(args, timeout=TIMEOUT_S, per_node=1, env=env, cwd=cwd)
        code = next((r.returncode for r in results.values() if r.returncode != 0), 0)
        output = "".join(f"--- node {k + 1} ---\n" + r.stdout + r.stderr for k, r in sorted(results.items()))
        return code, output, f"torchrun --nnodes {ranks} --nproc_per_node 1 (emulated nodes) python"


def commit_of(cwd: Path) -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+uncommitted" if dirty else "")


def run_one(proto: Protocol, task: str, method: str, rate: str, seed: int) -> dict:
    where = proto.run_dir(task, method, rate, seed)
    if (where / "run.json").exists():
        return json.loads((where / "run.json").read_text())
    spec = proto.methods[method]
    cwd = worktree(spec["commit"]) if "commit" in spec else REPO
    args = cli_args(proto, task, method, seed)
    where.mkdir(parents=True, exist_ok=True)
    at, started = commit_of(cwd), time.monotonic()  # the code the ranks import: the checkout's at the start
    code, output, launched = launch(spec["launcher"], ["-m", "accordion_hvd.train", *args, "--logdir", str(where)],
                                    rate, proto.data["ranks"], cwd)
    (where / "log.txt").write_text(output[-30000:])
    for junk in where.glob("events.out.tfevents.*"):  # TensorBoard's copy of the CSVs
        junk.unlink()
    record = {"protocol": proto.name, "task": task, "method": method, "rate": rate, "seed": seed, "exit": code,
              "diverged": "diverged" in output, "seconds": round(time.monotonic() - started, 1),
              "command": f"{launched} -m accordion_hvd.train {' '.join(args)} --logdir DIR", "commit": at,
              "machine": f"{platform.node()}, {platform.processor() or platform.machine()}"}
    (where / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def evals(where: Path) -> list[tuple[int, float]]:
    with open(where / "eval.csv", newline="") as f:
        return [(int(r["step"]), float(r["perplexity"] or "inf")) for r in csv.DictReader(f)]


def freeze(proto: Protocol, task: str) -> dict:
    """The task's target, schedule, freeze steps and cap, from the baseline's runs (module doc)."""
    base = proto.data["baseline"]
    dirs = [proto.run_dir(task, base, "any", seed) for seed in proto.data["seeds"]]
    missing = [d for d in dirs if not (d / "run.json").exists()]
    if missing:
        raise SystemExit(f"{task}: the baseline's runs are not all done ({len(missing)} missing)")
    per_epoch, schedule = schedule_steps(proto, task)
    finals = [next(v for s, v in reversed(evals(d)) if s <= schedule) for d in dirs]
    target = sum(finals) / len(finals)
    spread = (max(finals) - min(finals)) / target
    if spread > 0.05:  # the protocol: a quality every baseline seed delivered
        target = max(finals)
    reach = [next((s for s, v in evals(d) if v <= target), None) for d in dirs]
    if None in reach:
        raise SystemExit(f"{task}: a baseline seed never reached the target {target:.4f} in its extension: {reach}")
    floor_steps = sum(reach) / len(reach)
    frozen = {"task": task, "baseline": base, "finals": finals, "target": target,
              "target_rule": "worst final (spread above 5%)" if spread > 0.05 else "mean final",
              "steps_per_epoch": per_epoch, "schedule_steps": schedule, "baseline_steps_to_target": reach,
              "cap_steps": math.ceil(proto.data["cap_floors"] * floor_steps),
              "freeze_steps": {m: round(spec["freeze"] * schedule) for m, spec in proto.methods.items()
                               if "freeze" in spec}}
    proto.frozen_path(task).write_text(json.dumps(frozen, indent=1) + "\n")
    return frozen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("protocol", help="a protocol's data: benchmarks/protocols/NAME.toml")
    p.add_argument("what", choices=("plan", "run", "freeze", "pack"))
    p.add_argument("--task", help="a task of the protocol (plan: default all)")
    p.add_argument("--methods", help="comma-separated (default: the task's, in order)")
    p.add_argument("--seeds", help="comma-separated (default: the protocol's)")
    p.add_argument("--rates", help="comma-separated (default: each method's)")
    a = p.parse_args()
    proto = Protocol(a.protocol)
    if a.task is not None and a.task not in proto.tasks:
        raise SystemExit(f"--task must be one of {sorted(proto.tasks)}, got {a.task!r}")
    if a.what == "pack":
        entry = results_archive.pack(proto.results, ["*.json", "*.md", "*.png"])
        print(f"{entry['archive']}: {entry['files']} files, sha256 {entry['sha256']}")
        return
    if a.what == "freeze":
        print(json.dumps(freeze(proto, a.task), indent=1))
        return
    results_archive.restore(proto.results)  # earlier runs from the archive, if packed
    for task in [a.task] if a.task else list(proto.tasks):
        runs = proto.plan(task)
        for wanted, at in ((a.methods, 0), (a.rates, 1), (a.seeds, 2)):
            if wanted:
                keep = wanted.split(",")
                runs = [r for r in runs if str(r[at]) in keep]
        for method, rate, seed in runs:
            where = proto.run_dir(task, method, rate, seed)
            if a.what == "plan":
                state = json.loads((where / "run.json").read_text()) if (where / "run.json").exists() else None
                print(f"{task:16} {method:14} {rate:8} seed {seed}: " +
                      ("not run" if state is None else f"exit {state['exit']}, {state['seconds']:.0f} s, "
                                                       f"{state['commit']}" + (", diverged" * state["diverged"])))
                continue
            record = run_one(proto, task, method, rate, seed)
            print(f"{task} {method} {rate} seed {seed}: exit {record['exit']}, {record['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
