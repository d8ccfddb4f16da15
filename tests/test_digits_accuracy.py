"""PowerSGD costs (almost) no accuracy: the training CLI under horovodrun (2 ranks, Gloo)
on the digits data, with PowerSGD rank 2 and with dense allreduce, same seed and epochs;
PowerSGD's final test accuracy must be within 2 points of dense.

tests/test_horovod.py only checks each codec reaches 90% on its own; this compares against
the dense baseline of the very same run, which is what compression promises.

Settings, measured (seed 0 unless said):
* with the CLI's default --lr 0.05 (x2 ranks, momentum 0.9) the test accuracy jumps by up
  to 5 points from one epoch to the next, so the final epoch of one run is a lottery (at
  12 epochs: dense 97.8%, PowerSGD 93.9%, though its epochs 8-11 were at 97-98.6%);
* at --lr 0.02 and 20 epochs both have settled (within about 1 point over the last 5
  epochs). Over seeds 0-4 PowerSGD rank 2 is within 1.1 points of dense (seed 0: dense
  99.16%, PowerSGD 99.44%), while PowerSGD WITHOUT error feedback stays 3.1-4.5 points
  below dense (seeds 0-2; seed 0: 94.71%), so this test fails on missing error feedback.
  At 30 epochs even that catches up (97.2%), which is why not more epochs.
Both runs take 25-35 s together on the shared 2-core machine, mostly horovodrun start-up.
"""

import re

import pytest

from launch import run_module

pytestmark = [pytest.mark.horovod, pytest.mark.slow]

EPOCHS, SEED, LR = "20", "0", "0.02"


def final_accuracy(*codec_args: str) -> float:
    out = run_module("accordion_hvd.train", *codec_args, "--epochs", EPOCHS, "--seed", SEED, "--lr", LR,
                     np=2, backend="gloo", timeout=240)
    match = re.search(r"final test accuracy: ([0-9.]+) \(2 ranks, 20 epochs", out)
    assert match, out
    return float(match.group(1))


def test_powersgd_rank_2_is_within_2_points_of_dense():
    dense = final_accuracy("--codec", "none")
    powersgd = final_accuracy("--codec", "powersgd", "--rank", "2")
    assert dense >= 0.95, f"the dense baseline did not train: {dense}"
    assert powersgd >= dense - 0.02, f"PowerSGD rank 2 {powersgd:.4f} vs dense {dense:.4f}"
