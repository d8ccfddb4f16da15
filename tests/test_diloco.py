"""``acc.DiLoCo`` (accordion_hvd/diloco.py) under real torchrun jobs, 2 and 3 ranks: round by
round against a plain-torch DiLoCo (and, overlapped, one round late), with Quantize's error feedback, as local SGD, a
non-finite round skipped on every rank, resume bit for bit, bad input refused on every rank
(tests/workers/diloco_check.py, diloco_overlap_check.py)."""

import pytest

from launch import run_ddp_worker, run_worker


@pytest.mark.torchrun
@pytest.mark.parametrize("np", [2, 3])
def test_rounds_match_plain_diloco_through_a_lossless_codec(np):
    out = run_ddp_worker("diloco_check.py", "lossless", np=np)
    assert out.count(": OK lossless") == np, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["quantize", "local-sgd", "nonfinite", "resume", "bad-input", "auto"])
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
@pytest.mark.parametrize("mode", ["lossless", "overlap", "bad-input"])
def test_diloco_across_the_nodes_of_hsdp(mode):
    """DiLoCo over FSDP2's HSDP (4 ranks, 2 nodes of 2): the shards in step inside a node every
    inner step, a round across the nodes, against a plain-torch DiLoCo of the whole model
    (tests/workers/diloco_hsdp_check.py)."""
    out = run_ddp_worker("diloco_hsdp_check.py", mode, np=4, timeout=300)
    assert out.count(f": OK {mode}") == 4, out


@pytest.mark.torchrun
@pytest.mark.parametrize("mode,np", [("lossless", 2), ("lossless", 3), ("auto", 2), ("nonfinite", 2), ("resume", 2)])
def test_overlapped_rounds_match_plain_overlapped_diloco(mode, np):
    """``overlap=True``: each round lands one round late, step by step against a plain-torch
    overlapped DiLoCo (tests/workers/diloco_overlap_check.py)."""
    out = run_ddp_worker("diloco_overlap_check.py", mode, np=np)
    assert out.count(f": OK {mode}") == np, out


@pytest.mark.horovod
def test_overlapped_rounds_under_horovodrun():
    out = run_worker("diloco_overlap_check.py", "lossless", "horovod", np=2)
    assert out.count(": OK lossless") == 2, out
