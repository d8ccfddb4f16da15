"""Every relative link in the repository's Markdown, and every ``benchmarks/results/...`` path
its Markdown and Python mention, checked to exist (stdlib only, reads text, runs in a second).

    python benchmarks/check_links.py            # prints each missing target; exit status 1 if any

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
"""

from __future__ import annotations

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


def main() -> int:
    broken = missing()
    for line in broken:
        print(line)
    print(f"{len(broken)} broken" if broken else "no broken links or results paths")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
