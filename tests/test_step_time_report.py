"""benchmarks/step_time.py's tables (no runs): a sitting of peers alone has no ours-against-peer
table; a sitting with a pair has one row per pair, its ratio taken within each round."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import step_time  # noqa: E402


def test_a_sitting_of_peers_alone_has_no_ours_against_peer_table():
    lines = step_time.section({"floor": [0.3, 0.2], "localsgd-p4": [0.6, None]}, ["floor", "localsgd-p4"])
    assert not any(line.startswith("| ours | peer |") for line in lines)
    assert "| localsgd-p4 | 0.600 (0.600-0.600) | +0.300 (+0.300-+0.300) | 2.000 (2.000-2.000)x | 1 |" in lines


def test_a_pair_is_compared_within_each_round():
    step = {"floor": [0.2, 0.2], "ddp-fp16": [0.5, 1.0], "hvd-fp16": [0.4, 1.2]}
    lines = step_time.section(step, ["floor", "ddp-fp16", "hvd-fp16"])
    assert "| ours | peer | ours / peer, median (range) over rounds | rounds where ours was faster |" in lines
    assert "| hvd-fp16 | ddp-fp16 | 1.000 (0.800-1.200)x | 1 of 2 |" in lines
