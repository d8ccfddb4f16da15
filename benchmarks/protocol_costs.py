"""A protocol's costs and computed times (benchmarks/protocol.py runs the trajectories).

    .venv/bin/python benchmarks/protocol_costs.py evidence-v5 sit --task transformer   # this machine's sitting

**The sitting** (one per machine and task, nothing else running): every method of the task at
every rate it is scored at, plus ``floor`` (one process, the per-rank batch: the compute of a
step with no communication) and ``one-node`` (one process, the whole global batch), each a
short wall-clock run of the same CLI command as its trajectory (``SIT_STEPS`` steps, the pilot
seed; a ``freeze`` method frozen at step ``SIT_FREEZE``, rounds and windows longer than
``SIT_ROUND`` steps shortened to it, so that every kind of step the method takes occurs: the
link gate's compressed window and dense trial, a warm-up and the frozen steps), on the emulated
cluster at the rate (``floor`` and ``one-node`` on the loopback), **interleaved**: ``ROUNDS``
rounds, in each every cell once. A cell's costs, from its steps after the first ``SKIP`` and
without the step that holds an evaluation, pooled over the rounds:

- ``a``: the median step with nothing on the wire (the floor's step where the method sends
  something every step);
- ``points``: per kind of sending step (the steps sorted by the bytes a rank sent, a new kind
  where they jump by more than ``GAP``: a dense step, a compressed one, a round), its median
  bytes and median seconds. A step that
  sends ``B`` bytes costs the piecewise-linear line through (0, ``a``) and the points, past the
  largest point the line from (0, ``a``) through it (``step_seconds``). One straight line
  ``a + b x bytes`` priced a 16-bit step of a cell by its compressed steps' seconds per byte,
  and on an emulated link small messages cost less per byte than large ones (they fit in the
  sockets' buffers);
- ``eval_s``: one evaluation's seconds (the floor cell's step across its evaluation, less a step).

A **simulated** method (``simulated = true``: the published peers of accordion_hvd/cli/published.py,
whose message is decoded to floats and averaged with a float32 ``all_reduce``, its size counted
from the encoding the method specifies) sends far more than it counts, so its measured sending
steps say nothing of its message: its cell runs once, on the loopback, for its ``a`` and its
kinds' bytes, and at each rate each kind is priced at that ``a`` plus the seconds the rate's
real exchanges took for that many bytes (``link_curve``: every other cell at the rate, the
cheapest seen for at least those bytes).

**A run's time** (its trajectory, machine-free, from benchmarks/protocol.py) = the sum over its
steps of its step's seconds at the bytes it sent, plus ``eval_s`` per evaluation, up to the first evaluation
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

SIT_STEPS, SKIP, ROUNDS, SIT_FREEZE, SIT_ROUND, GAP = 60, 10, 3, 20, 16, 0.5


def per_step(where: Path) -> tuple[list[float], list[float]]:
    """(seconds, bytes sent by a rank) of each optimizer step of a run, from its steps.csv."""
    with open(where / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    wall = [float(r["wall_s"]) for r in rows]
    bits = [float(r["wire_bits"]) if r.get("wire_bits") else 8 * float(r["bytes_sent"]) for r in rows]
    seconds = [b - a for a, b in zip([0.0] + wall[:-1], wall)]
    sent = [(b - a) / 8 for a, b in zip([0.0] + bits[:-1], bits)]
    return seconds, sent


def parameters(where: Path) -> int:
    """The model's parameters: the dense floats of a run's first step."""
    with open(where / "steps.csv", newline="") as f:
        return int(float(next(csv.DictReader(f))["floats_dense"]))


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
    if method == "floor":  # its epoch is `ranks` times the steps: evaluate as often in steps
        at = flags.index("--evals-per-epoch") + 1
        flags = [*flags[:at], str(int(flags[at]) * proto.data["ranks"]), *flags[at + 1:]]
    if "freeze" in spec:
        flags += ["--freeze-step", str(SIT_FREEZE)]
    for name in ("--sync-every", "--interval"):  # rounds and windows: the last one given counts
        at = len(flags) - 1 - flags[::-1].index(name) if name in flags else None
        if at is not None and flags[at + 1].isdigit() and int(flags[at + 1]) > SIT_ROUND:
            flags = [*flags[:at + 1], str(SIT_ROUND), *flags[at + 2:]]
    return spec["launcher"], flags


def clean_steps(where: Path) -> list[tuple[float, float]]:
    """(seconds, bytes sent) of a sitting cell's steps after the first ``SKIP``, leaving out the
    step that holds an evaluation."""
    seconds, sent = per_step(where)
    with open(where / "eval.csv", newline="") as f:
        evals = {int(r["step"]) for r in csv.DictReader(f)}
    return [(s, b) for k, (s, b) in enumerate(zip(seconds, sent), start=1) if k > SKIP and k - 1 not in evals]


def cell_costs(rounds: list[Path], floor_step: float | None) -> dict:
    """A cell's costs from its rounds' steps, pooled: ``a`` and the ``points`` (bytes, seconds,
    steps) of each kind of sending step (sorted by bytes, a new kind where the bytes jump by more
    than ``GAP``; module doc). A cell
    on no link (``floor_step`` None: one process, whose bytes cross nothing) has only ``a``."""
    steps = [step for where in rounds for step in clean_steps(where)]
    if floor_step is None:
        return {"a": statistics.median(s for s, _ in steps), "points": None, "steps": len(steps)}
    idle = [s for s, b in steps if b == 0]
    a = statistics.median(idle) if len(idle) >= 5 else floor_step
    busy = sorted((b, s) for s, b in steps if b > 0)
    kinds: list[list[tuple[float, float]]] = []
    for b, s in busy:
        if kinds and b <= kinds[-1][-1][0] * (1 + GAP):
            kinds[-1].append((b, s))
        else:
            kinds.append([(b, s)])
    points = [[statistics.median(b for b, _ in k), statistics.median(s for _, s in k), len(k)] for k in kinds]
    return {"a": a, "points": points, "steps": len(steps)}


def step_seconds(cost: dict, sent: float) -> float:
    """One step's seconds when a rank sends ``sent`` bytes: piecewise linear through (0, a) and
    the cell's points, the last segment's line from (0, a) through the largest point extended;
    ``a`` on no link (points None)."""
    if cost["points"] is None:
        return cost["a"]
    xs = [0.0] + [p[0] for p in cost["points"]]
    ys = [cost["a"]] + [max(p[1], cost["a"]) for p in cost["points"]]
    if sent <= 0:
        return cost["a"]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if sent <= x1:
            return y0 + (y1 - y0) * (sent - x0) / (x1 - x0)
    if len(xs) == 1:
        raise ValueError("a step sent bytes where the sitting's cell saw no sending step")
    return cost["a"] + (ys[-1] - cost["a"]) * sent / xs[-1]


def link_curve(cells: list[dict]) -> list[tuple[float, float]]:
    """The seconds a real exchange of this machine added to a step, by the bytes a rank sent, at
    one rate: every kind of every cell given (bytes, seconds - its cell's ``a``), as the lower
    envelope (at each size the cheapest seen for that many bytes or more: the kindest price)."""
    points = sorted((b, max(s - cell["a"], 0.0)) for cell in cells for b, s, _ in cell["points"] or [])
    curve, cheapest = [], float("inf")
    for b, extra in reversed(points):
        cheapest = min(cheapest, extra)
        curve.append((b, cheapest))
    return curve[::-1]


def on_link(cell: dict, curve: list[tuple[float, float]]) -> dict:
    """A simulated cell (its exchange a float32 all_reduce standing in for the message it
    counts) priced on the rate's ``link_curve``: each kind's bytes at ``a`` plus the curve's
    seconds for them, its own measured seconds for the inner steps only."""
    if not curve:
        raise ValueError("no real cell at this rate to price a simulated exchange on")
    line = {"a": 0.0, "points": [[b, extra, 1] for b, extra in curve]}
    return {**cell, "points": [[b, cell["a"] + step_seconds(line, b), n] for b, _, n in cell["points"]],
            "measured_points": cell["points"], "priced_on_link": True}


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
    simulated = {m for m, spec in proto.methods.items() if spec.get("simulated")}
    cells = [("floor", "any"), ("one-node", "any")] + [
        (m, r) for m in proto.tasks[task]["methods"] if m != "one-node"
        for r in (["any"] if m in simulated else proto.tasks[task]["rates"])]  # (simulated: priced on the link)
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
            for junk in [*where.glob("events.out.tfevents.*"), *where.glob("*.png")]:  # (a 60-step run's plots)
                junk.unlink()
            (where / "run.json").write_text(json.dumps({"cell": [method, rate], "round": rnd, "exit": code,
                                                        "command": f"{launched} -m accordion_hvd.train "
                                                                   f"{' '.join(args)} --logdir DIR",
                                                        "commit": runs.commit_of(cwd), "cpu": cpu_model()}) + "\n")
            print(f"sitting {task} round {rnd} {method} {rate}: exit {code}", flush=True)
    costs: dict = {"task": task, "cpu": cpu_model(), "rounds": ROUNDS, "cells": {}}
    costs["floor_step"] = cell_costs([out / f"round{r}" / "floor" / "any" for r in range(ROUNDS)], None)["a"]
    costs["eval_s"] = statistics.median(e for r in range(ROUNDS)
                                        if (e := eval_seconds(out / f"round{r}" / "floor" / "any")) is not None)
    for method, rate in cells:
        costs["cells"][f"{method}@{rate}"] = cell_costs([out / f"round{r}" / method / rate for r in range(ROUNDS)],
                                                        None if rate == "any" and method not in simulated
                                                        else costs["floor_step"])
    curves = {rate: link_curve([c for key, c in costs["cells"].items() if key.endswith(f"@{rate}")])
              for rate in proto.tasks[task]["rates"]}  # (every cell at a rate is a real one: simulated ran on "any")
    for method in sorted(simulated & set(proto.tasks[task]["methods"])):
        measured = costs["cells"].pop(f"{method}@any")
        for rate, curve in curves.items():
            costs["cells"][f"{method}@{rate}"] = on_link(measured, curve)
    (out / "costs.json").write_text(json.dumps(costs, indent=1) + "\n")
    return out / "costs.json"


def run_time(where: Path, cost: dict, eval_s: float, target: float) -> tuple[float | None, int | None]:
    """(computed seconds to the target or None, the step it was reached at) of one run."""
    _, sent = per_step(where)
    evals = runs.evals(where)
    reach = next((s for s, v in evals if v <= target), None)
    if reach is None:
        return None, None
    steps = sum(step_seconds(cost, b) for b in sent[:reach])
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
