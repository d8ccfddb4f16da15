"""Every relative Markdown link and every ``benchmarks/results/...`` path the repository
mentions exists (benchmarks/check_links.py): results move to results/archive/, docs move,
and a link left behind is found here, not by a reader."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from check_links import missing  # noqa: E402


def test_no_link_or_results_path_points_at_nothing():
    broken = missing()
    assert not broken, "\n".join(broken)
