"""Where the test suite's time goes, and how two runs of it compare (issue 46's suite-time bar).

Reads the output of ``pytest -q -ra --durations=0 --durations-min=0 tests`` (each test's
setup, call and teardown) from one run, or from two runs made one after the other on the
same machine (an older commit's suite, then this one's: this VM's speed moves by tens of
percent from day to day, so only runs of one sitting compare):

    python benchmarks/suite_time.py /tmp/suite-head.txt
    python benchmarks/suite_time.py /tmp/suite-base.txt /tmp/suite-head.txt

Prints the result line and wall time of each run, the time per file, and for two runs the
tests found in both (by id) against each other, with what was added and removed.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S.*)$")
_RESULT = re.compile(r"^=* ?(\d+ (?:passed|failed).*?) in ([0-9.]+)s")


def read(path: Path) -> tuple[dict[str, float], str, float]:
    """{test id: seconds (setup + call + teardown)}, the result line, its seconds."""
    per_test: dict[str, float] = collections.defaultdict(float)
    result, seconds = "", 0.0
    for line in path.read_text().splitlines():
        if m := _DURATION.match(line):
            per_test[m.group(3).strip()] += float(m.group(1))
        elif m := _RESULT.match(line):
            result, seconds = m.group(1), float(m.group(2))
    if not per_test:
        raise SystemExit(f"{path}: no durations (run pytest with --durations=0 --durations-min=0)")
    return dict(per_test), result, seconds


def by_file(per_test: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = collections.defaultdict(float)
    for test, seconds in per_test.items():
        files[test.split("::")[0]] += seconds
    return dict(files)


def minutes(seconds: float) -> str:
    return f"{seconds:7.1f} s ({seconds / 60:4.1f} min)"


def report_one(name: str, per_test: dict[str, float], result: str, seconds: float) -> None:
    print(f"{name}: {result}; pytest's {minutes(seconds)}; {len(per_test)} tests timed, "
          f"{minutes(sum(per_test.values()))} summed")


def compare(base: dict[str, float], head: dict[str, float]) -> None:
    common = sorted(set(base) & set(head))
    added, removed = sorted(set(head) - set(base)), sorted(set(base) - set(head))
    b, h = sum(base[t] for t in common), sum(head[t] for t in common)
    print(f"\ntests in both runs: {len(common)}: {minutes(b)} then {minutes(h)} ({h / b:.2f}x)")
    print(f"only in the first: {len(removed)} ({minutes(sum(base[t] for t in removed))})")
    print(f"only in the second: {len(added)} ({minutes(sum(head[t] for t in added))})")
    files = sorted({t.split("::")[0] for t in base} | {t.split("::")[0] for t in head})
    print("\nper file (seconds): first run, second run, of which tests only in the second")
    rows = []
    for f in files:
        first = sum(s for t, s in base.items() if t.startswith(f + "::"))
        second = sum(s for t, s in head.items() if t.startswith(f + "::"))
        new = sum(head[t] for t in added if t.startswith(f + "::"))
        rows.append((second - first, f, first, second, new))
    for _, f, first, second, new in sorted(rows, key=lambda r: -max(r[2], r[3])):
        if max(first, second) >= 1.0:
            print(f"  {first:7.1f} {second:7.1f} {new:7.1f}  {f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="one or two pytest outputs (the older commit's first)")
    args = p.parse_args()
    if len(args.runs) > 2:
        p.error(f"runs: one or two files, got {len(args.runs)}")
    read_runs = [read(path) for path in args.runs]
    for path, (per_test, result, seconds) in zip(args.runs, read_runs):
        report_one(path.name, per_test, result, seconds)
    if len(read_runs) == 2:
        compare(read_runs[0][0], read_runs[1][0])
    else:
        print("\nper file (seconds)")
        for f, s in sorted(by_file(read_runs[0][0]).items(), key=lambda kv: -kv[1]):
            if s >= 1.0:
                print(f"  {s:7.1f}  {f}")


if __name__ == "__main__":
    main()
