"""The protocol runner (benchmarks/protocol.py) and its costs (benchmarks/protocol_costs.py) on
evidence-v5's data: the plan's order, each run's command, the freeze of target and cap from the
baseline's runs, and the computed time of a run from a sitting's costs, on written trajectories."""

import csv
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import protocol  # noqa: E402
import protocol_costs  # noqa: E402
import protocol_report  # noqa: E402


@pytest.fixture
def proto(tmp_path, monkeypatch):
    p = protocol.Protocol("evidence-v5")
    monkeypatch.setattr(p, "results", tmp_path / "evidence-v5")  # runs written here, not into the tree
    return p


def write_run(where: Path, evals, sent_bytes, wall=None):
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", "wall_s", "bytes_sent", "floats_dense"])
        total, clock = 0, 0.0
        for k, b in enumerate(sent_bytes, start=1):
            total += b
            clock += wall[k - 1] if wall else 1.0
            w.writerow([k, 1, clock, total, 1000 * k])
    with open(where / "eval.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", "accuracy", "perplexity", "floats_sent", "wall_s"])
        for step, ppl in evals:
            w.writerow([step, 1, "", ppl, 0, 0])
    (where / "run.json").write_text(json.dumps({"exit": 0}))


def test_the_plan_runs_the_baseline_first_and_clock_free_methods_once(proto):
    plan = proto.plan("transformer")
    assert plan[:3] == [("ddp-fp16", "any", 0), ("ddp-fp16", "any", 1), ("ddp-fp16", "any", 2)]
    assert ("default", "10mbit", 0) in plan and ("default", "1gbit", 2) in plan  # reads a clock: every rate
    assert [r for r in plan if r[0] == "ours-adamw"] == [("ours-adamw", "any", s) for s in (0, 1, 2)]
    assert len(plan) == len(set(plan))


def test_commands_before_and_after_the_freeze(proto):
    base = protocol.cli_args(proto, "transformer", "ddp-fp16", 1)
    assert base[-4:] == ["--target", "1e-9", "--max-steps", "2016"]  # 1.5 x the 1344 steps of the schedule
    with pytest.raises(SystemExit, match="run the baseline's seeds and `freeze` before ours-adamw"):
        protocol.cli_args(proto, "transformer", "ours-adamw", 0)
    proto.results.mkdir(parents=True)
    proto.frozen_path("transformer").write_text(json.dumps(
        {"target": 27.9, "cap_steps": 5000, "freeze_steps": {"ours-adamw": 134, "onebit-adam": 269}}))
    ours = protocol.cli_args(proto, "transformer", "ours-adamw", 0)
    assert ours[-6:] == ["--freeze-step", "134", "--target", "27.900000", "--max-steps", "5000"]
    one = protocol.cli_args(proto, "transformer", "one-node", 2)
    assert one[one.index("--batch-size") + 1] == "64" and one[one.index("--lr") + 1] == "0.002"


def test_freeze_reads_target_and_cap_from_the_baseline(proto):
    for seed, final in enumerate((27.5, 28.0, 28.5)):
        write_run(proto.run_dir("transformer", "ddp-fp16", "any", seed),
                  [(1344, final), (1400, final - 0.5), (1456, final - 1.5)], [0] * 1456)
    frozen = protocol.freeze(proto, "transformer")
    assert frozen["target"] == pytest.approx(28.0) and frozen["target_rule"] == "mean final"
    assert frozen["baseline_steps_to_target"] == [1344, 1344, 1400] and frozen["schedule_steps"] == 1344
    assert frozen["cap_steps"] == math.ceil(4 * (1344 * 2 + 1400) / 3)
    assert frozen["freeze_steps"] == {"onebit-adam": 269, "ours-adamw": 134}
    assert json.loads(proto.frozen_path("transformer").read_text()) == frozen
    write_run(proto.run_dir("transformer", "ddp-fp16", "any", 0), [(1344, 20.0)], [0] * 1344)
    assert protocol.freeze(proto, "transformer")["target_rule"] == "worst final (spread above 5%)"
    write_run(proto.run_dir("transformer", "ddp-fp16", "any", 0), [(1344, 27.9)], [0] * 1344)
    write_run(proto.run_dir("transformer", "ddp-fp16", "any", 2), [(1344, 28.6)], [0] * 1344)
    with pytest.raises(SystemExit, match="a baseline seed never reached the target 28.1"):
        protocol.freeze(proto, "transformer")


def test_costs_and_a_computed_time(tmp_path):
    # a sitting cell over two rounds: inner steps of 0.3 s, rounds of 1000 bytes taking 0.8 s,
    # and in the second round two dense steps of 10000 bytes taking 2.3 s
    rounds = [tmp_path / "round0", tmp_path / "round1"]
    write_run(rounds[0], [], [0] * 15 + [1000, 0] * 10, wall=[0.3] * 15 + [0.8, 0.3] * 10)
    write_run(rounds[1], [], [0] * 12 + [10000] * 2 + [1020, 0] * 3, wall=[0.3] * 12 + [2.3] * 2 + [0.8, 0.3] * 3)
    costs = protocol_costs.cell_costs(rounds, floor_step=0.25)
    assert costs["a"] == pytest.approx(0.3)
    assert [(round(b), round(s, 6), n) for b, s, n in costs["points"]] == [(1000, 0.8, 13), (10000, 2.3, 2)]
    assert protocol_costs.step_seconds(costs, 0) == pytest.approx(0.3)
    assert protocol_costs.step_seconds(costs, 500) == pytest.approx(0.55)  # between (0, a) and the round
    assert protocol_costs.step_seconds(costs, 5500) == pytest.approx(1.55)  # between the two kinds
    assert protocol_costs.step_seconds(costs, 20000) == pytest.approx(0.3 + 2.0 * 2)  # past the largest kind
    always = tmp_path / "always"  # a method that sends every step: a is the floor's step
    write_run(always, [], [2000] * 20, wall=[1.25] * 20)
    got = protocol_costs.cell_costs([always], floor_step=0.25)
    assert got["a"] == 0.25 and protocol_costs.step_seconds(got, 4000) == pytest.approx(0.25 + 2 * 1.0)
    alone = protocol_costs.cell_costs([always], floor_step=None)  # one process: its bytes cross nothing
    assert alone == {"a": pytest.approx(1.25), "points": None, "steps": 10}
    assert protocol_costs.step_seconds(alone, 4000) == pytest.approx(1.25)
    quiet = tmp_path / "quiet"
    write_run(quiet, [], [0] * 20, wall=[0.3] * 20)
    with pytest.raises(ValueError, match="no sending step"):
        protocol_costs.step_seconds(protocol_costs.cell_costs([quiet], 0.25), 100)
    run = tmp_path / "run"
    write_run(run, [(2, 50.0), (4, 30.0), (6, 20.0)], [1000, 0, 1000, 0, 1000, 0])
    cost = {"a": 0.3, "points": [[1000, 0.8, 1]]}
    seconds, reach = protocol_costs.run_time(run, cost, eval_s=2.0, target=30.0)
    assert reach == 4 and seconds == pytest.approx(4 * 0.3 + 2 * 0.5 + 2 * 2.0)
    assert protocol_costs.run_time(run, cost, eval_s=2.0, target=10.0) == (None, None)


def test_the_sitting_shortens_rounds_and_windows(proto):
    _, default = protocol_costs.sitting_args(proto, "transformer", "default")
    assert default[len(default) - 1 - default[::-1].index("--interval") + 1] == "16"
    _, paper = protocol_costs.sitting_args(proto, "transformer", "diloco-paper")
    assert paper[paper.index("--sync-every") + 1] == "16" and "--max-steps" in paper
    _, frozen = protocol_costs.sitting_args(proto, "transformer", "ours-adamw")
    assert frozen[frozen.index("--freeze-step") + 1] == "20"
    _, floor = protocol_costs.sitting_args(proto, "transformer", "floor")  # twice the steps per epoch
    assert floor[floor.index("--evals-per-epoch") + 1] == "8" and "--max-steps" in floor


def test_the_report_prices_every_seed_and_gives_ratios_only_where_all_reached(proto):
    task, seeds = "transformer", proto.data["seeds"]
    proto.results.mkdir(parents=True)
    proto.frozen_path(task).write_text(json.dumps({"target": 30.0, "schedule_steps": 3}))
    cells = {f"{m}@{r}": {"a": 0.5, "points": [[2000, 1.5, 10]]} for m in proto.methods for r in proto.tasks[task]["rates"]}
    cells.update({"floor@any": {"a": 0.25, "points": None}, "one-node@any": {"a": 0.4, "points": None}})
    sitting = proto.results / "sittings" / "today-cpu" / task
    sitting.mkdir(parents=True)
    (sitting / "costs.json").write_text(json.dumps({"cpu": "cpu", "eval_s": 1.0, "cells": cells}))
    for seed in seeds:  # the baseline: 4 steps of 2000 bytes, then the target at step 4
        write_run(proto.run_dir(task, "ddp-fp16", "any", seed), [(2, 40.0), (4, 29.0)], [2000] * 4)
        write_run(proto.run_dir(task, "one-node", "any", seed), [(2, 40.0), (4, 29.0)], [2000] * 4)
    write_run(proto.run_dir(task, "ours-adamw", "any", 0), [(2, 29.0)], [1000, 0])  # one seed only
    write_run(proto.run_dir(task, "sparseloco", "any", 0), [(2, 31.0)], [0, 0])  # never reaches it
    rep = protocol_report.report(proto, task, sitting)
    assert rep["floor_s"] == pytest.approx(4 * 0.25 + 2 * 1.0)  # no link: every step at a, plus evaluations
    assert rep["one_node_s"] == pytest.approx(4 * 0.4 + 2.0)
    block = rep["rates"]["10mbit"]
    dense = block["methods"]["ddp-fp16"]
    assert dense["mean_s"] == pytest.approx(4 * 1.5 + 2.0) and dense["x_floor"] == pytest.approx(8.0 / 3.0)
    assert dense["seeds"][0]["bits_per_param_step"] == pytest.approx(16.0)  # 2000 bytes over 1000 parameters
    assert block["baseline_s"] == pytest.approx(8.0)  # hvd-fp16 has no runs
    ours = block["methods"]["ours-adamw"]
    assert ours["seeds"] == [{"seed": 0, "steps": 2, "seconds": pytest.approx(1.0 + 0.5 + 1.0),
                              "bits_per_param_step": pytest.approx(4.0), "rounds": None, "at_schedule_end": 29.0}]
    assert ours["mean_s"] is None and ours["x_floor"] is None  # 1 of 3 seeds: no ratio
    assert block["methods"]["sparseloco"]["seeds"][0]["seconds"] is None
    capped = protocol_report.seed_rows(proto, task, "ddp-fp16", "10mbit", {"a": 5.0, "points": [[2000, 9.0, 1]]},
                                       1.0, 30.0, cap_s=1.0)
    assert capped[0]["seconds"] == pytest.approx(4 * 9.0 + 2.0)  # a dense baseline is never capped
    text = protocol_report.markdown(rep, proto)
    assert dense["seeds"][0]["at_schedule_end"] == 40.0  # the evaluation at step 2, before the schedule's end
    assert "| ours-adamw | 1 of 3 | 2 / . / . |" in text and "| sparseloco | 1 of 3 | cap / . / . |" in text


def test_a_simulated_exchange_is_priced_on_the_link_curve_of_the_real_cells():
    real = [{"a": 0.2, "points": [[1000, 0.7, 5], [8000, 2.2, 5]]}, {"a": 0.25, "points": [[4000, 1.0, 5]]},
            {"a": 0.2, "points": None}]  # (a cell on no link adds nothing)
    curve = protocol_costs.link_curve(real)
    assert curve == [(1000, pytest.approx(0.5)), (4000, pytest.approx(0.75)), (8000, pytest.approx(2.0))]
    cheaper_later = protocol_costs.link_curve(real + [{"a": 0.2, "points": [[5000, 0.8, 5]]}])
    assert cheaper_later[1] == (4000, pytest.approx(0.6))  # the cheapest seen for at least that many bytes
    simulated = {"a": 0.3, "points": [[2000, 9.0, 4]], "steps": 40}
    priced = protocol_costs.on_link(simulated, curve)
    assert priced["points"] == [[2000, pytest.approx(0.3 + 0.5 + 0.25 / 3), 4]]
    assert priced["measured_points"] == [[2000, 9.0, 4]] and priced["priced_on_link"]
    with pytest.raises(ValueError, match="no real cell"):
        protocol_costs.on_link(simulated, [])


def test_steps_whose_bytes_grow_gradually_are_one_kind(tmp_path):
    # sparse chunks: each step a few more or fewer bytes than the last, then a 16-bit step
    cell = tmp_path / "cell"
    write_run(cell, [], [0] * 10 + [1000, 1400, 1900, 2600, 1200, 9000], wall=[0.3] * 10 + [0.5] * 5 + [2.0])
    points = protocol_costs.cell_costs([cell], floor_step=0.25)["points"]
    assert [(round(b), n) for b, _, n in points] == [(1400, 5), (9000, 1)]
