"""evidence-v4's per-machine targets, floors and caps (benchmarks/evidence_v4.py) and its report's
bars (evidence_v4_report.py) on made-up runs: the cap is the smaller of twice the baseline's
time at the rate and 4x the floor, every figure comes from one machine's folder, and a run of
another protocol is refused."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import evidence_v4 as v4  # noqa: E402
import evidence_v4_report as report  # noqa: E402
from test_evidence_v3_cells import write_run, write_sitting  # noqa: E402


def test_a_machine_is_named_by_its_cpu_model():
    assert v4.machine_slug("Intel(R) Xeon(R) Processor @ 2.80GHz") == "intel-xeon-processor-2.80ghz"
    assert v4.machine_slug("AMD EPYC") == "amd-epyc"


def test_a_run_records_the_cpus_family_model_and_stepping():
    """Two VMs named "AMD EPYC" stepped a fifth apart (amendment 3): runs record more than the name."""
    from machine import cpu_signature
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "stepping\t: 1\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nstepping\t: 0\n")
    assert cpu_signature(text) == "family 25, model 17, stepping 1"
    assert cpu_signature("model name\t: Apple M2\n") == ""


def baseline_and_sitting(out: Path) -> None:
    for seed in v4.SEEDS:  # 200 steps of 0.4 s, 2 evaluations of 1 s: 82 s; finals 31, 32, 33
        write_run(out / "lstm-100mbit" / "ddp-fp16" / f"seed{seed}", step_s=0.4, eval_s=1.0, finals=[40.0, 31.0 + seed],
                  setting="lstm-100mbit", method="ddp-fp16", protocol=v4.PROTOCOL)
    write_sitting(out / "step-time-lstm.csv", {("100mbit", "floor"): [0.2], ("10mbit", "floor"): [0.2],
                                                ("10mbit", "ddp-fp16"): [2.0], ("100mbit", "ddp-fp16"): [0.4]})


def three_seeds(out: Path, setting: str, method: str, step_s: float, finals: list[float]) -> None:
    """A method's runs of every seed in one setting: the same made-up trajectory."""
    for seed in v4.SEEDS:
        write_run(out / setting / method / f"seed{seed}", step_s=step_s, eval_s=1.0, finals=finals,
                  setting=setting, method=method, protocol=v4.PROTOCOL)


def report_on_one_machine(tmp_path: Path, monkeypatch) -> Path:
    """The report reading ``tmp_path``, with one machine there ("cpu", returned) holding the
    baseline's runs and the sitting."""
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "REPORT", tmp_path / "report.md")
    out = tmp_path / "cpu"
    monkeypatch.setattr(v4, "OUT", out)
    baseline_and_sitting(out)
    return out


def test_target_floor_and_cap_per_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(v4, "OUT", tmp_path)
    assert v4.frozen_setting("lstm-10mbit") is None  # nothing run yet
    baseline_and_sitting(tmp_path)
    at100, at10 = v4.frozen_setting("lstm-100mbit"), v4.frozen_setting("lstm-10mbit")
    assert at100["target_perplexity"] == pytest.approx(32.0) == at10["target_perplexity"]
    assert at100["floor_s"] == pytest.approx(200 * 0.2 + 2.0) == at10["floor_s"]
    # 100 Mbit/s: measured wall 82 s; cap min(2 x 82, 4 x 42) = 164
    assert at100["baseline_wall_s"] == pytest.approx(82.0) and at100["cap_s"] == pytest.approx(164.0)
    # 10 Mbit/s: computed wall 200 x 2.0 + 2 = 402 s; cap min(804, 168) = 168: 4x the floor
    assert at10["baseline_wall_s"] == pytest.approx(402.0) and at10["cap_s"] == pytest.approx(168.0)
    assert "computed" in at10 and "computed" not in at100


def test_a_run_of_another_protocol_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(v4, "OUT", tmp_path)
    baseline_and_sitting(tmp_path)
    (tmp_path / "lstm-100mbit" / "ddp-fp16" / "seed0" / "run.json").write_text('{"protocol": "evidence-v3", "exit": 0}')
    with pytest.raises(SystemExit, match="evidence-v3"):
        v4.frozen_setting("lstm-100mbit")


def test_runs_of_two_machines_in_one_folder_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(v4, "OUT", tmp_path)
    baseline_and_sitting(tmp_path)
    record = tmp_path / "lstm-100mbit" / "ddp-fp16" / "seed1" / "run.json"
    record.write_text(record.read_text().replace('"machine": "test"', '"machine": "vm, AMD EPYC, Python 3.11.7"'))
    with pytest.raises(SystemExit, match="AMD EPYC"):
        v4.frozen_setting("lstm-100mbit")


def test_the_report_judges_each_machine_on_its_own_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "REPORT", tmp_path / "report.md")
    for name, step_s in (("fast-cpu", 0.1), ("slow-cpu", 0.3)):  # ours at 0.1 s a step meets 1.25x, at 0.3 s not
        out = tmp_path / name
        monkeypatch.setattr(v4, "OUT", out)
        baseline_and_sitting(out)
        v4.frozen_setting("lstm-100mbit")
        for seed in v4.SEEDS:
            write_run(out / "lstm-100mbit" / "diloco-v4" / f"seed{seed}", step_s=step_s, eval_s=1.0,
                      finals=[35.0, 30.0], setting="lstm-100mbit", method="diloco-v4", protocol=v4.PROTOCOL)
    report.main()
    text = (tmp_path / "report.md").read_text()
    fast, slow = text.split("## slow-cpu")
    # fast: 200 x 0.1 + 2 = 22 s to 30.0 <= target 32, floor 42 s: 0.52x; slow: 62 s = 1.48x
    assert "| diloco-v4 within 1.25x the compute floor | lstm-100mbit | 22 s = 0.52x | **yes** |" in fast
    assert "| diloco-v4 within 1.25x the compute floor | lstm-100mbit | 62 s = 1.48x | no |" in slow


def test_the_peers_computed_away_from_100mbit_and_the_ahead_of_bars(tmp_path, monkeypatch):
    """Amendment 1: torch-localsgd and diloco-paper run at 100 Mbit/s and are computed at 10 Mbit/s
    from the peers' sitting; default is measured at 10 Mbit/s; each "ahead of" bar compares means."""
    out = report_on_one_machine(tmp_path, monkeypatch)
    v4.frozen_setting("lstm-10mbit")  # target 32, floor 42 s
    # the peers' sitting has a floor of its own: the task's sitting's sets the floor, not it
    write_sitting(v4.peers_sitting(out, "lstm"), {("10mbit", "floor"): [9.0], ("10mbit", "localsgd-p4"): [0.5],
                                                   ("10mbit", "diloco-h256"): [0.25]})
    three_seeds(out, "lstm-10mbit", "diloco-v4", 0.3, [35.0, 30.0])        # 200 x 0.3 + 2 = 62 s
    three_seeds(out, "lstm-100mbit", "torch-localsgd", 9.9, [35.0, 31.5])  # at 10 Mbit/s 200 x 0.5 + 2 = 102 s
    three_seeds(out, "lstm-100mbit", "diloco-paper", 9.9, [40.0, 33.0])    # never reaches 32
    three_seeds(out, "lstm-10mbit", "default", 0.2, [35.0, 30.0])          # measured: 42 s, ahead of ours
    report.main()
    text = (tmp_path / "report.md").read_text()
    assert "| diloco-v4 ahead of torch-localsgd | lstm-10mbit | 62 s vs 102 s | **yes** |" in text
    assert "| diloco-v4 ahead of diloco-paper | lstm-10mbit | 62 s vs not reached | **yes** |" in text
    assert "| diloco-v4 ahead of default | lstm-10mbit | 62 s vs 42 s | no |" in text
    assert "| diloco-v4 within 1.5x the compute floor | lstm-10mbit | 62 s = 1.48x | **yes** |" in text
    assert "| torch-localsgd | computed | 3 | 102 (2.43x" in text and "| default | measured | 3 | 42 (" in text


def test_the_runner_refuses_a_computed_peer_away_from_100mbit(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["evidence_v4.py", "--setting", "lstm-10mbit", "--methods", "diloco-paper"])
    with pytest.raises(SystemExit):
        v4.main()
    assert "['diloco-paper'] run at 100 Mbit/s" in capsys.readouterr().err


def test_a_vm_of_its_own_folder(tmp_path, monkeypatch, capsys):
    """Amendment 4: --machine puts a VM's sitting (and runs) in a folder of its own beside the
    CPU model's; a name that is not a plain folder is refused, naming the argument."""
    monkeypatch.setattr(v4, "OUT", tmp_path / "amd-epyc")
    commands = []
    monkeypatch.setattr(v4.subprocess, "run", lambda command, check: commands.append(command))
    monkeypatch.setattr(sys, "argv", ["evidence_v4.py", "--machine", "amd-epyc-vm-b", "--sitting", "heldout"])
    v4.main()
    assert v4.OUT == tmp_path / "amd-epyc-vm-b"
    assert commands[0][commands[0].index("--out") + 1] == str(tmp_path / "amd-epyc-vm-b" / "step-time-gru.md")
    for bad in ("../amd-epyc", "instances", ""):
        monkeypatch.setattr(sys, "argv", ["evidence_v4.py", "--machine", bad, "--status"])
        with pytest.raises(SystemExit):
            v4.main()
        assert "--machine: a plain folder name" in capsys.readouterr().err


def test_the_sittings_commands(tmp_path, monkeypatch):
    """--sitting and --sitting-peers: which methods, rates and file (the held-out task at its two rates)."""
    monkeypatch.setattr(v4, "OUT", tmp_path)
    commands = []
    monkeypatch.setattr(v4.subprocess, "run", lambda command, check: commands.append(command))
    v4.run_sitting("lstm", 3)
    v4.run_sitting("heldout", 3, peers=True)
    (own, peers) = (dict(zip(c[2::2], c[3::2])) for c in commands)
    assert own["--methods"] == "floor,ddp-fp16,hvd-fp16" and own["--rates"] == "10mbit,100mbit,1gbit"
    assert own["--out"] == str(tmp_path / "step-time-lstm.md") and own["--models"] == "lstm"
    assert peers["--methods"] == "floor,localsgd-p4,diloco-h256" and peers["--rates"] == "10mbit,100mbit"
    assert peers["--out"] == str(tmp_path / "step-time-peers-gru.md") and peers["--models"] == "gru"


def test_the_held_out_task_is_judged_on_the_ordering_alone(tmp_path, monkeypatch):
    """Amendment 2: heldout-10mbit has the "ahead of" rows and no floor bar; its 100 Mbit/s setting
    runs only the methods computed from it."""
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "REPORT", tmp_path / "report.md")
    out = tmp_path / "cpu"
    monkeypatch.setattr(v4, "OUT", out)
    for seed in v4.SEEDS:
        write_run(out / "heldout-100mbit" / "ddp-fp16" / f"seed{seed}", step_s=0.4, eval_s=1.0,
                  finals=[40.0, 31.0 + seed], setting="heldout-100mbit", method="ddp-fp16", protocol=v4.PROTOCOL)
        write_run(out / "heldout-10mbit" / "diloco-v4" / f"seed{seed}", step_s=0.9, eval_s=1.0, finals=[35.0, 30.0],
                  setting="heldout-10mbit", method="diloco-v4", protocol=v4.PROTOCOL)
    write_sitting(out / "step-time-gru.csv", {("10mbit", "floor"): [0.2], ("10mbit", "ddp-fp16"): [2.0],
                                              ("100mbit", "floor"): [0.2], ("100mbit", "ddp-fp16"): [0.4]})
    report.main()
    text = (tmp_path / "report.md").read_text()
    assert "| diloco-v4 ahead of default | heldout-10mbit | 182 s vs no runs | not decided |" in text
    assert "compute floor | heldout" not in text and "heldout-1gbit" not in text
    monkeypatch.setattr(sys, "argv", ["evidence_v4.py", "--setting", "heldout-100mbit", "--methods", "diloco-v4"])
    with pytest.raises(SystemExit):
        v4.main()


def test_runs_on_a_later_vm_decide_an_ahead_of_bar_only_as_a_yes(tmp_path, monkeypatch):
    """Amendment 3: runs listed under a later VM than A (instances/instances.json) are marked; a
    peer's there (a faster VM) leave a "yes" standing and turn a "no" into "not decided"; a bar
    on diloco-v4's runs there is not decided."""
    out = report_on_one_machine(tmp_path, monkeypatch)
    v4.frozen_setting("lstm-100mbit")  # target 32, floor 42 s
    three_seeds(out, "lstm-100mbit", "diloco-v4", 0.3, [35.0, 30.0])       # 62 s, on A
    three_seeds(out, "lstm-100mbit", "torch-localsgd", 0.5, [35.0, 30.0])  # 102 s, one seed on B: ours ahead all the same
    three_seeds(out, "lstm-100mbit", "default", 0.2, [35.0, 30.0])         # 42 s, ahead of ours, but on B: not decided
    (tmp_path / "instances").mkdir()
    (tmp_path / "instances" / "instances.json").write_text(json.dumps({"cpu": {"vms": {"A": {}, "B": {"runs": [
        "lstm-100mbit/torch-localsgd/seed2", "lstm-100mbit/default/seed0", "lstm-100mbit/default/seed1",
        "lstm-100mbit/default/seed2"]}}}}))
    report.main()
    text = (tmp_path / "report.md").read_text()
    assert "## instances" not in text  # the list is no machine
    assert "| torch-localsgd | measured | 3 (1 on VM B) | 102 (" in text
    assert ("| diloco-v4 ahead of torch-localsgd | lstm-100mbit | 62 s vs 102 s | **yes** (torch-localsgd's runs on "
            "the faster VM B) |") in text
    assert ("| diloco-v4 ahead of default | lstm-100mbit | 62 s vs 42 s | not decided (default's runs on the faster "
            "VM B) |") in text
    assert "| diloco-v4 within 1.25x the compute floor | lstm-100mbit | 62 s = 1.48x | no |" in text
    # diloco-v4's own runs on B decide nothing
    listed = json.loads((tmp_path / "instances" / "instances.json").read_text())
    listed["cpu"]["vms"]["B"]["runs"].append("lstm-100mbit/diloco-v4/seed0")
    (tmp_path / "instances" / "instances.json").write_text(json.dumps(listed))
    report.main()
    text = (tmp_path / "report.md").read_text()
    assert "| diloco-v4 within 1.25x the compute floor | lstm-100mbit | 62 s = 1.48x | not decided (runs on VM B) |" in text
    assert "| diloco-v4 ahead of torch-localsgd | lstm-100mbit | 62 s vs 102 s | not decided (diloco-v4's runs on VM B) |" in text


def test_a_missed_seed_of_diloco_v4_decides_every_ahead_of_bar_as_a_no(tmp_path, monkeypatch):
    """A seed of diloco-v4 that never reached the target makes its mean infinite: it is ahead of
    no peer, whatever the peers' runs show, before they have run or on a faster VM."""
    out = report_on_one_machine(tmp_path, monkeypatch)
    v4.frozen_setting("lstm-100mbit")  # target 32
    for seed, finals in zip(v4.SEEDS, ([35.0, 30.0], [35.0, 33.0], [35.0, 30.0])):  # seed 1 ends above 32
        write_run(out / "lstm-100mbit" / "diloco-v4" / f"seed{seed}", step_s=0.3, eval_s=1.0, finals=finals,
                  setting="lstm-100mbit", method="diloco-v4", protocol=v4.PROTOCOL)
    three_seeds(out, "lstm-100mbit", "default", 0.2, [35.0, 30.0])  # on a faster VM, below
    (tmp_path / "instances").mkdir()
    (tmp_path / "instances" / "instances.json").write_text(json.dumps({"cpu": {"vms": {"B": {"runs": [
        f"lstm-100mbit/default/seed{seed}" for seed in v4.SEEDS]}}}}))
    report.main()
    text = (tmp_path / "report.md").read_text()
    missed = "no (diloco-v4 has a seed that missed the target)"
    assert f"| diloco-v4 ahead of torch-localsgd | lstm-100mbit | not reached vs no runs | {missed} |" in text
    assert f"| diloco-v4 ahead of default | lstm-100mbit | not reached vs 42 s | {missed} |" in text
    # the same before its other seeds have run: the missed one decides the floor bar too
    for seed in (0, 2):
        shutil.rmtree(out / "lstm-100mbit" / "diloco-v4" / f"seed{seed}")
    report.main()
    text = (tmp_path / "report.md").read_text()
    assert "| diloco-v4 within 1.25x the compute floor | lstm-100mbit | not reached | no |" in text
    assert f"| diloco-v4 ahead of default | lstm-100mbit | not reached vs 42 s | {missed} |" in text
    assert "not reached in 1 (seed 1: best 33.00) (1 of 3 seeds run)" in text
