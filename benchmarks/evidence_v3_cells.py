"""The computed cells of protocol evidence-v3 (benchmarks/protocols/evidence-v3.md, "Where a
figure is computed rather than measured"): a method whose trajectory in steps does not depend
on the link runs at 100 Mbit/s; its time at another rate is its steps x its step time measured
at that rate in the step-time sitting + its own evaluation seconds. The compute floor of a
setting is the faster baseline's steps x the compute-only step + the baseline's evaluation
seconds. Pure arithmetic on committed files (no cluster), so that it is tested on made-up runs
(tests/test_evidence_v3_cells.py) and shared by the runner (caps at 10 Mbit/s and 1 Gbit/s) and
the report.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

# The step-time sitting's name of each protocol method (amendment 2; benchmarks/step_worker.py)
# and of each task's model. ``default`` and ``diloco-auto`` are measured at every rate: no entry.
SITTING_METHOD = {"hvd-fp16": "hvd-fp16", "ddp-fp16": "ddp-fp16", "torch-localsgd": "localsgd-p4",
                  "diloco-paper": "diloco-h256", "diloco-h-ours": "diloco-ours-h256", "floor": "floor"}
SITTING_MODEL = {"lstm": "lstm", "transformer": "transformer", "heldout": "gru"}


def sitting_file(out: Path, task: str) -> Path:
    return out / f"step-time-{SITTING_MODEL[task]}.csv"


def step_times(path: Path) -> dict[tuple[str, str], float]:
    """(rate, sitting method) -> the median step over the sitting's rounds that did not fail."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["step_s"] and not r.get("error")]
    cells: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        cells.setdefault((row["rate"], row["method"]), []).append(float(row["step_s"]))
    return {cell: statistics.median(values) for cell, values in cells.items()}


def step_time(times: dict[tuple[str, str], float], rate: str, method: str) -> float:
    name = SITTING_METHOD.get(method)
    if name is None or (rate, name) not in times:
        raise KeyError(f"the step-time sitting has no {name or method!r} at {rate} "
                       f"(methods measured at every rate are never computed)")
    return times[(rate, name)]


def records(where: Path) -> tuple[list[dict], dict[int, float]]:
    """A finished run's evaluations (rows of eval.csv with a perplexity) and each step's wall."""
    with open(where / "eval.csv") as f:
        evals = [r for r in csv.DictReader(f) if r["perplexity"]]
    with open(where / "steps.csv") as f:
        walls = {int(r["step"]): float(r["wall_s"]) for r in csv.DictReader(f)}
    return evals, walls


def evaluations(evals: list[dict], step_walls: dict[int, float]) -> list[tuple[int, float, float]]:
    """Per evaluation row: (step, measured wall s, seconds that evaluation itself took), the
    last the eval row's wall minus its step's (the step's wall is written before it evaluates)."""
    return [(int(e["step"]), float(e["wall_s"]), float(e["wall_s"]) - step_walls[int(e["step"])]) for e in evals]


def computed_walls(evals: list[dict], step_walls: dict[int, float], step_s: float) -> list[float]:
    """Each evaluation's wall time had every step taken ``step_s``: steps x step_s + the seconds
    of the evaluations up to and including it."""
    out, eval_s = [], 0.0
    for step, _, seconds in evaluations(evals, step_walls):
        eval_s += seconds
        out.append(step * step_s + eval_s)
    return out


def time_to(evals: list[dict], walls: list[float], target: float) -> float | None:
    """The wall (of ``walls``, one per evaluation) at the first evaluation at or below target."""
    for row, wall in zip(evals, walls):
        if float(row["perplexity"]) <= target:
            return wall
    return None


def eval_seconds(evals: list[dict], step_walls: dict[int, float]) -> float:
    return sum(seconds for _, _, seconds in evaluations(evals, step_walls))


def floor_seconds(baseline_runs: list[tuple[list[dict], dict[int, float]]], floor_step_s: float) -> float:
    """The compute floor: the baseline's steps (its standard schedule: the target is the mean of
    its final evaluations) x the compute-only step + its mean seconds of evaluation."""
    steps = statistics.mean(int(evals[-1]["step"]) for evals, _ in baseline_runs)
    return steps * floor_step_s + statistics.mean(eval_seconds(e, w) for e, w in baseline_runs)
