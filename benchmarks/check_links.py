"""Every relative link in the repository's Markdown, and every ``benchmarks/results/...`` path
its Markdown and Python mention, checked to exist (stdlib only, reads text, runs in a second).

    python benchmarks/check_links.py            # prints each missing target and each figure a linked
                                                # report does not hold; exit status 1 if any

What it reads: every ``*.md`` and ``*.py`` under the repository root (not ``.git``, ``build``,
hidden folders or virtual environments).

* Markdown links ``[text](target)`` in ``*.md`` files (outside fenced code blocks): a target
  that is not a URL is resolved against the file's folder; a ``#anchor`` into a ``.md`` file
  (or into the same file) must name one of its headings (GitHub's slugs) or an ``<a id=...>``.
* The same links in ``*.py`` files, where their target names a ``.md`` file: these are mostly
  report writers' text, relative to the report they write, so the target is resolved against
  the file's folder or ``benchmarks/results/``, where the reports go (anchors not checked).
* ``benchmarks/results/...`` written anywhere in those files (prose, commands, docstrings,
  comments): resolved against the repository root. Not checked: a path with a placeholder in
  it (``<name>``, ``*``, ``{x}``, ``[...]`` or an upper-case word such as ``TASK`` or
  ``seedS``) past the folder that holds the placeholder; the argument of ``--out`` (a file a
  command writes, as recorded when it ran); a path under a folder the repository's
  ``.gitignore`` names by name (``runs/``: written by a run, never committed). Such a path may
  also name a file or folder that an archive restores (raw runs are archived, their files listed
  in ``benchmarks/results/archives/index.json``). A Markdown link, which a reader follows, must
  resolve in the tree itself.

And one check of what the prose says, not only where it points (``quoted_figures_missing``):

* In ``README.md`` and ``docs/*.md`` (outside fenced code blocks), every **figure** on a line
  that links to a results report (a relative link to a ``.md`` file under
  ``benchmarks/results/``) must be found in one of the reports that line links to, so that a
  figure cannot drift from the file quoted beside it. A figure is a number with a ratio or time
  suffix (``0.81x``, ``1676 s``, ``12.0 ms``, ``30 min``) or any number with a decimal point
  (``27.93``); whole numbers without a unit (seeds, rounds, steps), percentages (mostly
  settings here: TopK 1%, 95% of the energy), versions (``2.13.0``), numbers in scientific
  notation and anything inside `inline code` or a link's target are not figures. It is found
  when the report holds the same number (the unit is the prose's: a report's tables give
  seconds and ratios in columns), ignoring thousands separators and trailing zeros
  (``1,344`` = ``1344``, ``0.50`` = ``0.5``), or a number with more decimals that rounds to it
  (``11.947`` for ``11.9``). A figure computed from a report's figures, or read from its raw
  runs, belongs on a line that says so and does not link the report as its source.
"""

from __future__ import annotations

import decimal
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SKIP_DIRS = {"build", "dist", "node_modules", "__pycache__", "venv"}  # and every hidden folder

LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
RESULTS_PATH = re.compile(r"(--out[ =])?(benchmarks/results/[^\s`'\"()|,;]*)")
PLACEHOLDER = re.compile(r"[<*{\[]")
PLACEHOLDER_WORD = re.compile(r"\b[A-Z]{3,}\b|seed[A-Z]\b|fold[A-Z]\b")  # TASK, seedS; not in a file name
URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
ANCHOR_TAG = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def files() -> list[Path]:
    out = []
    for path in sorted(REPO.rglob("*")):
        parts = path.relative_to(REPO).parts[:-1]
        if any(part in SKIP_DIRS or part.startswith(".") for part in parts):
            continue
        if path.suffix in (".md", ".py") and path.is_file():
            out.append(path)
    return out


def ignored_names() -> set[str]:
    """Folder names the .gitignore ignores wherever they are (lines such as ``runs/``)."""
    gitignore = REPO / ".gitignore"
    names = set()
    for line in gitignore.read_text().splitlines() if gitignore.exists() else []:
        line = line.strip()
        if line.endswith("/") and "/" not in line[:-1] and not line.startswith(("#", "!")) \
                and not any(c in line for c in "*?["):
            names.add(line[:-1])
    return names


def archived() -> set[str]:
    """Every file that an archive restores, and every folder above one, relative to the repository."""
    index = RESULTS / "archives" / "index.json"
    found = set()
    for entry in json.loads(index.read_text())["archives"] if index.exists() else []:
        for member in entry["members"]:
            parts = f"{entry['restores']}/{member}".split("/")
            found.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def outside_code_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines not inside a ``` fenced block."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


ANCHORS: dict[Path, set[str]] = {}


def anchors(path: Path) -> set[str]:
    if path not in ANCHORS:
        found, seen = set(), {}
        for _, line in outside_code_fences(path.read_text(encoding="utf-8")):
            found.update(ANCHOR_TAG.findall(line))
            match = HEADING.match(line)
            if match:
                base = slug(match.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        ANCHORS[path] = found
    return ANCHORS[path]


def link_targets(path: Path, text: str) -> list[tuple[int, str]]:
    lines = outside_code_fences(text) if path.suffix == ".md" else list(enumerate(text.splitlines(), 1))
    found = []
    for number, line in lines:
        line = re.sub(r"`[^`]*`", lambda m: m.group(0) if "](" not in m.group(0) else "", line) \
            if path.suffix == ".md" else line
        for match in LINK.finditer(line):
            target = match.group(1)
            if URL.match(target):
                continue
            if path.suffix == ".py" and ".md" not in target:
                continue  # code such as d[k](x), not a link
            found.append((number, target))
    return found


def results_paths(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in RESULTS_PATH.finditer(line):
            if match.group(1):
                continue  # --out PATH: what a command writes, as recorded when it ran
            mention = match.group(2).split("](")[0].split("#")[0]
            found.append((number, mention.rstrip(".:]")))
    return found


def exists(base: Path, target: str, ignored: set[str], archived: set[str] = frozenset()) -> bool:
    def there(path: str) -> bool:  # in the tree, or in an archive (``archived`` is repository-relative)
        return (base / path).exists() or path.rstrip("/") in archived

    if there(target):
        return True
    parts = target.split("/")
    for i, part in enumerate(parts):
        if PLACEHOLDER.search(part) or ("." not in part and PLACEHOLDER_WORD.search(part)):
            # checked up to the folder that holds the placeholder
            return there("/".join(parts[:i]))
    return any(part in ignored for part in parts[:-1]) or (target.endswith("/") and parts[-2] in ignored)


def check_link(path: Path, target: str, ignored: set[str]) -> str | None:
    """What is wrong with a link from ``path`` to ``target``, or None."""
    where, _, anchor = target.partition("#")
    if path.suffix == ".py":
        bases = (path.parent, RESULTS)
        return None if any(exists(b, where, ignored) for b in bases if where) else "missing"
    if where and not exists(path.parent, where, ignored):
        return "missing"
    into = (path.parent / where) if where else path
    if anchor and into.suffix == ".md" and into.is_file() and anchor not in anchors(into.resolve()):
        return "no such heading"
    return None


def missing() -> list[str]:
    out, ignored, in_archives = [], ignored_names(), archived()
    for path in files():
        rel = path.relative_to(REPO)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, target in link_targets(path, text):
            problem = check_link(path, target, ignored)
            if problem:
                out.append(f"{rel}:{number}: link {target} ({problem})")
        for number, mention in results_paths(text):
            if not exists(REPO, mention, ignored, in_archives):
                out.append(f"{rel}:{number}: path {mention} (missing)")
    return out


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
UNIT = re.compile(r"x(?![\w])|\s?(?:s|ms|min)(?![\w/])")
INLINE_CODE = re.compile(r"`[^`]*`")


def _plain(number: str) -> str:
    """``1,344`` -> ``1344`` (a comma between digits groups thousands)."""
    return number.replace(",", "")


def figures(line: str) -> list[tuple[str, str]]:
    """(figure as written, its number) for each figure on a line of prose (see the module's doc)."""
    text = INLINE_CODE.sub(" ", line)
    text = LINK.sub(lambda m: m.group(0)[:m.group(0).rindex("](")] + "]", text)  # a link's text only
    text = re.sub(r"<[^>]+>", " ", text)
    out = []
    for match in NUMBER.finditer(text):
        number = match.group(0).rstrip(",")
        start, end = match.start(), match.start() + len(number)
        if re.search(r",\d(?!\d\d)|,\d{4}", number):
            continue  # "1,2" or "3,4567": a list of numbers, not one
        before = text[start - 1] if start else " "
        if before.isalnum() or before in "._/" or \
                (before == "-" and start > 1 and (text[start - 2].isalpha() or text[start - 2] in "_-")):
            continue  # v4, sm_80, 1.2.3, evidence-v2, a path
        rest = text[end:]
        if re.match(r"\.\d|[eE][+-]?\d", rest):
            continue  # a version (2.13.0) or 1e-3
        unit = UNIT.match(rest)
        if unit is None and re.match(r"[A-Za-z_]", rest):
            continue  # 100mbit, 2nd, 16k: a name, not a figure
        if unit or "." in number:
            out.append((number + (unit.group(0) if unit else ""), number))
    return out


def _decimals(number: str) -> int:
    return len(number.partition(".")[2])


REPORT_NUMBERS: dict[Path, set[str]] = {}


def report_numbers(path: Path) -> set[str]:
    """Every number a report writes, thousands separators dropped."""
    if path not in REPORT_NUMBERS:
        text = path.read_text(encoding="utf-8")
        REPORT_NUMBERS[path] = {_plain(m.group(0).rstrip(",")) for m in NUMBER.finditer(text)}
    return REPORT_NUMBERS[path]


def found(number: str, numbers: set[str]) -> bool:
    """Whether a figure's number is among a report's: the same, the same value (trailing zeros),
    or a number with more decimals that rounds to it."""
    number = _plain(number)
    if number in numbers:
        return True
    want, places = decimal.Decimal(number), _decimals(number)
    quantum = decimal.Decimal(1).scaleb(-places)
    for other in numbers:
        try:
            value = decimal.Decimal(other)
        except decimal.InvalidOperation:
            continue
        if value == want or (_decimals(other) > places and
                             value.quantize(quantum, rounding=decimal.ROUND_HALF_UP) == want):
            return True
    return False


def report_links(path: Path, line: str, results: Path = RESULTS) -> list[Path]:
    """The results reports (``.md`` under ``results``) a line of ``path`` links to."""
    out = []
    for match in LINK.finditer(INLINE_CODE.sub(lambda m: m.group(0) if "](" in m.group(0) else "", line)):
        target = match.group(1).partition("#")[0]
        if URL.match(target) or not target.endswith(".md"):
            continue
        report = (path.parent / target).resolve()
        if report.is_file() and report.is_relative_to(results.resolve()) and report not in out:
            out.append(report)
    return out


def prose_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def quoted_figures_missing(paths: list[Path] | None = None, root: Path = REPO) -> list[str]:
    """``file:line: figure F not in REPORT`` for each figure on a line that links to results
    reports and that none of them holds (README.md and docs/*.md unless ``paths`` are given)."""
    results = root / "benchmarks" / "results"
    out = []
    for path in paths if paths is not None else prose_files(root):
        if not path.is_file():
            continue
        for number, line in outside_code_fences(path.read_text(encoding="utf-8")):
            reports = report_links(path, line, results)
            if not reports:
                continue
            numbers = set().union(*(report_numbers(r) for r in reports))
            for figure, value in figures(line):
                if not found(value, numbers):
                    linked = ", ".join(str(Path("benchmarks", "results", r.relative_to(results.resolve())))
                                       for r in reports)
                    out.append(f"{path.relative_to(root)}:{number}: figure {figure} not in {linked}")
    return out


def main() -> int:
    broken, drifted = missing(), quoted_figures_missing()
    for line in broken + drifted:
        print(line)
    print(f"{len(broken)} broken" if broken else "no broken links or results paths")
    print(f"{len(drifted)} figures not in the report linked beside them" if drifted else
          "every figure beside a link to a results report is in that report")
    return 1 if broken or drifted else 0


if __name__ == "__main__":
    sys.exit(main())
