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


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_training_cli_learns_digits(compression):
    result = horovodrun(["-m", "accordion_hvd.train", "--compression", compression, "--epochs", "8"],
                        backend="gloo", timeout=300)
    assert result.returncode == 0, result.stdout
    match = re.search(r"final test accuracy: ([0-9.]+) \(2 ranks", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.9, result.stdout


def test_training_cli_rejects_bad_arguments():
    result = horovodrun(["-m", "accordion_hvd.train", "--epochs", "0"], np=1, backend="gloo", timeout=60)
    assert result.returncode != 0
    assert "--epochs must be at least 1, got 0" in result.stdout
