"""Raw per-run results out of the source tree: one deterministic ``.tar.xz`` per finished
protocol or benchmark in ``benchmarks/results/archives/``, restored in place when needed.

    .venv/bin/python benchmarks/results_archive.py unpack [NAME...]   # check sha256, restore in place
    .venv/bin/python benchmarks/results_archive.py rebuild [NAME...]  # rerun the reports, compare bytes
    .venv/bin/python benchmarks/results_archive.py pack FOLDER... [--keep GLOB...]

Why: the per-run CSV/JSON/log files were 98% of the repository's bytes, and a finished protocol's
runs never change. Its report (``.md``), plots and summary files stay in the tree; its raw folder
becomes one archive, which ``unpack`` restores to the same paths (git-ignored), so that every
report script reads it unchanged. The scripts that read raw runs call ``restore()`` first.

``archives/index.json`` is the record: per archive the folder it restores, its sha256, its files
(``members``, which ``benchmarks/check_links.py`` also reads), the files of that folder that stay
in the tree (``kept``: those matching ``--keep``, a glob whose ``*`` stays within one folder),
and the reports built from it, with their command and whether they rebuild byte for byte
(``"rebuild"``: ``"byte-stable"`` or ``"not byte-stable: why"``, both rerun by ``rebuild``, or
``"not rebuildable: why"``). ``pack`` keeps an entry's ``reports`` (written by hand) and
rewrites ``archives/README.md`` and ``benchmarks/results/.gitignore`` from the index.

An archive is deterministic: members sorted, repository-relative names, mtime, uid, gid and
owner names zeroed, modes 0644/0755, xz preset 9: the same files give the same bytes.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks") / "results"  # below a root: the repository, or a test's folder
ARCHIVES = RESULTS / "archives"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_index(root: Path = REPO) -> dict:
    path = root / ARCHIVES / "index.json"
    return json.loads(path.read_text()) if path.exists() else {"archives": []}


def kept(rel: str, patterns: list[str]) -> bool:
    """Whether a file (its path inside the folder) stays in the tree: ``*`` does not cross a ``/``."""
    return any(rel.count("/") == p.count("/") and fnmatch.fnmatchcase(rel, p) for p in patterns)


def tar_bytes(root: Path, names: list[str]) -> bytes:
    """An uncompressed tar of ``names`` (relative to ``root``), the same bytes for the same files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(names):
            path = root / name
            info = tarfile.TarInfo(name)
            info.size = path.stat().st_size
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def pack(folder: Path, keep: list[str] | None = None, root: Path = REPO) -> dict:
    """Archive every file of ``folder`` but the kept ones as ``archives/<folder name>.tar.xz`` and
    record it in the index (the index's ``keep`` patterns when ``keep`` is None)."""
    folder = folder.resolve()
    restores = folder.relative_to(root.resolve()).as_posix()
    if not restores.startswith(RESULTS.as_posix() + "/") or restores.startswith(ARCHIVES.as_posix()):
        raise SystemExit(f"{restores}: only folders under {RESULTS}/ (not {ARCHIVES}/) are archived")
    index = load_index(root)
    old = next((e for e in index["archives"] if e["restores"] == restores), {})
    if any(e["name"] == folder.name and e["restores"] != restores for e in index["archives"]):
        raise SystemExit(f"an archive named {folder.name} restores another folder")
    keep = old.get("keep", []) if keep is None else keep
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    members = [f for f in files if not kept(f, keep)]
    gone = sorted(set(old.get("members", [])) - set(files))
    if not members or gone:  # a partly restored folder would make a smaller archive, silently
        raise SystemExit(f"{restores}: " + (f"{len(gone)} archived files missing" if gone else "no file to archive")
                         + f": unpack {folder.name} first")
    if any((folder / m).is_symlink() for m in members):
        raise SystemExit(f"{restores}: holds a symbolic link; archives hold plain files only")
    raw = tar_bytes(root, [f"{restores}/{m}" for m in members])
    archive = root / ARCHIVES / f"{folder.name}.tar.xz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9))
    entry = {"name": folder.name, "archive": archive.relative_to(root).as_posix(), "restores": restores,
             "sha256": sha256(archive), "files": len(members),
             "bytes": sum((folder / m).stat().st_size for m in members), "archive_bytes": archive.stat().st_size,
             "keep": keep, "kept": [f for f in files if kept(f, keep)], "reports": old.get("reports", []),
             "members": members}
    index["archives"] = sorted([e for e in index["archives"] if e["restores"] != restores] + [entry],
                               key=lambda e: e["name"])
    write_index(index, root)
    return entry


def ignore_lines(entry: dict) -> list[str]:
    """The fewest .gitignore lines (relative to benchmarks/results/) that cover an archive's
    files and none of the files kept in the tree: a whole folder where it holds no kept file."""
    base = "/" + entry["restores"][len(RESULTS.as_posix()) + 1:]
    if not entry["kept"]:
        return [base + "/"]
    above_kept = {k.rsplit("/", i)[0] for k in entry["kept"] for i in range(1, k.count("/") + 1)}
    lines = set()
    for member in entry["members"]:
        parts = member.split("/")
        folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
        lines.add(next((f + "/" for f in folders if f not in above_kept), member))
    return [f"{base}/{line}" for line in sorted(lines)]


def written(index: dict) -> dict[Path, str]:
    """What the index makes (relative to a root): index.json, archives/README.md and
    benchmarks/results/.gitignore."""
    ignore = ["# Written by benchmarks/results_archive.py from archives/index.json: the raw files its",
              "# archives restore here (`.venv/bin/python benchmarks/results_archive.py unpack`).", ""]
    for entry in index["archives"]:
        ignore += [f"# {entry['name']}.tar.xz", *ignore_lines(entry)]
    return {ARCHIVES / "index.json": json.dumps(index, indent=1) + "\n", ARCHIVES / "README.md": readme(index),
            RESULTS / ".gitignore": "\n".join(ignore) + "\n"}


def write_index(index: dict, root: Path = REPO) -> None:
    for path, text in written(index).items():
        (root / path).write_text(text)


def readme(index: dict) -> str:
    mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
    lines = ["# Archived raw results", "",
             "Written by `benchmarks/results_archive.py` from [index.json](index.json); rerun its `pack` rather "
             "than editing this file. Each archive holds the raw per-run files (CSV, JSON, logs) of one "
             "finished protocol or benchmark; its report, plots and summary files stay in the tree, beside the "
             "folder it restores. Unpack them all in place (each sha256 checked; the restored folders are "
             "git-ignored):", "",
             "    .venv/bin/python benchmarks/results_archive.py unpack", "",
             "or one of them without Python, from the repository's root: `tar -xJf "
             "benchmarks/results/archives/<name>.tar.xz`. The scripts that read raw runs unpack what they need "
             "themselves. Rerun every report listed below from the archives and compare it byte for byte with "
             "the committed one:", "",
             "    .venv/bin/python benchmarks/results_archive.py rebuild", "",
             "| archive | restores | files | MB unpacked | MB | stays in the tree | sha256 |",
             "|---|---|---:|---:|---:|---|---|"]
    for e in index["archives"]:
        stays = ", ".join(f"`{k}`" for k in e["keep"]) + f" ({len(e['kept'])})" if e["kept"] else "-"
        lines.append(f"| [{e['name']}]({e['name']}.tar.xz) | `{e['restores']}/` | {e['files']} | {mb(e['bytes'])} "
                     f"| {mb(e['archive_bytes'])} | {stays} | `{e['sha256']}` |")
    lines += ["", "## The reports built from them", "",
              "Each command runs from the repository's root once its archives are unpacked. *byte-stable*: "
              "`rebuild` fails when it does not give the committed bytes (figures: with the matplotlib of "
              "the project's .venv); the others it reruns and shows, or skips when they cannot be rerun.", "",
              "| report | from | command | rebuild |", "|---|---|---|---|"]
    for report, (first, names) in reports(index).items():
        rel = os.path.relpath(report, ARCHIVES.as_posix())
        link = f"[{report}]({rel})" if "*" not in report else f"`{report}`"
        command = f"`{first['command']}`" if first.get("command") else "-"
        lines.append(f"| {link} | {', '.join(names)} | {command} | {first['rebuild']} |")
    return "\n".join(lines) + "\n"


def reports(index: dict, names: list[str] | None = None) -> dict[str, tuple[dict, list[str]]]:
    """Each report (of the named archives, or of all): its entry, and every archive it is built from."""
    out: dict[str, tuple[dict, list[str]]] = {}
    for entry in index["archives"]:
        for report in entry["reports"]:
            out.setdefault(report["report"], (report, []))[1].append(entry["name"])
    return {r: v for r, v in out.items() if names is None or set(v[1]) & set(names)}


def unpack_entry(entry: dict, root: Path = REPO, into: Path | None = None) -> None:
    """Check an archive's sha256 and members, then extract it under ``into`` (default: ``root``)."""
    archive = root / entry["archive"]
    if sha256(archive) != entry["sha256"]:
        raise SystemExit(f"{entry['archive']}: sha256 is not the index's {entry['sha256']}; not unpacked")
    with tarfile.open(archive, mode="r:xz") as tar:
        names = tar.getnames()
        if names != [f"{entry['restores']}/{m}" for m in entry["members"]]:
            raise SystemExit(f"{entry['archive']}: its files are not the index's; not unpacked")
        tar.extractall(into or root, filter="data")  # refuses absolute paths, '..' and links out


def select(index: dict, names: list[str] | None) -> list[dict]:
    known = {e["name"]: e for e in index["archives"]}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise SystemExit(f"no archive named {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names] if names else index["archives"]


def unpack(names: list[str] | None = None, root: Path = REPO) -> None:
    for entry in select(load_index(root), names):
        unpack_entry(entry, root)
        print(f"{entry['restores']}/: {entry['files']} files from {entry['archive']} (sha256 checked)")


def restore(folder: Path | str, root: Path = REPO) -> None:
    """What a script calls before it reads raw runs under ``folder``: unpack in place the archives
    that restore into it (or above it) when a file of theirs is missing. Idempotent; a no-op for a
    folder that no archive restores."""
    folder = Path(folder).resolve()
    for entry in load_index(root)["archives"]:
        where = (root / entry["restores"]).resolve()
        overlaps = folder == where or where in folder.parents or folder in where.parents
        if overlaps and not all((where / m).is_file() for m in entry["members"]):
            unpack_entry(entry, root)
            print(f"restored {entry['restores']}/ from {entry['archive']}", file=sys.stderr)


def rebuild(names: list[str] | None = None, root: Path = REPO) -> int:
    """Rerun each report command in a scratch copy of benchmarks/ with its archives unpacked there,
    and compare every file it wrote under benchmarks/results/ with the tree's. 1 if a byte-stable
    report differs or a command fails."""
    index = load_index(root)
    chosen = reports(index, [e["name"] for e in select(index, names)])
    needed = {n for _, archive_names in chosen.values() for n in archive_names}
    members = {f"{e['restores']}/{m}" for e in index["archives"] for m in e["members"]}
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="results-rebuild-") as tmp:
        scratch = Path(tmp)
        shutil.copytree(root / "benchmarks", scratch / "benchmarks", symlinks=True,
                        ignore=shutil.ignore_patterns("archives", "__pycache__"))
        if (root / "accordion_hvd").exists():  # the package (and its built extension), for scripts that import it
            (scratch / "accordion_hvd").symlink_to(root / "accordion_hvd")
        for entry in index["archives"]:
            if entry["name"] in needed:
                unpack_entry(entry, root, into=scratch)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        for report, (spec, _) in chosen.items():
            if spec["rebuild"].startswith("not rebuildable"):
                rows.append((report, "skipped", spec["rebuild"]))
                continue
            argv = shlex.split(spec["command"])
            argv[0] = sys.executable if argv[0].endswith("python") else argv[0]  # this interpreter, not a path
            done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
            changed = []
            for path in sorted((scratch / RESULTS).rglob("*")):
                rel = path.relative_to(scratch).as_posix()
                if not path.is_file() or rel in members or rel.startswith(ARCHIVES.as_posix() + "/"):
                    continue
                original = root / rel
                if not original.is_file() or original.read_bytes() != path.read_bytes():
                    changed.append(rel)
                    # back to the tree's bytes, so that the next command starts from them
                    shutil.copy2(original, path) if original.is_file() else path.unlink()
            stable = spec["rebuild"] == "byte-stable"
            if done.returncode:
                result = f"FAILED (exit {done.returncode}): {done.stderr.strip()[-300:]}"
            elif changed:
                result = ("DIFFERS" if stable else "differs (expected)") + ": " + ", ".join(changed)
            else:
                result = "identical"
            failed |= bool(done.returncode) or (stable and bool(changed))
            rows.append((report, result, spec["rebuild"]))
    width = max((len(r[0]) for r in rows), default=6)
    print(f"{'report':{width}}  result  [rebuild]")
    for report, result, note in rows:
        print(f"{report:{width}}  {result}" + ("" if note == "byte-stable" else f"  [{note}]"))
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    packing = sub.add_parser("pack", help="archive raw folders and record them in the index")
    packing.add_argument("folders", nargs="+", type=Path)
    packing.add_argument("--keep", nargs="*", default=None,
                         help="files of the folder that stay in the tree (globs inside it; default: the index's)")
    for name, what in (("unpack", "check and restore in place"), ("rebuild", "rerun and compare the reports")):
        sub.add_parser(name, help=what).add_argument("names", nargs="*", help="archive names (default: all)")
    args = p.parse_args()
    if args.what == "pack":
        for folder in args.folders:
            entry = pack(folder, args.keep)
            print(f"{entry['archive']}: {entry['files']} files, {entry['bytes'] / 1e6:.1f} MB -> "
                  f"{entry['archive_bytes'] / 1e6:.1f} MB, sha256 {entry['sha256']}")
        return 0
    if args.what == "unpack":
        unpack(args.names or None)
        return 0
    return rebuild(args.names or None)


if __name__ == "__main__":
    sys.exit(main())
