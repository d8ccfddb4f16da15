"""The training CLI's periodic synchronisation under real torchrun jobs (cli/periodic.py):
``--sync diloco`` with our compression (a fixed interval and ``auto``), DiLoCo as published
(``--codec none``), overlapped rounds (``--overlap``), PyTorch's local SGD; their records, evaluation of one model, resume bit for
bit, and the flags refused where they do not apply."""

import csv

import pytest
import torch

from accordion_hvd.cli.options import parse_args
from accordion_hvd.periodic import SyncInterval
from launch import run_ddp_module, torchrun

COMMON = ["--launcher", "ddp", "--no-progress", "--lr-milestones", "2"]
STEPS = (1438 // 2) // 32  # digits, 2 ranks, batch 32: steps per epoch
SMALL = (1438 // 2) // 8  # at --batch-size 8: enough steps for DiLoCo's windows of 64


def cli(*args, np=2):
    return run_ddp_module("accordion_hvd.train", *args, np=np, timeout=400)


def rows(logdir):
    with open(logdir / "steps.csv") as f:
        return list(csv.DictReader(f))


def final_checkpoints(whole, resumed) -> list[tuple]:
    """(rank, the run that never stopped's last checkpoint, the resumed run's) of each rank,
    their models checked equal."""
    pairs = []
    for rank in range(2):
        a = torch.load(f"{whole}.rank{rank}", weights_only=False)
        b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"
        pairs.append((rank, a, b))
    return pairs


@pytest.mark.torchrun
def test_diloco_auto_trains_records_its_intervals_and_resumes_bit_for_bit(tmp_path):
    """Our DiLoCo with the auto interval: it learns, steps.csv holds each step's interval and the
    rounds so far (the first window every step, then fewer), sends fewer floats than a step
    of dense (the interval's floor reads the clock, so the intervals are not checked further), and a run resumed from epoch 2's checkpoint ends with the parameters, outer state
    and error feedback of the run that never stopped."""
    whole, half, resumed = tmp_path / "whole", tmp_path / "whole.epoch2", tmp_path / "resumed"
    args = [*COMMON, "--sync", "diloco", "--sync-every", "auto", "--epochs", "3", "--batch-size", "8", "--lr", "0.005"]
    out = cli(*args, "--checkpoint", str(whole), "--keep-checkpoints", "--logdir", str(tmp_path / "log"))
    assert "DiLoCo (sync_every=auto, our compression)" in out and "final test accuracy" in out, out
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.5, out  # chance is 0.1
    steps = rows(tmp_path / "log")
    assert len(steps) == 3 * SMALL
    intervals = [int(r["sync_interval"]) for r in steps]
    syncs = [int(r["syncs"]) for r in steps]
    # the first window (64 steps; no link measured yet): a round every step; after it, the floor the link allows
    assert intervals[:63] == [1] * 63 and syncs[63] == 64, (intervals, syncs)
    assert syncs[-1] < len(steps), syncs  # calm windows somewhere: longer intervals
    floats = int(out.split("training cnn (")[1].split(" parameters")[0].replace(",", ""))
    assert int(steps[-1]["floats_sent"]) < int(steps[-1]["floats_dense"]) == len(steps) * floats  # dense every step
    out = cli(*args, "--resume", str(half), "--checkpoint", str(resumed))
    assert "resumed from" in out, out
    for rank, a, b in final_checkpoints(whole, resumed):
        for x, y in zip(a["sync"]["start"], b["sync"]["start"]):
            assert torch.equal(x, y), f"rank {rank}: the start-of-round parameters differ"
        assert a["sync"]["interval"] == b["sync"]["interval"] and a["sync"]["syncs"] == b["sync"]["syncs"]


@pytest.mark.torchrun
def test_diloco_overlapped_trains_counts_its_rounds_and_resumes_bit_for_bit(tmp_path):
    """``--overlap``: rounds every 8 steps, each landing one round late (an evaluation lands
    the one in flight); it learns, counts its rounds, and a run resumed from epoch 1's
    checkpoint ends with the parameters of the run that never stopped."""
    whole, half, resumed = tmp_path / "whole", tmp_path / "whole.epoch1", tmp_path / "resumed"
    args = [*COMMON, "--sync", "diloco", "--sync-every", "8", "--overlap", "--epochs", "2"]
    out = cli(*args, "--checkpoint", str(whole), "--keep-checkpoints", "--logdir", str(tmp_path / "log"))
    assert "DiLoCo (sync_every=8, our compression, overlapped)" in out and "final test accuracy" in out, out
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.3, out  # 44 steps; chance is 0.1
    last = rows(tmp_path / "log")[-1]
    assert int(last["syncs"]) == 2 * STEPS // 8
    assert 0 < int(last["bytes_sent"]) < 2 * int(last["floats_dense"])  # fewer bytes than 16-bit dense every step
    first, second = STEPS // 8, 2 * STEPS // 8 - STEPS // 8  # the rounds of each epoch, in its log line
    assert f"epoch 1/2  {first} rounds ({first} in all), now every 8 inner steps" in out, out
    assert f"epoch 2/2  {second} rounds ({first + second} in all)" in out, out
    out = cli(*args, "--resume", str(half), "--checkpoint", str(resumed))
    assert "resumed from" in out, out
    final_checkpoints(whole, resumed)


@pytest.mark.torchrun
def test_a_diverged_diloco_run_is_said_and_stops(tmp_path):
    """A learning rate that makes every inner step's model non-finite: every round is skipped
    (its pseudo-gradient is not finite), so the model evaluated stays finite; the run is said
    to have diverged at the first evaluation (every round since it skipped), not trained on."""
    out = cli(*COMMON, "--sync", "diloco", "--sync-every", "4", "--epochs", "3", "--lr", "1e30")
    assert "diverged" in out and "every step since the last evaluation skipped" in out, out
    assert "(2 ranks, 3 epochs" not in out, out  # stopped before its 3 epochs


@pytest.mark.torchrun
@pytest.mark.parametrize("method", ["published", "localsgd"])
def test_the_periodic_peers_train_and_count_their_rounds(tmp_path, method):
    flags = (["--sync", "diloco", "--codec", "none", "--sync-every", "8"] if method == "published" else
             ["--sync", "torch-localsgd", "--codec", "none", "--localsgd-warmup", "10"])
    out = cli(*COMMON, *flags, "--epochs", "2", "--logdir", str(tmp_path / "log"))
    assert "final test accuracy" in out, out
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.3, out  # 44 steps; chance is 0.1
    steps = rows(tmp_path / "log")
    syncs = int(steps[-1]["syncs"])
    expected = 2 * STEPS // 8 if method == "published" else 10 + len(range(10, 2 * STEPS, 4))
    assert syncs == expected, (syncs, expected)
    floats = int(out.split("training cnn (")[1].split(" parameters")[0].replace(",", ""))
    assert int(steps[-1]["floats_sent"]) == syncs * floats and int(steps[-1]["floats_dense"]) == len(steps) * floats
    assert int(steps[-1]["bytes_sent"]) == 4 * syncs * floats  # float32 on the wire


@pytest.mark.torchrun
def test_diloco_across_the_nodes_of_fsdp_trains_and_resumes_bit_for_bit(tmp_path):
    """``--launcher fsdp --sync diloco``: 2 nodes of 2 ranks, FSDP2 inside each node, rounds
    across them every 3 inner steps; a run resumed from the checkpoint kept after epoch 1 (step
    4, inside a round: each node's parameters and AdamW moments its own, which DCP alone would
    save once for both nodes) trains its second epoch exactly as the run that never stopped
    (every step's loss, the rounds, the final perplexity); a plain fsdp run refuses that
    checkpoint, naming --sync."""
    common = ["--launcher", "fsdp", "--nodes", "2", "--dataset", "text", "--model", "transformer",
              "--optimizer", "adamw", "--lr", "0.001", "--batch-size", "128", "--no-progress",
              "--sync", "diloco", "--sync-every", "3", "--epochs", "2",
              "--max-train-samples", "2048", "--max-eval-samples", "256"]  # 4 steps an epoch
    whole, ckpt, resumed = tmp_path / "whole", tmp_path / "ckpt.epoch1", tmp_path / "resumed"
    a = cli(*common, "--logdir", str(whole), "--checkpoint", str(tmp_path / "ckpt"), "--keep-checkpoints", np=4)
    assert "DiLoCo across them (sync_every=3, our compression)" in a and "final test perplexity" in a, a
    b = cli(*common, "--resume", str(ckpt), "--logdir", str(resumed), np=4)
    assert "resumed from" in b and "at epoch 1, step 4" in b, b
    before, after = rows(whole), rows(resumed)
    assert [int(r["syncs"]) for r in before] == [0, 0, 1, 1, 1, 2, 2, 2], before
    by_step = {r["step"]: (r["loss"], r["syncs"]) for r in before}
    assert [r["step"] for r in after] == ["5", "6", "7", "8"], after
    assert all(by_step[r["step"]] == (r["loss"], r["syncs"]) for r in after), (before, after)
    final = [line for line in a.splitlines() if "final test perplexity" in line]
    assert final and final[-1].split("(")[0] in b, (final, b[-2000:])
    plain = [c for c in common if c not in ("--sync", "diloco", "--sync-every", "3")]
    c = torchrun(["-m", "accordion_hvd.train", *plain, "--resume", str(ckpt)], np=4, timeout=300)
    assert c.returncode != 0 and "saved with --sync diloco, this run has --sync every-step" in c.stdout, c.stdout
    # another mesh (4 nodes of 1): DCP reshards the model (node 0's copy), DiLoCo's outer loop restarts
    other = list(common)
    other[other.index("--nodes") + 1] = "4"
    d = cli(*other, "--resume", str(ckpt), "--logdir", str(tmp_path / "other"), np=4)
    assert "of mesh 2x2, this job's 4x1: the outer loop restarts" in d and "final test perplexity" in d, d
    assert [r["step"] for r in rows(tmp_path / "other")] == ["5", "6", "7", "8"]


@pytest.mark.parametrize("argv,message", [
    (["--sync", "diloco"], "--sync diloco runs under torchrun: add --launcher ddp (or --launcher fsdp"),
    (["--launcher", "fsdp", "--sync", "torch-localsgd", "--codec", "none"], "add --launcher ddp"),
    (["--launcher", "fsdp", "--sync", "diloco", "--codec", "none", "--sync-every", "4"],
     "DiLoCo as published (--codec none) runs under --launcher ddp"),
    (["--launcher", "ddp", "--sync", "torch-localsgd"], "--codec none"),
    (["--launcher", "ddp", "--sync", "diloco", "--codec", "fp16"], "--sync diloco takes --codec none"),
    (["--launcher", "ddp", "--sync", "diloco", "--codec", "none"], "give --sync-every N"),
    (["--launcher", "ddp", "--outer-lr", "0.5"], "--outer-lr is for --sync diloco"),
    (["--launcher", "ddp", "--sync", "diloco", "--localsgd-warmup", "5"],
     "--localsgd-warmup is for --sync torch-localsgd, not --sync diloco"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-every", "0"], "must be auto or a positive number"),
    (["--launcher", "ddp", "--sync", "diloco", "--outer-momentum", "1"], "--outer-momentum in [0, 1)"),
    (["--launcher", "ddp", "--overlap"], "--overlap is for --sync diloco"),
    (["--launcher", "ddp", "--sync", "torch-localsgd", "--codec", "none", "--overlap"],
     "--overlap is for --sync diloco, not --sync torch-localsgd"),
    (["--launcher", "ddp", "--sync", "diloco", "--codec", "none", "--sync-every", "4", "--overlap"],
     "--overlap is our DiLoCo's"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-every", "8", "--reset-momentum"],
     "--reset-momentum is for --sync-every auto"),
    (["--launcher", "ddp", "--reset-momentum"], "--reset-momentum is for --sync diloco"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-every", "8", "--sync-ladder", "1,4"],
     "--sync-ladder is for --sync-every auto"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-every", "8", "--sync-budget", "0.1"],
     "--sync-budget is for --sync-every auto"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-budget", "0"], "--sync-budget: budget must be"),
    (["--launcher", "ddp", "--sync-budget", "0.1"], "--sync-budget is for --sync diloco"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-ladder", "1,3,4"], "--sync-ladder: ladder must be"),
    (["--launcher", "ddp", "--sync", "diloco", "--sync-ladder", "one"], "comma-separated numbers"),
    (["--launcher", "ddp", "--sync-ladder", "1,4"], "--sync-ladder is for --sync diloco"),
    (["--launcher", "ddp", "--plain-below", "64"], "--plain-below is for --sync diloco"),
    (["--launcher", "ddp", "--sync", "diloco", "--codec", "none", "--sync-every", "4", "--plain-below", "8"],
     "--plain-below is our DiLoCo's"),
    (["--launcher", "ddp", "--sync", "diloco", "--plain-below", "0"], "--plain-below must be a positive number"),
])
def test_periodic_flags_are_refused_where_they_do_not_apply(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_ladder_flag_makes_the_interval_policy():
    args = parse_args(["--launcher", "ddp", "--sync", "diloco", "--sync-ladder", "1,4,16", "--reset-momentum"])
    assert isinstance(args.sync_every, SyncInterval) and args.sync_every.ladder == (1, 4, 16)
    assert parse_args(["--launcher", "ddp", "--sync", "diloco"]).sync_every == "auto"
    args = parse_args(["--launcher", "ddp", "--sync", "diloco", "--sync-budget", "0.1"])
    assert args.sync_every.ladder == (1, 4, 16, 64) and args.sync_every.budget == 0.1


def test_the_diloco_flags_become_acc_diloco_keyword_arguments():
    from accordion_hvd.cli.options import diloco_options

    args = parse_args(["--launcher", "ddp", "--sync", "diloco", "--reset-momentum", "--plain-below", "64",
                       "--outer-lr", "1", "--outer-momentum", "0.5"])
    assert diloco_options(args) == {"sync_every": "auto", "outer_lr": 1.0, "outer_momentum": 0.5, "overlap": False,
                                    "reset_momentum": True, "plain_below": 64}
