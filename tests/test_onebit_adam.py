"""``acc.OneBitAdam`` (accordion_hvd/periodic/onebit_adam.py) under real torchrun and horovodrun jobs:
step by step against a plain-torch 1-bit Adam (AdamW, and Adam with L2 decay), the defaults
training with the ranks in agreement, resume bit for bit before and after the freeze, a
non-finite gradient skipped on every rank, resume through torch.distributed.checkpoint too, bad input refused on every rank
(tests/workers/onebit_adam_check.py)."""

import csv
import io

import pytest
import torch

from launch import run_ddp_module, run_ddp_worker, run_worker


@pytest.mark.torchrun
@pytest.mark.parametrize("mode,np", [("reference", 2), ("reference", 3), ("default", 2), ("resume", 2),
                                     ("dcp", 2), ("nonfinite", 2), ("bad-input", 2)])
def test_onebit_adam(mode, np):
    out = run_ddp_worker("onebit_adam_check.py", mode, np=np)
    assert out.count(f": OK {mode}") == np, out


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["reference", "bad-input"])
def test_onebit_adam_under_horovodrun(mode):
    out = run_worker("onebit_adam_check.py", mode, "horovod", np=2)
    assert out.count(f": OK {mode}") == 2, out


@pytest.mark.torchrun
def test_the_cli_trains_with_it_counts_its_wire_and_resumes_bit_for_bit(tmp_path):
    """``--sync ours-onebit-adam`` (cli/onebit.py) on the digits CNN, freezing at step 10 of 44
    (a freeze this early diverged without the update's clip): it learns, steps.csv's
    ``wire_bits`` is this rank's bytes (8-bit sparse chunks for 10 steps, then about 1 bit per
    weight), and a run resumed from epoch 1's checkpoint ends as the one that never stopped."""
    whole, half, resumed = tmp_path / "whole", tmp_path / "whole.epoch1", tmp_path / "resumed"
    args = ["--launcher", "ddp", "--no-progress", "--codec", "none", "--epochs", "2", "--optimizer", "adamw", "--lr",
            "0.003", "--sync", "ours-onebit-adam", "--freeze-step", "10"]
    out = run_ddp_module("accordion_hvd.train", *args, "--checkpoint", str(whole), "--keep-checkpoints",
                         "--logdir", str(tmp_path / "log"), np=2, timeout=400)
    assert "acc.OneBitAdam (freeze_step=10, max_update=3.0)" in out and "final test accuracy" in out, out
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.8, out  # chance is 0.1
    with open(tmp_path / "log" / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    params = int(out.split("training cnn (")[1].split(" parameters")[0].replace(",", ""))
    bits = [int(r["wire_bits"]) for r in steps]
    assert len(steps) == 44 and bits[9] <= 10 * 8.5 * params  # the warm-up: at most 8 bits and the scales
    assert 34 * 0.9 * params < bits[-1] - bits[9] < 34 * 4 * params  # 1 bit per weight, the biases in 32
    out = run_ddp_module("accordion_hvd.train", *args, "--resume", str(half), "--checkpoint", str(resumed), np=2,
                         timeout=400)
    assert "resumed from" in out, out
    for rank in range(2):
        a = torch.load(f"{whole}.rank{rank}", weights_only=False)
        b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"
        key = f"accordion.onebit_adam.rank{rank}"  # (its state_dict's form: acc.OneBitAdam.state_dict)
        x, y = (torch.load(io.BytesIO(c["sync"][key]), weights_only=True) for c in (a, b))
        assert x["steps"] == y["steps"] == 44 and all(torch.equal(m, n) for m, n in zip(x["momentum"], y["momentum"]))
