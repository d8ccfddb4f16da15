"""Every relative Markdown link and every ``benchmarks/results/...`` path the repository
mentions exists (benchmarks/check_links.py): results move to results/archive/, docs move,
and a link left behind is found here, not by a reader. And every figure the README and docs/
quote beside a link to a results report is in that report, so a figure cannot drift from its
source."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from check_links import figures, missing, quoted_figures_missing  # noqa: E402


def test_no_link_or_results_path_points_at_nothing():
    broken = missing()
    assert not broken, "\n".join(broken)


def test_every_figure_beside_a_results_link_is_in_that_report():
    drifted = quoted_figures_missing()
    assert not drifted, "\n".join(drifted)


RUN = "/".join(("..", "benchmarks", "results", "run.md"))  # spelled apart: this file's links are checked too


def link(text: str, target: str) -> str:
    return f"[{text}]({target})"


def _example(tmp_path: Path, doc: str) -> list[str]:
    report = tmp_path / "benchmarks" / "results" / "run.md"
    report.parent.mkdir(parents=True)
    report.write_text("| method | time to target, mean s (x floor, x baseline) | step s |\n"
                      "|---|---|---|\n"
                      "| default | 1274 (2.92x, 0.35x) | 11.947 |\n"
                      "| dense | 1,344 steps, 0.50x | 27.93 ± 0.15 |\n")
    (tmp_path / "docs").mkdir()
    path = tmp_path / "docs" / "page.md"
    path.write_text(doc)
    return quoted_figures_missing([path], root=tmp_path)


def test_a_figure_missing_from_the_linked_report_is_named_with_its_line_and_report(tmp_path):
    doc = f"# Page\n\nThe default took 1276 s, 2.92x the floor ({link('run.md', RUN)}).\n"
    report = "/".join(("benchmarks", "results", "run.md"))
    assert _example(tmp_path, doc) == [f"docs/page.md:3: figure 1276 s not in {report}"]


def test_figures_as_the_report_writes_them_or_rounded_pass(tmp_path):
    doc = ("The default took 1274 s (2.92x the floor, 0.35x dense; 0.5x at the other rate, 1344 s, "
           f"a step 11.9 s), target 27.93 ({link('run.md', RUN + '#anchor')}).\n"
           "Not checked: 1276 s on a line with no link to a report, or one to another file "
           f"({link('page', 'page' + '.md')}); a setting in code, `Quantize(8, skip_energy=0.05)`.\n"
           f"```\n1276 s ({link('run.md', RUN)})\n```\n")
    assert _example(tmp_path, doc) == []


def test_what_counts_as_a_figure():
    line = ("0.81x dense, 1676 s, 12.0 ms, 27.93, 30.1-30.2; not: 3 seeds, 95%, torch 2.13.0, 1e-3, "
            f"evidence-v4, 100mbit, `0.77x`, {link('text', 'x/1.5' + '.md')}")
    assert [f for f, _ in figures(line)] == ["0.81x", "1676 s", "12.0 ms", "27.93", "30.1", "30.2"]
