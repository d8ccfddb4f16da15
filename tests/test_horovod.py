"""Real multi-process runs under horovodrun, with Gloo and with MPI."""

import re

import pytest

from launch import horovodrun, run_worker

pytestmark = pytest.mark.horovod


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("np", [2, 3])
def test_data_parallel_stack(backend, np):
    out = run_worker("data_parallel_check.py", backend, str(np), np=np, backend=backend)
    for rank in range(np):
        assert f"rank {rank}: OK ({backend}, size {np})" in out, out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_optimizer_waits_for_a_late_rank_without_spinning(backend):
    """Horovod's synchronize busy-waits; with accordion_hvd's polite wait installed, a rank
    waiting a second for a late one uses a small fraction of that second in CPU time."""
    out = run_worker("polite_wait_check.py", np=2, backend=backend)
    for rank in range(2):
        assert f"rank {rank}: OK" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "fp16", "powersgd", "topk"])
def test_training_cli_learns_digits(codec):
    result = horovodrun(["-m", "accordion_hvd.train", "--codec", codec, "--epochs", "8"],
                        backend="gloo", timeout=300)
    assert result.returncode == 0, result.stdout
    match = re.search(r"final test accuracy: ([0-9.]+) \(2 ranks", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.9, result.stdout
    if codec in ("powersgd", "topk"):
        assert re.search(r"sent by rank 0: [0-9,.]+ MB of [0-9,.]+ MB dense \(([0-9.]+)x less on the wire\); floats "
                         r"[0-9,]+ of [0-9,]+", result.stdout), result.stdout


@pytest.mark.parametrize("args,message", [
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--codec", "topk", "--ratio", "2"], r"ratio must be in (0, 1.0], got 2.0"),
    (["--codec", "powersgd", "--rank", "0"], "rank must be positive, got 0"),
    (["--max-train-samples", "20"], "--batch-size 32: 20 training samples over 1 ranks make no full batch"),
])
def test_training_cli_rejects_bad_arguments(args, message):
    result = horovodrun(["-m", "accordion_hvd.train", *args], np=1, backend="gloo", timeout=60)
    assert result.returncode != 0
    assert message in result.stdout
