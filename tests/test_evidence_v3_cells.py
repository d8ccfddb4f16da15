"""evidence-v3's computed cells, caps away from 100 Mbit/s and bars (benchmarks/evidence_v3_cells.py,
evidence_v3.py, evidence_v3_report.py) on made-up runs: what the committed summary calls "met"
must itself be checked, and a cap at 10 Mbit/s must be twice the baseline's time *there*."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import evidence_v3 as v3  # noqa: E402
import evidence_v3_cells as cells  # noqa: E402
import evidence_v3_report as report  # noqa: E402


def write_run(where: Path, *, step_s: float, eval_s: float, finals: list[float], setting: str, method: str,
              protocol: str = v3.PROTOCOL) -> None:
    """A run of len(finals) evaluations every 100 steps, each step step_s, each evaluation eval_s."""
    where.mkdir(parents=True)
    steps, evals, wall = [], [], 0.0
    for k, quality in enumerate(finals, 1):
        for step in range(100 * (k - 1) + 1, 100 * k + 1):
            wall += step_s
            steps.append({"step": step, "epoch": 6 * k // len(finals), "floats_sent": step * 10, "wall_s": wall})
        wall += eval_s
        evals.append({"step": 100 * k, "epoch": 6 * k // len(finals), "accuracy": "", "perplexity": quality,
                      "floats_sent": 1000 * k, "wall_s": wall})
    for name, rows in (("steps.csv", steps), ("eval.csv", evals)):
        with open(where / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    (where / "log.txt").write_text("final test perplexity: 30.0\n")
    (where / "run.json").write_text(json.dumps({"protocol": protocol, "setting": setting, "method": method,
                                                "exit": 0, "machine": "test"}))


def write_sitting(path: Path, steps: dict[tuple[str, str], list[float]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "nodes", "rate", "round", "method", "step_s", "error"])
        writer.writeheader()
        for (rate, method), values in steps.items():
            for r, value in enumerate(values):
                writer.writerow({"model": "lstm", "nodes": 2, "rate": rate, "round": r, "method": method,
                                 "step_s": value, "error": ""})
        writer.writerow({"model": "lstm", "nodes": 2, "rate": "10mbit", "round": 9, "method": "floor",
                         "step_s": "", "error": "a failed round is not a step"})


def test_computed_walls_are_steps_at_the_sittings_step_plus_the_runs_own_evaluations(tmp_path):
    write_run(tmp_path / "r", step_s=0.5, eval_s=2.0, finals=[50.0, 40.0, 30.0], setting="lstm-100mbit",
              method="ddp-fp16")
    evals, walls = cells.records(tmp_path / "r")
    assert [round(e[2], 6) for e in cells.evaluations(evals, walls)] == [2.0, 2.0, 2.0]
    assert cells.computed_walls(evals, walls, 3.0) == pytest.approx([302.0, 604.0, 906.0])
    assert cells.time_to(evals, cells.computed_walls(evals, walls, 3.0), 40.0) == pytest.approx(604.0)
    assert cells.time_to(evals, cells.computed_walls(evals, walls, 3.0), 29.0) is None
    # the floor: the baseline's steps x the compute-only step + its evaluations
    assert cells.floor_seconds([(evals, walls)], 0.25) == pytest.approx(300 * 0.25 + 6.0)


def test_step_times_take_the_median_of_rounds_that_did_not_fail(tmp_path):
    write_sitting(tmp_path / "s.csv", {("10mbit", "floor"): [0.2, 0.3, 0.25], ("10mbit", "localsgd-p4"): [1.0, 2.0]})
    times = cells.step_times(tmp_path / "s.csv")
    assert times[("10mbit", "floor")] == pytest.approx(0.25)
    assert cells.step_time(times, "10mbit", "torch-localsgd") == pytest.approx(1.5)
    with pytest.raises(KeyError, match="never computed"):
        cells.step_time(times, "10mbit", "diloco-auto")


def test_a_cap_away_from_100mbit_is_twice_the_baselines_time_there_and_its_baseline_the_faster_there(
        tmp_path, monkeypatch):
    monkeypatch.setattr(v3, "OUT", tmp_path)
    for seed in v3.SEEDS:  # at 100 Mbit/s DDP is faster; at 10 Mbit/s (the sitting) Horovod is
        write_run(tmp_path / "lstm-100mbit" / "ddp-fp16" / f"seed{seed}", step_s=0.4, eval_s=1.0,
                  finals=[40.0, 31.0 + seed], setting="lstm-100mbit", method="ddp-fp16")
        write_run(tmp_path / "lstm-100mbit" / "hvd-fp16" / f"seed{seed}", step_s=0.5, eval_s=1.0,
                  finals=[40.0, 33.0], setting="lstm-100mbit", method="hvd-fp16")
    assert v3.frozen_setting("lstm-10mbit") is None  # no sitting yet: nothing frozen, nothing runs
    assert not (tmp_path / "lstm-10mbit" / "setting.json").exists()
    write_sitting(tmp_path / "step-time-lstm.csv", {("10mbit", "hvd-fp16"): [2.0], ("10mbit", "ddp-fp16"): [2.5],
                                                     ("10mbit", "floor"): [0.2]})
    at_100 = v3.frozen_setting("lstm-100mbit")
    assert at_100["baseline"] == "ddp-fp16" and at_100["cap_s"] == pytest.approx(2 * (200 * 0.4 + 2.0))
    at_10 = v3.frozen_setting("lstm-10mbit")
    assert at_10["baseline"] == "hvd-fp16" and at_10["target_perplexity"] == pytest.approx(33.0)
    assert at_10["cap_s"] == pytest.approx(2 * (200 * 2.0 + 2.0)) and "computed" in at_10
    assert json.loads((tmp_path / "lstm-10mbit" / "setting.json").read_text()) == at_10


@pytest.mark.parametrize("setting, runs, computed_elsewhere", [
    ("heldout-10mbit", {"default", "diloco-auto"}, {"hvd-fp16", "torch-localsgd", "diloco-paper"}),
    ("heldout-100mbit", {"hvd-fp16", "ddp-fp16", "torch-localsgd", "diloco-paper"}, {"default", "diloco-auto"}),
])
def test_the_held_out_setting_runs_only_its_cells(setting, runs, computed_elsewhere):
    assert {m for m in v3.METHODS if v3.runs_at(setting, m)} == runs
    assert not any(v3.runs_at(setting, m) for m in computed_elsewhere | set(v3.PILOTS))
    assert v3.DILOCO_H["heldout"] == 256


def judged(ours: float | None, floor: float = 100.0, **peers: float | None) -> dict:
    means = {"diloco-auto": ours, "diloco-paper": 300.0, "torch-localsgd": 400.0, "default": 500.0}
    means.update({k.replace("_", "-"): v for k, v in peers.items()})
    return {"lstm-10mbit": {"floor": floor, "baseline_wall": 1000.0, "means": means}}


def verdict(lines: list[str], bar: str) -> str:
    return next(line for line in lines if line.startswith(f"| {bar} |")).rsplit("|", 2)[1].strip()


def test_the_floor_bar_is_met_at_1_5x_and_not_above_it():
    assert verdict(report.bars(judged(150.0)), "diloco-auto within 1.5x the compute floor") == "**yes**"
    assert verdict(report.bars(judged(151.0)), "diloco-auto within 1.5x the compute floor") == "no"
    assert verdict(report.bars(judged(None)), "diloco-auto within 1.5x the compute floor") == "not decided"


def test_ahead_of_a_peer_needs_every_seed_to_reach_and_a_shorter_mean():
    assert verdict(report.bars(judged(150.0)), "diloco-auto ahead of diloco-paper") == "**yes**"
    assert verdict(report.bars(judged(350.0)), "diloco-auto ahead of diloco-paper") == "no"
    assert verdict(report.bars(judged(math.inf)), "diloco-auto ahead of default") == "no"  # a seed never reached
    assert verdict(report.bars(judged(150.0, diloco_paper=math.inf)), "diloco-auto ahead of diloco-paper") == "**yes**"
    assert verdict(report.bars(judged(150.0, default=None)), "diloco-auto ahead of default") == "not decided"


def test_a_settings_table_computes_the_peers_and_the_floor_and_measures_ours(tmp_path, monkeypatch):
    """lstm-10mbit: the baselines and diloco-paper from their 100 Mbit/s runs at the sitting's
    10 Mbit/s steps, diloco-auto from its own runs there, the floor from the compute-only step."""
    monkeypatch.setattr(v3, "OUT", tmp_path)
    for seed in v3.SEEDS:
        for method, step_s in (("ddp-fp16", 0.4), ("hvd-fp16", 0.5), ("diloco-paper", 0.3)):
            write_run(tmp_path / "lstm-100mbit" / method / f"seed{seed}", step_s=step_s, eval_s=1.0,
                      finals=[40.0, 33.0], setting="lstm-100mbit", method=method)
        write_run(tmp_path / "lstm-10mbit" / "diloco-auto" / f"seed{seed}", step_s=0.25 + 0.01 * seed, eval_s=1.0,
                  finals=[33.0, 32.0], setting="lstm-10mbit", method="diloco-auto")
    write_sitting(tmp_path / "step-time-lstm.csv", {("10mbit", "hvd-fp16"): [2.0], ("10mbit", "ddp-fp16"): [2.5],
                                                     ("10mbit", "floor"): [0.2], ("10mbit", "diloco-h256"): [0.22]})
    lines, got = report.setting_table("lstm-10mbit")
    assert got["floor"] == pytest.approx(200 * 0.2 + 2.0)
    assert got["baseline_wall"] == pytest.approx(200 * 2.0 + 2.0)  # hvd-fp16, the faster at 10 Mbit/s
    assert got["means"]["diloco-paper"] == pytest.approx(200 * 0.22 + 2.0)  # computed: reaches 33 at its end
    assert got["means"]["diloco-auto"] == pytest.approx(100 * 0.26 + 1.0)  # measured: reaches 33 at its first
    assert "| diloco-paper | computed | 3 |" in "\n".join(lines) and "| diloco-auto | measured | 3 |" in "\n".join(lines)
