"""Reliability under real horovodrun: a non-finite gradient on one rank skips the step on
every rank (exactly, with the synchronize/skip_synchronize pattern), error feedback stays
finite, training goes on; the training CLI does the same with injected faults."""

import re

import pytest

from launch import horovodrun, run_module, run_worker, run_worker_in_turn

pytestmark = pytest.mark.horovod


NON_FINITE = (("powersgd", "2.weight", "nan"), ("topk", "0.weight", "inf"), ("powersgd", "4.bias", "inf"),
              ("topk", "4.bias", "nan"))


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("codec,layer,value", NON_FINITE)
def test_a_non_finite_gradient_on_one_rank_is_skipped_on_every_rank(backend, codec, layer, value):
    # the four cases of a backend run in one launch, one after another (tests/workers/in_turn.py)
    out = run_worker_in_turn("nonfinite_check.py", (codec, layer, value), NON_FINITE, np=2, backend=backend)
    assert out.count(f"OK skipped step 5 ({codec}, {layer}, {float(value)})") == 2, out


@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_the_cli_trains_through_injected_faults(codec):
    """Three faulty steps (on either rank, one where both are); the run logs each skip on
    both ranks and still learns digits (the accuracy against a clean run, over seeds, is in
    benchmarks/results/reliability.md)."""
    args = ["accordion_hvd.train", "--codec", codec, "--epochs", "6", "--no-progress",
            "--inject-nonfinite", "10@1", "--inject-nonfinite", "30@0", "--inject-nonfinite", "31@1",
            "--inject-nonfinite", "31@0"]
    out = run_module(*args, np=2, backend="gloo", timeout=240)
    for step in (10, 30, 31):
        assert len(re.findall(rf"step {step} skipped on every rank", out)) == 2, out
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.85, out


def test_resume_from_a_damaged_checkpoint_stops_with_its_name(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_module("accordion_hvd.train", "--epochs", "1", "--no-progress", "--checkpoint", str(ckpt), np=2, backend="gloo")
    damaged = tmp_path / "ckpt.rank1"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    result = horovodrun(["-m", "accordion_hvd.train", "--epochs", "2", "--no-progress", "--resume", str(ckpt)],
                        np=2, backend="gloo", timeout=120)
    assert result.returncode != 0 and f"cannot read {damaged}" in result.stdout, result.stdout


@pytest.mark.parametrize("codec,backend", [("powersgd", "gloo"), ("topk", "mpi")])
def test_soak_5000_steps_with_frequent_switches(codec, backend):
    """Memory flat (under 8 MiB of RSS growth over 4,500 steps: a leak of one small tensor
    per step would exceed it), no file descriptor leak, identical floats_sent on every rank,
    a level switch every few windows."""
    out = run_worker("soak_check.py", codec, "5000", np=2, backend=backend, timeout=400)
    lines = re.findall(r"rank \d: SOAK steps=5000 switches=(\d+) rss_start_kb=(\d+) rss_end_kb=(\d+) "
                       r"fds_start=(\d+) fds_end=(\d+) floats_sent=(\d+)", out)
    assert len(lines) == 2, out
    for switches, rss_start, rss_end, fds_start, fds_end, _ in lines:
        assert int(switches) >= 100, out
        assert int(rss_end) - int(rss_start) < 8 * 1024, out
        assert fds_start == fds_end, out
    assert lines[0][5] == lines[1][5], out
