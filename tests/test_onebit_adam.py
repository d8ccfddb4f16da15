"""``acc.OneBitAdam`` (accordion_hvd/onebit_adam.py) under real torchrun and horovodrun jobs:
step by step against a plain-torch 1-bit Adam (AdamW, and Adam with L2 decay), the defaults
training with the ranks in agreement, resume bit for bit before and after the freeze, a
non-finite gradient skipped on every rank, bad input refused on every rank
(tests/workers/onebit_adam_check.py)."""

import pytest

from launch import run_ddp_worker, run_worker


@pytest.mark.torchrun
@pytest.mark.parametrize("mode,np", [("reference", 2), ("reference", 3), ("default", 2), ("resume", 2),
                                     ("nonfinite", 2), ("bad-input", 2)])
def test_onebit_adam(mode, np):
    out = run_ddp_worker("onebit_adam_check.py", mode, np=np)
    assert out.count(f": OK {mode}") == np, out


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["reference", "bad-input"])
def test_onebit_adam_under_horovodrun(mode):
    out = run_worker("onebit_adam_check.py", mode, "horovod", np=2)
    assert out.count(f": OK {mode}") == 2, out
