"""benchmarks/results_archive.py: raw results packed into deterministic archives, unpacked with
their sha256 checked, ignored by git once restored, and a real report rebuilt from a real
archive byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("results_archive", REPO / "benchmarks" / "results_archive.py")
ra = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ra)

FILES = {"a-seed0/steps.csv": b"step,loss\n1,2.5\n", "a-seed0/run.json": b'{"seed": 0}\n',
         "b-seed1/log.txt": b"done\n", "sitting.csv": b"x\n", "report.md": b"# kept\n", "plot.png": b"\x89PNG"}
KEEP = ["*.md", "*.png"]  # stay in the tree: the folder's own files of those kinds, not those of its subfolders


def make(root: Path, name: str = "demo") -> Path:
    folder = root / "benchmarks" / "results" / name
    for rel, data in FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def test_pack_is_deterministic_and_recorded(tmp_path):
    folder = make(tmp_path / "one")
    entry = ra.pack(folder, KEEP, root=tmp_path / "one")
    first = (tmp_path / "one" / entry["archive"]).read_bytes()
    # the same files elsewhere, written later, with other times and in another order: the same bytes
    other = make(tmp_path / "two")
    for path in other.rglob("*"):
        os.utime(path, (1e9, 2e9))
    assert ra.pack(other, KEEP, root=tmp_path / "two")["sha256"] == entry["sha256"]
    assert (tmp_path / "two" / entry["archive"]).read_bytes() == first
    assert ra.pack(folder, None, root=tmp_path / "one")["sha256"] == entry["sha256"]  # the index's --keep again

    index = ra.load_index(tmp_path / "one")
    assert [e["name"] for e in index["archives"]] == ["demo"]
    assert index["archives"][0]["sha256"] == hashlib.sha256(first).hexdigest()
    assert entry["kept"] == ["plot.png", "report.md"]
    assert sorted(entry["members"]) == sorted(set(FILES) - set(entry["kept"]))
    assert entry["files"] == len(entry["members"]) and entry["bytes"] == sum(len(FILES[m]) for m in entry["members"])
    assert entry["sha256"] in (tmp_path / "one" / ra.ARCHIVES / "README.md").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_restored_files_are_ignored_and_kept_files_are_not(tmp_path):
    folder = make(tmp_path)
    entry = ra.pack(folder, KEEP, root=tmp_path)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)

    def ignored(rel: str) -> bool:
        code = subprocess.run(["git", "check-ignore", "-q", f"{entry['restores']}/{rel}"], cwd=tmp_path).returncode
        assert code in (0, 1), f"git check-ignore failed ({code})"
        return code == 0

    assert all(ignored(m) for m in entry["members"])
    assert not any(ignored(k) for k in entry["kept"])
    assert not ignored("new-seed2/steps.csv")  # a run added later is not hidden: it is in no archive


def test_unpack_checks_and_restores_in_place(tmp_path):
    folder = make(tmp_path)
    entry = ra.pack(folder, KEEP, root=tmp_path)
    for member in entry["members"]:
        (folder / member).unlink()
    with pytest.raises(SystemExit, match="unpack demo first"):  # not a smaller archive of what is left
        ra.pack(folder, None, root=tmp_path)
    ra.restore(folder / "a-seed0", root=tmp_path)  # a script about to read one run
    assert {m: (folder / m).read_bytes() for m in entry["members"]} == {m: FILES[m] for m in entry["members"]}
    (folder / "sitting.csv").write_bytes(b"changed by hand\n")
    ra.restore(folder, root=tmp_path)  # everything is there: nothing is unpacked over it
    assert (folder / "sitting.csv").read_bytes() == b"changed by hand\n"
    ra.unpack(root=tmp_path)
    assert (folder / "sitting.csv").read_bytes() == FILES["sitting.csv"]

    archive = tmp_path / entry["archive"]
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    archive.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        ra.unpack(["demo"], root=tmp_path)


def test_the_committed_index_its_archives_readme_and_gitignore_agree():
    index = ra.load_index()
    archives = sorted(p.name for p in (REPO / ra.ARCHIVES).glob("*.tar.xz"))
    assert archives == sorted(f"{e['name']}.tar.xz" for e in index["archives"])
    for entry in index["archives"]:
        assert ra.sha256(REPO / entry["archive"]) == entry["sha256"], entry["name"]
        for kept in entry["kept"]:
            assert (REPO / entry["restores"] / kept).is_file(), f"{entry['name']}: {kept} is not in the tree"
    for path, text in ra.written(index).items():
        assert (REPO / path).read_text() == text, f"{path}: rerun results_archive.py pack rather than editing it"


def test_a_real_report_rebuilds_byte_for_byte_from_its_archive(capsys):
    """diagnose-accordion.md and its two figures, from the 1 MB diagnose-accordion archive, in a scratch
    copy (the tree is not touched)."""
    index = ra.load_index()
    assert ra.reports(index, ["diagnose-accordion"]), "the index lists no report built from diagnose-accordion"
    assert ra.rebuild(["diagnose-accordion"]) == 0, capsys.readouterr().out
    assert "identical" in capsys.readouterr().out
