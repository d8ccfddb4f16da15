"""The training CLI under horovodrun: what it records, and exact resume from a checkpoint."""

import csv

import pytest
import torch

from launch import run_module

pytestmark = pytest.mark.horovod

ACCORDION = ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4", "--lr-milestones", "3", "--no-progress"]


def test_records_metrics_and_plots(tmp_path):
    out = run_module("accordion_hvd.train", *ACCORDION, "--epochs", "4", "--logdir", str(tmp_path), np=2,
                     backend="gloo")
    assert "final test accuracy" in out and "2 ranks on cpu" in out  # --device auto, no GPU here
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    steps_per_epoch = (1438 // 2) // 32
    assert len(rows) == 4 * steps_per_epoch
    levels = {k: v for k, v in rows[-1].items() if k.startswith("level/")}
    assert levels["level/classifier.1.bias"] == "dense" and levels["level/classifier.1.weight"] in ("normal", "critical")
    assert int(rows[-1]["floats_sent"]) < int(rows[-1]["floats_dense"])
    # The lr drop at the start of the 4th epoch is a step down in the lr column, and every layer is critical
    # right after it (until the detection at the end of that epoch).
    first_of_epoch4 = next(i for i, r in enumerate(rows) if r["epoch"] == "4")
    assert float(rows[first_of_epoch4]["lr"]) < float(rows[first_of_epoch4 - 1]["lr"])
    after = rows[first_of_epoch4]
    assert all(v in ("critical", "dense") for k, v in after.items() if k.startswith("level/")), after
    with open(tmp_path / "eval.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    for png in ("accuracy_vs_floats.png", "accuracy_vs_time.png", "regimes.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.glob("events.out.tfevents.*"))


RESUME_CASES = {
    "powersgd-accordion": ACCORDION,
    "powersgd-static": ["--codec", "powersgd", "--rank", "2", "--no-progress"],
    "topk-accordion": ["--codec", "topk", "--ratio", "0.1", "--critical-ratio", "0.6", "--no-progress"],
    "topk-static": ["--codec", "topk", "--ratio", "0.05", "--no-progress"],
}


@pytest.mark.parametrize("codec", RESUME_CASES.values(), ids=RESUME_CASES.keys())
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, codec):
    """The checkpoint kept after epoch 2 (step 44), restored into a fresh job, reaches step 110
    (66 steps later) with the parameters, optimizer state (momentum), error feedback, levels
    and counters of the run that never stopped, bit for bit; and it really resumed: its
    first step is 45, not 1."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    half = tmp_path / "whole.epoch2"  # --keep-checkpoints: the uninterrupted run's checkpoint after epoch 2
    run_module("accordion_hvd.train", *codec, "--epochs", "5", "--checkpoint", str(whole), "--keep-checkpoints",
               np=2, backend="gloo")
    out = run_module("accordion_hvd.train", *codec, "--epochs", "5", "--resume", str(half),
                     "--checkpoint", str(resumed), np=2, backend="gloo")
    assert "resumed from" in out and "at epoch 2, step 44" in out, out
    for rank in range(2):
        a = torch.load(f"{whole}.rank{rank}", weights_only=False)
        b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
        start = torch.load(f"{half}.rank{rank}", weights_only=False)["step"]
        assert a["step"] == b["step"] >= start + 50, (start, a["step"], b["step"])
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"
        momentum_a, momentum_b = a["optimizer"]["state"], b["optimizer"]["state"]
        assert momentum_a.keys() == momentum_b.keys() and momentum_a
        for key in momentum_a:
            assert torch.equal(momentum_a[key]["momentum_buffer"], momentum_b[key]["momentum_buffer"]), key
        ca, cb = a["compression"], b["compression"]
        assert ca["sent"] == cb["sent"] and ca["controller"]["levels"] == cb["controller"]["levels"]
        for layer in ca["layers"]:
            assert torch.equal(ca["layers"][layer]["residual"], cb["layers"][layer]["residual"]), layer


def test_batch_mode_switches_between_small_and_large_batches(tmp_path):
    # Accordion drives the batch size: 1 micro-batch per step in critical regimes (the
    # first two epochs at least), 4 otherwise, with the learning rate scaled alike; fewer
    # optimizer steps means fewer allreduces.
    out = run_module("accordion_hvd.train", "--codec", "none", "--batch-mode", "--large-passes", "4",
                     "--epochs", "8", "--lr-milestones", "6", "--no-progress", "--logdir", str(tmp_path),
                     np=2, backend="gloo")
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    passes = [int(r["passes"]) for r in rows]
    assert passes[0] == 1 and 4 in passes, passes
    for r in rows:  # the learning rate carries the batch's scale (base 0.04 on 2 ranks)
        base = 0.04 * (0.1 if int(r["epoch"]) > 6 else 1.0)
        assert float(r["lr"]) == pytest.approx(base * int(r["passes"])), r
    assert len(rows) < 8 * 22, "no step took more than one micro-batch"
    accuracy = float(out.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.9, out


def test_gravac_policy_trains_and_records_its_choices(tmp_path):
    out = run_module("accordion_hvd.train", "--codec", "topk", "--policy", "gravac", "--gravac-window", "20",
                     "--epochs", "5", "--no-progress", "--logdir", str(tmp_path), np=2, backend="gloo")
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    levels = {v for r in rows for k, v in r.items() if k.startswith("level/")}
    assert "10x" in levels, levels  # the minimum factor; "dense" for biases and fallbacks
    assert int(rows[-1]["floats_sent"]) < int(rows[-1]["floats_dense"]) / 2
    accuracy = float(out.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.9, out


def test_resume_is_exact_with_dropout(tmp_path):
    """The LSTM language model draws dropout masks: the checkpoint carries the random
    streams, so a run resumed after epoch 1 ends epoch 2 with the parameters of the run that
    never stopped, bit for bit (without them, the masks after the resume differ)."""
    lstm = ["--dataset", "text", "--model", "lstm", "--lr", "0.5", "--batch-size", "256", "--codec", "powersgd",
            "--rank", "2", "--no-progress", "--max-train-samples", "2048", "--max-eval-samples", "256"]
    whole, half, resumed = tmp_path / "whole", tmp_path / "whole.epoch1", tmp_path / "resumed"
    run_module("accordion_hvd.train", *lstm, "--epochs", "2", "--checkpoint", str(whole), "--keep-checkpoints",
               np=2, backend="gloo")
    out = run_module("accordion_hvd.train", *lstm, "--epochs", "2", "--resume", str(half), "--checkpoint",
                     str(resumed), np=2, backend="gloo")
    assert "resumed from" in out and "at epoch 1" in out, out
    for rank in range(2):
        a = torch.load(f"{whole}.rank{rank}", weights_only=False)
        b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
        assert a["step"] == b["step"] and torch.equal(a["rng"]["cpu"], b["rng"]["cpu"])
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), f"rank {rank}: {name} differs"


def test_resume_with_another_number_of_ranks_keeps_all_but_the_error_feedback(tmp_path):
    """2 ranks checkpoint, 3 ranks resume: each new rank starts from rank 0's parameters,
    optimizer state, levels, Q and counters (the error feedback restarts at zero, with a
    warning saying so), and the three ranks train on in agreement."""
    ckpt, after = tmp_path / "ckpt", tmp_path / "after"
    run_module("accordion_hvd.train", *ACCORDION, "--epochs", "2", "--checkpoint", str(ckpt), np=2, backend="gloo")
    out = run_module("accordion_hvd.train", *ACCORDION, "--epochs", "4", "--resume", str(ckpt), "--checkpoint",
                     str(after), np=3, backend="gloo")
    assert "saved by 2 ranks, this run has 3" in out and "starts from zero" in out, out
    assert "resumed from" in out and "at epoch 2, step 44" in out, out
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.5, out  # chance is 0.1
    states = [torch.load(f"{after}.rank{rank}", weights_only=False) for rank in range(3)]
    assert states[0]["step"] == 44 + 2 * ((1438 // 3) // 32)
    for state in states[1:]:
        for name in states[0]["model"]:
            assert torch.equal(state["model"][name], states[0]["model"][name]), name
        assert state["compression"]["controller"]["levels"] == states[0]["compression"]["controller"]["levels"]


def test_one_rank_trains_and_says_nothing_was_compressed(tmp_path):
    # Horovod's DistributedOptimizer registers no hooks on a single rank: the compressor is
    # never called. The run must still finish and say so, not divide by zero sent floats.
    out = run_module("accordion_hvd.train", *ACCORDION, "--epochs", "1", "--logdir", str(tmp_path), np=1,
                     backend="gloo")
    assert "has no effect" in out and "sent by rank 0: nothing" in out, out
    with open(tmp_path / "steps.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["floats_sent"]) == 0


# On a GPU machine with Horovod built: the CLI trains on the GPU by default (2 ranks sharing
# it), and its checkpoint resumes on the CPU (tensors follow --device, not where they were saved).
@pytest.mark.cuda
def test_trains_on_the_gpu_and_resumes_on_the_cpu(tmp_path):
    import accordion_hvd

    if not (torch.cuda.is_available() and accordion_hvd.with_cuda):
        pytest.skip("needs a CUDA GPU and accordion_hvd built with its CUDA kernels")
    topk = ["--codec", "topk", "--ratio", "0.1", "--critical-ratio", "0.6", "--no-progress"]
    gpu = run_module("accordion_hvd.train", *topk, "--epochs", "2", "--checkpoint", str(tmp_path / "ckpt"),
                     "--logdir", str(tmp_path / "gpu"), np=2, backend="gloo")
    print(gpu)  # for the GPU log (pytest -rA)
    assert "2 ranks on cuda" in gpu
    saved = torch.load(tmp_path / "ckpt.rank1", weights_only=False)
    assert all(layer["residual"].is_cuda for layer in saved["compression"]["layers"].values())
    cpu = run_module("accordion_hvd.train", *topk, "--epochs", "3", "--resume", str(tmp_path / "ckpt"),
                     "--device", "cpu", np=2, backend="gloo")
    assert "resumed from" in cpu and "2 ranks on cpu" in cpu
    accuracy = float(cpu.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.5, cpu  # chance is 0.1; the same run on the CPU alone reaches 0.69


def test_language_model_on_the_standard_library_reports_perplexity(tmp_path):
    """--dataset text --model lstm: the vocabulary is stated, a few steps lower the
    perplexity far below the vocabulary's size (a uniform guess), and the last line says the
    test perplexity; eval.csv records perplexity."""
    out = run_module("accordion_hvd.train", "--dataset", "text", "--codec", "powersgd", "--rank", "1",
                     "--critical-rank", "4", "--lr", "0.5", "--max-steps", "30", "--logdir", str(tmp_path),
                     "--no-progress", np=2, backend="gloo", timeout=300)
    vocabulary = int(out.split("vocabulary: ")[1].split()[0])
    perplexity = float(out.split("final test perplexity: ")[1].split()[0])
    assert vocabulary > 5_000 and 1 < perplexity < vocabulary / 10, out
    assert "stopped after 30 optimizer steps" in out and "(2 ranks, 1 epoch, 30 steps" in out, out
    with open(tmp_path / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["accuracy"] == "" and float(rows[0]["perplexity"]) > 1
    assert (tmp_path / "perplexity_vs_floats.png").is_file()


def test_network_aware_policy_trains_checkpoints_and_resumes(tmp_path):
    """--policy network-aware: trains digits past 90% in 8 epochs, its decisions are in the
    checkpoint (Accordion's regimes underneath, the levels it chose, the steps it timed), and a
    resumed run goes on
    from them."""
    args = ["--codec", "topk", "--ratio", "0.01", "--critical-ratio", "0.1", "--policy", "network-aware",
            "--interval", "10", "--no-progress"]
    ckpt = tmp_path / "ckpt"
    run_module("accordion_hvd.train", *args, "--epochs", "2", "--checkpoint", str(ckpt), np=2, backend="gloo")
    saved = torch.load(f"{ckpt}.rank0", weights_only=False)["compression"]["controller"]["policy"]
    assert {"regimes", "levels", "measured"} <= set(saved) and saved["levels"] and saved["measured"], saved
    out = run_module("accordion_hvd.train", *args, "--epochs", "8", "--resume", str(ckpt), "--logdir",
                     str(tmp_path), np=2, backend="gloo")
    assert "resumed from" in out and "at epoch 2" in out, out
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["floats_sent"]) < int(rows[-1]["floats_dense"]), rows[-1]
    assert float(out.split("final test accuracy: ")[1].split()[0]) > 0.9, out  # Accordion: 0.82 at 4 epochs


def test_transformer_language_model_with_adamw_trains_on_the_standard_library(tmp_path):
    """--model transformer --optimizer adamw: a few steps lower the perplexity far below a
    uniform guess, and the compressor compresses the transformer's matrices."""
    out = run_module("accordion_hvd.train", "--dataset", "text", "--model", "transformer", "--optimizer", "adamw",
                     "--codec", "powersgd", "--rank", "1", "--critical-rank", "4", "--lr", "0.001",
                     "--max-steps", "40", "--logdir", str(tmp_path), "--no-progress", np=2, backend="gloo",
                     timeout=300)
    vocabulary = int(out.split("vocabulary: ")[1].split()[0])
    perplexity = float(out.split("final test perplexity: ")[1].split()[0])
    assert "training transformer" in out and 1 < perplexity < vocabulary / 10, out
    with open(tmp_path / "steps.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert int(last["floats_sent"]) < int(last["floats_dense"]) / 5, last


def test_an_unreached_target_trains_on_at_the_final_rate_until_the_time_cap(tmp_path):
    """--target not reached after --epochs: more epochs, until --time-cap (checked at each of
    --evals-per-epoch evaluations); every evaluation is in eval.csv."""
    out = run_module("accordion_hvd.train", "--codec", "topk", "--ratio", "0.1", "--epochs", "1",
                     "--evals-per-epoch", "3", "--target", "0.9999", "--time-cap", "12", "--logdir", str(tmp_path),
                     "--no-progress", np=2, backend="gloo", timeout=300)
    assert "--target 0.9999 not reached after 1 epochs" in out and "--time-cap 12 s passed" in out, out
    with open(tmp_path / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 4 and len({r["step"] for r in rows}) == len(rows), rows  # 3 per epoch, past epoch 1
    assert float(rows[-1]["wall_s"]) > 12 and float(rows[-2]["wall_s"]) <= 12 + 5, rows[-2:]


def test_a_reached_target_stops_at_the_standard_budget_and_a_diverged_run_is_said(tmp_path):
    reached = run_module("accordion_hvd.train", "--codec", "topk", "--ratio", "0.1", "--epochs", "2",
                         "--target", "0.05", "--time-cap", "600", "--no-progress", np=2, backend="gloo")
    assert "not reached" not in reached and "(2 ranks, 2 epochs," in reached, reached
    diverged = run_module("accordion_hvd.train", "--codec", "topk", "--ratio", "0.1", "--epochs", "3",
                          "--lr", "1e6", "--no-progress", np=2, backend="gloo")
    # The compressor skips every step with a non-finite gradient: parameters stay finite, and
    # a run whose every step since the last evaluation was skipped has diverged.
    assert "diverged" in diverged and "every step since the last evaluation skipped" in diverged, diverged
    assert "(2 ranks, 3 epochs" not in diverged, diverged  # stopped before its 3 epochs
