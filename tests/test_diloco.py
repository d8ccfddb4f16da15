"""``acc.DiLoCo`` (accordion_hvd/periodic/diloco.py) under real torchrun jobs, 2 and 3 ranks: round by
round against a plain-torch DiLoCo (and, overlapped, one round late), with Quantize's error feedback, as local SGD, a
non-finite round skipped on every rank, resume bit for bit, bad input refused on every rank,
a rank that dies in a round (tests/workers/diloco_check.py, diloco_overlap_check.py,
diloco_dead_rank_check.py)."""

import re
import time

import pytest

from launch import WORKERS, run_ddp_worker, run_worker, torchrun


@pytest.mark.torchrun
@pytest.mark.parametrize("np", [2, 3])
def test_rounds_match_plain_diloco_through_a_lossless_codec(np):
    out = run_ddp_worker("diloco_check.py", "lossless", np=np)
    assert out.count(": OK lossless") == np, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["quantize", "local-sgd", "nonfinite", "nonfinite-momentum", "resume", "bad-input",
                                  "auto"])
def test_diloco(mode):
    out = run_ddp_worker("diloco_check.py", mode, np=2)
    assert out.count(f": OK {mode}") == 2, out


@pytest.mark.horovod
@pytest.mark.parametrize("mode,np", [("lossless", 2), ("lossless", 3), ("auto", 2), ("nonfinite", 2)])
def test_diloco_under_horovodrun(mode, np):
    """The same checks under horovodrun: DiLoCo on the compressor's default planes over
    Horovod's world (no torch.distributed)."""
    out = run_worker("diloco_check.py", mode, "horovod", np=np)
    assert out.count(f": OK {mode}") == np, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["lossless", "overlap", "nonfinite", "bad-input"])
def test_diloco_across_the_nodes_of_hsdp(mode):
    """DiLoCo over FSDP2's HSDP (4 ranks, 2 nodes of 2): the shards in step inside a node every
    inner step, a round across the nodes, against a plain-torch DiLoCo of the whole model
    (tests/workers/diloco_hsdp_check.py)."""
    out = run_ddp_worker("diloco_hsdp_check.py", mode, np=4, timeout=300)
    assert out.count(f": OK {mode}") == 4, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode,np", [("lossless", 2), ("lossless", 3), ("auto", 2), ("auto-reset", 2), ("nonfinite", 2),
                                     ("resume", 2)])
def test_overlapped_rounds_match_plain_overlapped_diloco(mode, np):
    """``overlap=True``: each round lands one round late, step by step against a plain-torch
    overlapped DiLoCo (tests/workers/diloco_overlap_check.py)."""
    out = run_ddp_worker("diloco_overlap_check.py", mode, np=np)
    assert out.count(f": OK {mode}") == np, out


@pytest.mark.horovod
def test_overlapped_rounds_under_horovodrun():
    out = run_worker("diloco_overlap_check.py", "lossless", "horovod", np=2)
    assert out.count(": OK lossless") == 2, out


@pytest.mark.torchrun
@pytest.mark.parametrize("overlap", [False, True])
def test_a_rank_that_dies_during_a_round_stops_the_other_naming_it(overlap):
    """Rank 1 exits before a round (without overlap: at the round of inner step 6; with it,
    after step 4, the round of step 3 in flight: rank 0 lands it at step 6, if it got through
    before rank 1 died, and then waits at step 9 for the round of step 6): the job must end,
    not hang, within the collective timeout (20 s here), the dead rank named
    (tests/workers/diloco_dead_rank_check.py)."""
    started = time.monotonic()
    args = ["4", "overlap"] if overlap else ["6"]
    result = torchrun([str(WORKERS / "diloco_dead_rank_check.py"), *args], np=2, timeout=240,
                      env={"ACCORDION_COLLECTIVE_TIMEOUT": "20"})
    elapsed, out = time.monotonic() - started, result.stdout
    assert result.returncode != 0, out
    assert "rank 1: dying after inner step" in out and "FINISHED" not in out, out
    never = "rank 0: round 3 done" if overlap else "rank 0: round 2 done"
    assert never not in out, out  # rank 0 never got past the round it waited in
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", out) and "exitcode  : 17" in out, out
    assert elapsed < 20 + 60, f"the job took {elapsed:.0f} s to end after a rank died"
