"""The FSDP2 (HSDP) front end (accordion_hvd/hsdp.py) under a real ``torchrun`` (Gloo, 4
processes: 2 "nodes" of 2): the NumPy reference of the whole data path (FSDP's
reduce-scatter within a node, our codec across nodes) for PowerSGD, TopK and Quantize,
Accordion's levels agreed by every rank, checkpoints through ``torch.distributed.checkpoint``
(bit for bit on the same mesh, error feedback from zero on another), and what registration
refuses."""

import csv
import re
import time

import pytest

from launch import WORKERS, run_ddp_module, run_ddp_worker, torchrun


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["powersgd", "topk", "quantize", "accordion", "settled", "quantize-bf16", "settled-bf16"])
def test_hsdp_matches_the_numpy_reference(mode):
    out = run_ddp_worker("hsdp_reference_check.py", mode, "12", np=4, timeout=300)
    assert out.count(f": OK {mode} ") == 4, out
    if mode == "accordion":  # the rule switched levels (and every rank held the same, checked per step)
        assert "levels ['critical', 'dense', 'normal']" in out, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["accordion", "settled"])
def test_checkpoint_with_torch_distributed_checkpoint_resumes_bit_for_bit(mode, tmp_path):
    out = run_ddp_worker("hsdp_checkpoint_check.py", str(tmp_path / "ckpt"), "10", mode, np=4, timeout=300)
    assert out.count(": OK hsdp checkpoint" + (" (settled)" if mode == "settled" else ":")) == 4, out


BAD = {  # case -> (exception, what the message must say)
    "not-sharded": ("TypeError", "model must be sharded with FSDP2's fully_shard"),
    "one-dim-mesh": ("ValueError", "mesh must be a 2-D DeviceMesh with dimensions ('replicate', 'shard')"),
    "native-hsdp": ("ValueError", "was sharded over the 2-D mesh: FSDP would all-reduce it across nodes itself"),
    "reduce-dtype": ("ValueError", "reduce dtype torch.float16; the compressed all-reduce needs float32 or bfloat16"),
    "not-a-compressor": ("TypeError", "compressor must be an acc.Compressor (or acc.AccordionCompressor), got str"),
    "bound-elsewhere": ("ValueError", "already bound to another model"),
    "settings-differ": ("ValueError", "AccordionCompressor: ranks were started with different settings"),
}


@pytest.mark.torchrun
def test_bad_input_is_refused_at_registration_alike_on_every_rank():
    out = run_ddp_worker("hsdp_bad_input_check.py", np=4, timeout=300)
    for name, (kind, text) in BAD.items():
        lines = sorted(re.findall(rf"rank (\d): {name}: (.*)", out))
        assert [r for r, _ in lines] == ["0", "1", "2", "3"], (name, out)
        messages = {message for _, message in lines}
        assert len(messages) == 1, f"{name}: ranks raised different errors: {messages}"
        message = messages.pop()
        assert message.startswith(f"{kind}: ") and text in message, (name, message)


@pytest.mark.torchrun
@pytest.mark.parametrize("codec", [["--codec", "powersgd", "--rank", "1", "--critical-rank", "4", "--interval", "4",
                                    "--reduce-dtype", "bfloat16"],
                                   ["--codec", "bf16"]], ids=["ours-bf16-reduce", "fsdp-bf16"])
def test_the_cli_trains_the_transformer_under_fsdp(codec, tmp_path):
    """``--launcher fsdp``: 2 nodes of 2 ranks, ours over FSDP's reduce-scatter in bfloat16 or
    FSDP's own bf16 all-reduce; the run's records are written, with the levels of ours."""
    out = run_ddp_module("accordion_hvd.train", "--launcher", "fsdp", "--nodes", "2", "--dataset", "text",
                         "--model", "transformer", "--optimizer", "adamw", "--lr", "0.001", "--max-steps", "12",
                         "--no-progress", "--logdir", str(tmp_path), *codec, np=4, timeout=300)
    assert "4 ranks on cpu (fsdp, reduce in bfloat16)" in out and "final test perplexity" in out, out
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and float(rows[-1]["floats_sent"]) > 0, rows[-1]
    if codec[1] == "powersgd":
        levels = {v for row in rows for k, v in row.items() if k.startswith("level/")}
        assert {"critical", "normal"} <= levels, levels


@pytest.mark.torchrun
def test_the_cli_checkpoints_and_resumes_under_fsdp_bit_for_bit(tmp_path):
    """``--checkpoint``/``--resume`` under ``--launcher fsdp`` (a torch.distributed.checkpoint
    directory): a run resumed from the checkpoint kept after epoch 1 trains its second epoch
    exactly as the run that never stopped (every step's loss, the final perplexity, the error
    feedback and levels carried by the hook's state)."""
    common = ["--launcher", "fsdp", "--nodes", "2", "--dataset", "text", "--model", "transformer",
              "--optimizer", "adamw", "--lr", "0.001", "--batch-size", "128", "--no-progress",
              "--codec", "powersgd", "--rank", "1", "--critical-rank", "4", "--interval", "3",
              "--max-train-samples", "2048", "--max-eval-samples", "256"]  # 4 steps an epoch
    whole, ckpt, resumed = tmp_path / "whole", tmp_path / "ckpt.epoch1", tmp_path / "resumed"
    a = run_ddp_module("accordion_hvd.train", *common, "--epochs", "2", "--logdir", str(whole), "--checkpoint",
                       str(tmp_path / "ckpt"), "--keep-checkpoints", np=4, timeout=400)
    assert (ckpt / ".metadata").is_file() and not (tmp_path / "ckpt.epoch1.tmp").exists()
    b = run_ddp_module("accordion_hvd.train", *common, "--epochs", "2", "--resume", str(ckpt), "--logdir",
                       str(resumed), np=4, timeout=400)
    assert "resumed from" in b and "at epoch 1, step 4" in b, b
    with open(whole / "steps.csv") as f:
        losses = {row["step"]: row["loss"] for row in csv.DictReader(f)}
    with open(resumed / "steps.csv") as f:
        after = {row["step"]: row["loss"] for row in csv.DictReader(f)}
    assert min(map(int, after)) == 5 and after and all(losses[step] == loss for step, loss in after.items()), after
    final = [line for line in a.splitlines() if "final test perplexity" in line]
    assert final and final[-1].split("(")[0] in b, (final, b[-2000:])


@pytest.mark.torchrun
def test_a_rank_that_dies_mid_step_stops_every_other_rank_naming_it():
    """Rank 3 exits in step 3 after its forward pass; the other three are then inside backward's
    collectives (FSDP's reduce-scatter, our all-reduce across nodes). The job must end, not hang,
    within the collective timeout (20 s here), every other rank stopped, and the dead rank named."""
    started = time.monotonic()
    result = torchrun([str(WORKERS / "hsdp_dead_rank_check.py"), "3"], np=4, timeout=240,
                      env={"ACCORDION_COLLECTIVE_TIMEOUT": "20"})
    elapsed, out = time.monotonic() - started, result.stdout
    assert result.returncode != 0, out
    assert "rank 3: dying in step 3" in out and "FINISHED" not in out, out
    assert "step 3 done" not in out, out  # no rank completed the step the dead one left
    assert re.search(r"rank\s*:\s*3 \(local_rank: 3\)", out) and "exitcode  : 17" in out, out
    assert elapsed < 20 + 60, f"the job took {elapsed:.0f} s to end after a rank died"


def test_a_plain_script_hears_each_level_line_once_not_once_per_shard_group():
    """Without logging configured the level lines go to stderr: from global rank 0 only
    (each shard group's data plane has a rank 0 of its own; with both speaking: 2 lines)."""
    out = run_ddp_worker("hsdp_speaker_check.py", np=4, timeout=300)
    assert out.count(": OK speaker") == 4, out
    assert out.count("accordion_hvd.levels: after step") == 1, out
