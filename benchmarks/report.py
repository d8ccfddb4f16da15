"""What every results writer shares: the hand-written analysis at the end of a results file.

A benchmark rewrites its tables on every run; what a person wrote below them (from the
heading ``## What these numbers say`` on) is kept across reruns, so that a rerun does not
silently drop it. Reread it against the new numbers."""

from __future__ import annotations

from pathlib import Path

ANALYSIS = "## What these numbers say"
# The headings that older files gave their hand-written part, kept the same way (so that a rerun
# of their command, e.g. benchmarks/results_archive.py rebuild, gives their bytes back).
HAND_WRITTEN = (ANALYSIS, "## Reading", "## Notes (written by hand")


def kept_analysis(path: Path) -> list[str]:
    """The analysis lines of an earlier ``path``, from its heading on; none if it has none."""
    old = path.read_text().splitlines() if path.exists() else []
    starts = [i for i, line in enumerate(old) if line.startswith(HAND_WRITTEN)]
    return ["", *old[starts[0]:]] if starts else []
