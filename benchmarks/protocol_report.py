"""A protocol's tables: every run's computed time to the task's target, from one sitting.

    .venv/bin/python benchmarks/protocol_report.py evidence-v5 --task transformer   # the newest sitting
    .venv/bin/python benchmarks/protocol_report.py evidence-v5 --task transformer --sitting 2026-12-06-amd-epyc

Reads the task's frozen file (target, cap; benchmarks/protocol.py ``freeze``), the sitting's
costs.json (benchmarks/protocol_costs.py ``sit``) and every run's trajectory, and writes
``benchmarks/results/NAME/TASK-SITTING.md`` and ``.json`` beside the frozen file. Per rate:

- **floor**: the baseline's trajectories priced at the floor cell (one process, no link): the
  same training with free communication; **one node**: ``one-node``'s own trajectories at its
  cell; **baseline**: the faster of ``ddp-fp16`` and ``hvd-fp16`` at the rate;
- per method, each seed's steps and computed seconds to the target (``cap`` past ``cap_floors``
  x the floor, or never reached; the 16-bit dense baselines are never capped: they define the
  target, and their time is what a user of dense training waits), the mean and spread over the seeds that reached it, the mean's
  ratio to the floor, to one node and to the baseline (a ratio only where every seed reached it),
  the bits per parameter per step a rank sent and the rounds up to the target, and each seed's
  quality at the schedule's end (equal epochs).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol as runs  # noqa: E402
import protocol_costs as costs_of  # noqa: E402

DENSE = ("ddp-fp16", "hvd-fp16")


def at_schedule_end(where: Path, schedule: int) -> float | None:
    """The last evaluation at or before the schedule's end (quality at equal epochs)."""
    return next((v for s, v in reversed(runs.evals(where)) if s <= schedule), None)


def rounds_by(where: Path, reach: int) -> int | None:
    """Rounds (synchronisations) in the first ``reach`` steps, where the run records them."""
    with open(where / "steps.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f)][:reach]
    return int(float(rows[-1]["syncs"])) if rows and rows[-1].get("syncs") not in (None, "") else None


def bits_per_param(where: Path, reach: int) -> float:
    """Bits a rank sent per parameter per step over the first ``reach`` steps."""
    _, sent = costs_of.per_step(where)
    params = costs_of.parameters(where)
    return 8 * sum(sent[:reach]) / (params * reach)


def seed_rows(proto: runs.Protocol, task: str, method: str, rate: str, cost: dict, eval_s: float,
              target: float, cap_s: float | None, schedule: int = 0) -> list[dict]:
    """One row per seed whose run is done: its steps and seconds to the target, or None."""
    rows = []
    run_rate = rate if proto.methods[method]["clock"] else "any"
    for seed in proto.data["seeds"]:
        where = proto.run_dir(task, method, run_rate, seed)
        if not (where / "run.json").exists():
            continue
        seconds, reach = costs_of.run_time(where, cost, eval_s, target)
        if seconds is not None and cap_s is not None and seconds > cap_s and method not in DENSE:
            seconds, reach = None, None
        rows.append({"seed": seed, "steps": reach, "seconds": seconds,
                     "bits_per_param_step": bits_per_param(where, reach) if reach else None,
                     "rounds": rounds_by(where, reach) if reach else None,
                     "at_schedule_end": at_schedule_end(where, schedule)})
    return rows


def mean_of(rows: list[dict], seeds: int) -> float | None:
    """The mean seconds where every one of the protocol's seeds reached the target."""
    got = [r["seconds"] for r in rows if r["seconds"] is not None]
    return statistics.mean(got) if len(got) == seeds else None


def report(proto: runs.Protocol, task: str, sitting: Path) -> dict:
    frozen = proto.frozen(task)
    if frozen is None:
        raise SystemExit(f"{task}: not frozen yet (benchmarks/protocol.py {proto.name} freeze --task {task})")
    costs = json.loads((sitting / "costs.json").read_text())
    target, eval_s, seeds = frozen["target"], costs["eval_s"], len(proto.data["seeds"])
    floor_rows = seed_rows(proto, task, proto.data["baseline"], "any", costs["cells"]["floor@any"], eval_s, target, None)
    floor = mean_of(floor_rows, seeds)
    if floor is None:
        raise SystemExit(f"{task}: the baseline's runs do not all reach the target")
    cap_s = proto.data["cap_floors"] * floor
    one_node = mean_of(seed_rows(proto, task, "one-node", "any", costs["cells"]["one-node@any"], eval_s, target, cap_s),
                       seeds)
    out = {"task": task, "sitting": sitting.parent.name, "cpu": costs["cpu"], "target": target, "floor_s": floor,
           "one_node_s": one_node, "cap_s": cap_s, "rates": {}}
    for rate in proto.tasks[task]["rates"]:
        methods = {}
        for method in proto.tasks[task]["methods"]:
            if method == "one-node":
                continue
            rows = seed_rows(proto, task, method, rate, costs["cells"][f"{method}@{rate}"], eval_s, target, cap_s,
                             frozen["schedule_steps"])
            methods[method] = {"seeds": rows, "mean_s": mean_of(rows, seeds)}
        dense = [methods[m]["mean_s"] for m in DENSE if methods.get(m, {}).get("mean_s") is not None]
        baseline = min(dense) if dense else None
        for m in methods.values():
            mean = m["mean_s"]
            m["x_floor"] = mean / floor if mean else None
            m["x_one_node"] = mean / one_node if mean and one_node else None
            m["x_baseline"] = mean / baseline if mean and baseline else None
        out["rates"][rate] = {"baseline_s": baseline, "methods": methods}
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rep: dict, proto: runs.Protocol) -> str:
    seeds = proto.data["seeds"]
    lines = [f"# {proto.name}, {rep['task']}: computed time to the target, sitting {rep['sitting']}", "",
             f"Target **{rep['target']:.3f}**; sitting on {rep['cpu']}. Floor (the baseline's trajectories at one "
             f"process's step, no link): **{rep['floor_s']:.1f} s**; one node alone: "
             f"**{fmt(rep['one_node_s'], '.1f')} s**; cap {rep['cap_s']:.1f} s. Rebuilt by "
             f"`.venv/bin/python benchmarks/protocol_report.py {proto.name} --task {rep['task']} "
             f"--sitting {rep['sitting']}`.", ""]
    for rate, block in rep["rates"].items():
        lines += [f"## {rate}", "", f"Baseline (the faster 16-bit dense): {fmt(block['baseline_s'], '.1f')} s.", "",
                  "| method | runs | steps to target per seed | seconds per seed | mean ± sd | x floor | x one node "
                  "| x baseline | bits/param/step | rounds | at the schedule's end |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, m in block["methods"].items():
            rows = {r["seed"]: r for r in m["seeds"]}
            steps = " / ".join(str(rows[s]["steps"] or "cap") if s in rows else "." for s in seeds)
            secs = " / ".join(fmt(rows[s]["seconds"], ".0f") if s in rows and rows[s]["seconds"] else
                              ("cap" if s in rows else ".") for s in seeds)
            got = [r["seconds"] for r in m["seeds"] if r["seconds"] is not None]
            spread = f"{statistics.mean(got):.0f} ± {statistics.stdev(got):.0f}" if len(got) > 1 else "-"
            bits = [r["bits_per_param_step"] for r in m["seeds"] if r["bits_per_param_step"] is not None]
            rounds = [r["rounds"] for r in m["seeds"] if r["rounds"] is not None]
            ends = [r["at_schedule_end"] for r in m["seeds"] if r["at_schedule_end"] is not None]
            lines.append(f"| {name} | {len(m['seeds'])} of {len(seeds)} | {steps} | {secs} | {spread} | "
                         f"{fmt(m['x_floor'])} | {fmt(m['x_one_node'])} | {fmt(m['x_baseline'])} | "
                         f"{fmt(statistics.mean(bits) if bits else None)} | "
                         f"{fmt(statistics.mean(rounds) if rounds else None, '.0f')} | "
                         f"{' / '.join(f'{e:.2f}' for e in ends) or '-'} |")
        lines.append("")
    lines.append("A ratio is given only where every seed reached the target within the cap; `.` is a run not "
                 "done yet.")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("protocol")
    p.add_argument("--task", required=True)
    p.add_argument("--sitting", help="the sitting's folder name under results/NAME/sittings (default: the newest)")
    a = p.parse_args()
    proto = runs.Protocol(a.protocol)
    if a.task not in proto.tasks:
        raise SystemExit(f"--task must be one of {sorted(proto.tasks)}, got {a.task!r}")
    found = sorted(proto.results.glob(f"sittings/{a.sitting or '*'}/{a.task}/costs.json"))
    if not found:
        raise SystemExit(f"no sitting of {a.task} (benchmarks/protocol_costs.py {proto.name} sit --task {a.task})")
    rep = report(proto, a.task, found[-1].parent)
    stem = proto.results / f"{a.task}-{rep['sitting']}"
    Path(f"{stem}.json").write_text(json.dumps(rep, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(rep, proto))
    print(Path(f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
