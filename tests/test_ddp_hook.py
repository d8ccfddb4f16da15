"""The DDP front end (accordion_hvd/ddp.py): AccordionCompressor as a DDP comm hook, under a
real ``torchrun`` (Gloo), checked against the same NumPy reference as the Horovod path
(tests/workers/numpy_reference_check.py with FRONT "ddp"), the training CLI with
``--launcher ddp`` (records, levels agreed by every rank, exact resume), and bad input:
ranks with different settings, a process group of other ranks, a parameter the hook was not
told about."""

import csv
import re

import pytest
import torch

import accordion_hvd as acc
from launch import WORKERS, run_ddp_module, run_ddp_worker, torchrun


@pytest.mark.torchrun
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("mode", ["powersgd", "topk", "quantize", "settled"])
def test_ddp_hook_matches_numpy_reference(mode, np):
    out = run_ddp_worker("numpy_reference_check.py", mode, "6", "ddp", np=np)
    assert out.count(f": OK {mode} ") == np, out


def test_registering_on_a_model_not_wrapped_in_ddp_names_the_argument():
    with pytest.raises(TypeError, match="ddp_model must be a torch.nn.parallel.DistributedDataParallel, got Linear"):
        acc.register_ddp_hook(torch.nn.Linear(2, 2), acc.AccordionCompressor())


def test_a_compressor_serves_one_model():
    compressor = acc.AccordionCompressor()
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    compressor.bind(first, channel=None, control=None)
    compressor.bind(first, channel=None, control=None)  # the same model again: fine
    with pytest.raises(ValueError, match="already bound to another model"):
        compressor.bind(second, channel=None, control=None)


# --- the training CLI under torchrun (--launcher ddp) ------------------------------------------
ACCORDION = ["--launcher", "ddp", "--codec", "powersgd", "--rank", "1", "--critical-rank", "4", "--lr-milestones", "3",
             "--no-progress"]


def cli(*args, np=2):
    return run_ddp_module("accordion_hvd.train", *args, np=np, timeout=300)


@pytest.mark.torchrun
def test_cli_under_ddp_records_levels_agreed_on_every_rank_and_resumes_bit_for_bit(tmp_path):
    """The CLI through our DDP hook: it trains, records the levels, every rank holds the same
    levels, and a run resumed from the checkpoint kept after epoch 2 ends at step 88 with the
    parameters, error feedback, levels and counters of the run that never stopped."""
    whole, half, resumed = tmp_path / "whole", tmp_path / "whole.epoch2", tmp_path / "resumed"
    out = cli(*ACCORDION, "--epochs", "4", "--checkpoint", str(whole), "--keep-checkpoints",
              "--logdir", str(tmp_path / "log"))
    assert "2 ranks on cpu (ddp)" in out and "final test accuracy" in out, out
    accuracy = float(out.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.5, out  # chance is 0.1
    with open(tmp_path / "log" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * ((1438 // 2) // 32)
    assert {v for k, v in rows[-1].items() if k.startswith("level/")} <= {"normal", "critical", "dense"}
    assert int(rows[-1]["floats_sent"]) < int(rows[-1]["floats_dense"])
    out = cli(*ACCORDION, "--epochs", "4", "--resume", str(half), "--checkpoint", str(resumed))
    assert "resumed from" in out, out
    states = []
    for rank in range(2):
        a = torch.load(f"{whole}.rank{rank}", weights_only=False)
        b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
        assert a["step"] == b["step"] == 4 * ((1438 // 2) // 32)
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"
        ca, cb = a["compression"], b["compression"]
        assert ca["sent"] == cb["sent"] and ca["controller"]["levels"] == cb["controller"]["levels"]
        for layer in ca["layers"]:
            assert torch.equal(ca["layers"][layer]["residual"], cb["layers"][layer]["residual"]), layer
        states.append(ca)
    # Levels, Q and the controller's decisions are the same on every rank (error feedback is per rank).
    assert states[0]["controller"]["levels"] == states[1]["controller"]["levels"]
    assert states[0]["controller"]["windows"] == states[1]["controller"]["windows"] >= 3
    for layer in states[0]["layers"]:
        assert states[0]["layers"][layer]["level"] == states[1]["layers"][layer]["level"], layer
        assert torch.equal(states[0]["layers"][layer]["qt"], states[1]["layers"][layer]["qt"]), layer


@pytest.mark.torchrun
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_cli_under_ddp_runs_the_uncompressed_baselines(codec):
    out = cli("--launcher", "ddp", "--codec", codec, "--epochs", "1", "--no-progress")
    assert "compression uncompressed" in out and "final test accuracy" in out, out


# --- bad input -----------------------------------------------------------------------------------
@pytest.mark.torchrun
@pytest.mark.parametrize("mode,field", [("rank", "'rank': 2 (process 0) vs 4 (process 1)"),
                                        ("codec", "'codec': 'powersgd' (process 0) vs 'topk' (process 1)"),
                                        ("eta", "'eta': 0.5 (process 0) vs 0.3 (process 1)")])
def test_different_settings_fail_with_the_same_message_on_every_rank_under_ddp(mode, field):
    result = torchrun([str(WORKERS / "mismatch_check.py"), mode, "ddp"], np=2, timeout=120)
    assert result.returncode != 0, result.stdout
    plain = re.sub(r"\[[\d,]+\]<std(?:out|err)>:", "", result.stdout)
    messages = {int(m.group(1)): m.group(2) for m in re.finditer(r"^rank (\d+): (.*)$", plain, re.M)}
    assert sorted(messages) == [0, 1], result.stdout  # every rank raised, none hung or went on
    assert messages[0] == messages[1], result.stdout
    assert "ranks were started with different settings" in messages[0] and field in messages[0]


@pytest.mark.torchrun
def test_a_process_group_of_other_ranks_is_refused_at_registration():
    out = run_ddp_worker("ddp_registration_check.py", np=2)
    assert out.count(": OK") == 2, out


@pytest.mark.torchrun
def test_gradients_reach_the_compressor_as_autograd_accumulates_them_with_the_same_result():
    out = run_ddp_worker("ddp_early_check.py", np=2)
    assert out.count(": OK early hand-over") == 2, out
