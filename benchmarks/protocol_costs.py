"""A protocol's costs and computed times (benchmarks/protocol.py runs the trajectories).

    .venv/bin/python benchmarks/protocol_costs.py evidence-v5 sit --task transformer   # this machine's sitting

**The sitting** (one per machine and task, nothing else running): every method of the task at
every rate it is scored at, plus ``floor`` (one process, the per-rank batch: the compute of a
step with no communication) and ``one-node`` (one process, the whole global batch), each a
short wall-clock run of the same CLI command as its trajectory (``SIT_STEPS`` steps, the pilot
seed; a ``freeze`` method frozen at step ``SIT_FREEZE``, rounds longer than ``SIT_ROUND`` steps
shortened to it, so that every kind of step the method takes occurs), on the emulated cluster
at the rate (``floor`` and ``one-node`` on the loopback), **interleaved**: ``ROUNDS`` rounds, in
each every cell once. A cell's costs, from its steps after the first ``SKIP`` (the median over
the rounds of each):

- ``a``: the median step with nothing on the wire (the floor's step where the method sends
  something every step);
- ``b``: seconds per byte sent by a rank, the median over its steps that sent something of
  (step - a) / bytes, at least 0;
- ``eval_s``: one evaluation's seconds (the floor cell's step across its evaluation, less a step).

**A run's time** (its trajectory, machine-free, from benchmarks/protocol.py) = the sum over its
steps of ``a + b x bytes`` that step, plus ``eval_s`` per evaluation, up to the first evaluation
at or below the target; past ``cap_floors`` x the floor it has not reached it. The floor is the
baseline's mean steps to the target at the floor's step, plus its evaluations; one node alone,
its own runs at one-node's step. Figures of two sittings are never mixed: each sitting has
its own tables.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol as runs  # noqa: E402
from machine import cpu_model  # noqa: E402

SIT_STEPS, SKIP, ROUNDS, SIT_FREEZE, SIT_ROUND = 60, 10, 3, 20, 16


def per_step(where: Path) -> tuple[list[float], list[float]]:
    """(seconds, bytes sent by a rank) of each optimizer step of a run, from its steps.csv."""
    with open(where / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    wall = [float(r["wall_s"]) for r in rows]
    bits = [float(r["wire_bits"]) if r.get("wire_bits") else 8 * float(r["bytes_sent"]) for r in rows]
    seconds = [b - a for a, b in zip([0.0] + wall[:-1], wall)]
    sent = [(b - a) / 8 for a, b in zip([0.0] + bits[:-1], bits)]
    return seconds, sent


def sitting_args(proto: runs.Protocol, task: str, method: str) -> tuple[str, list[str]]:
    """(launcher, CLI arguments) of one sitting cell: its trajectory's command, shortened."""
    if method == "floor":
        spec = {"launcher": "one-node", "flags": ["--launcher", "ddp", "--codec", "fp16"]}
    else:
        spec = proto.methods[method]
    flags = [*proto.tasks[task]["flags"], *proto.data["common"], *spec["flags"], "--seed", str(proto.data["pilot_seed"]),
             "--max-steps", str(SIT_STEPS)]
    if method == "one-node":
        flags = runs.one_node(flags, proto.data["ranks"])
    if "freeze" in spec:
        flags += ["--freeze-step", str(SIT_FREEZE)]
    if "--sync-every" in flags and flags[flags.index("--sync-every") + 1].isdigit() \
            and int(flags[flags.index("--sync-every") + 1]) > SIT_ROUND:
        flags = runs.set_flag(flags, "--sync-every", str(SIT_ROUND))
    return spec["launcher"], flags


def cell_costs(where: Path, floor_step: float | None) -> dict:
    seconds, sent = per_step(where)
    seconds, sent = seconds[SKIP:], sent[SKIP:]
    with open(where / "eval.csv", newline="") as f:
        evals = {int(r["step"]) for r in csv.DictReader(f)}
    clean = [(s, b) for k, (s, b) in enumerate(zip(seconds, sent), start=SKIP + 1) if k - 1 not in evals]
    idle = [s for s, b in clean if b == 0]
    a = statistics.median(idle) if len(idle) >= 5 else floor_step
    busy = [(s - a) / b for s, b in clean if b > 0] if a is not None else []
    return {"a": a, "b": max(statistics.median(busy), 0.0) if busy else 0.0, "steps": len(clean),
            "sending_steps": len(busy)}


def eval_seconds(where: Path) -> float | None:
    seconds, _ = per_step(where)
    with open(where / "eval.csv", newline="") as f:
        evals = [int(r["step"]) for r in csv.DictReader(f)]
    step = statistics.median(seconds[SKIP:])
    jumps = [seconds[s] - step for s in evals if s < len(seconds)]  # the step after an evaluation holds it
    return statistics.median(jumps) if jumps else None


def sit(proto: runs.Protocol, task: str) -> Path:
    """This machine's sitting of ``task`` (module doc); its costs.json."""
    stamp = f"{datetime.date.today().isoformat()}-{re.sub(r'[^a-z0-9.]+', '-', cpu_model().lower()).strip('-')}"
    out = proto.results / "sittings" / stamp / task
    cells = [("floor", "any"), ("one-node", "any")] + [(m, r) for m in proto.tasks[task]["methods"] if m != "one-node"
                                                       for r in proto.tasks[task]["rates"]]
    for rnd in range(ROUNDS):
        for method, rate in cells:
            where = out / f"round{rnd}" / method / rate
            if (where / "run.json").exists():
                continue
            launcher, args = sitting_args(proto, task, method)
            spec = proto.methods.get(method, {})
            cwd = runs.worktree(spec["commit"]) if "commit" in spec else runs.REPO
            where.mkdir(parents=True, exist_ok=True)
            code, output, launched = runs.launch(launcher, ["-m", "accordion_hvd.train", *args, "--logdir", str(where)],
                                                 rate, proto.data["ranks"], cwd)
            (where / "log.txt").write_text(output[-20000:])
            for junk in where.glob("events.out.tfevents.*"):
                junk.unlink()
            (where / "run.json").write_text(json.dumps({"cell": [method, rate], "round": rnd, "exit": code,
                                                        "command": f"{launched} -m accordion_hvd.train "
                                                                   f"{' '.join(args)} --logdir DIR",
                                                        "commit": runs.commit_of(cwd), "cpu": cpu_model()}) + "\n")
            print(f"sitting {task} round {rnd} {method} {rate}: exit {code}", flush=True)
    costs: dict = {"task": task, "cpu": cpu_model(), "rounds": ROUNDS, "cells": {}}
    floors = [cell_costs(out / f"round{r}" / "floor" / "any", None)["a"] for r in range(ROUNDS)]
    costs["floor_step"] = statistics.median(floors)
    costs["eval_s"] = statistics.median(e for r in range(ROUNDS)
                                        if (e := eval_seconds(out / f"round{r}" / "floor" / "any")) is not None)
    for method, rate in cells:
        got = [cell_costs(out / f"round{r}" / method / rate, costs["floor_step"]) for r in range(ROUNDS)]
        costs["cells"][f"{method}@{rate}"] = {"a": statistics.median(g["a"] for g in got),
                                              "b": statistics.median(g["b"] for g in got),
                                              "a_rounds": [g["a"] for g in got], "b_rounds": [g["b"] for g in got]}
    (out / "costs.json").write_text(json.dumps(costs, indent=1) + "\n")
    return out / "costs.json"


def run_time(where: Path, cost: dict, eval_s: float, target: float) -> tuple[float | None, int | None]:
    """(computed seconds to the target or None, the step it was reached at) of one run."""
    _, sent = per_step(where)
    evals = runs.evals(where)
    reach = next((s for s, v in evals if v <= target), None)
    if reach is None:
        return None, None
    steps = sum(cost["a"] + cost["b"] * b for b in sent[:reach])
    return steps + eval_s * sum(1 for s, _ in evals if s <= reach), reach


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("protocol")
    p.add_argument("what", choices=("sit",))
    p.add_argument("--task", required=True)
    a = p.parse_args()
    proto = runs.Protocol(a.protocol)
    if a.task not in proto.tasks:
        raise SystemExit(f"--task must be one of {sorted(proto.tasks)}, got {a.task!r}")
    print(sit(proto, a.task))


if __name__ == "__main__":
    main()
