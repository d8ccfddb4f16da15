"""A missing or stale compiled extension must be refused with instructions, never hidden."""

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import accordion_hvd
from accordion_hvd import _extension
from accordion_hvd._source_hash import source_hash

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(accordion_hvd.__file__).resolve().parent


# The copy gets another name: the editable install's import hook would otherwise resolve
# accordion_hvd (and its _C) to the real checkout whatever PYTHONPATH says.
COPY = "accordion_copy"


def import_from(root: Path) -> subprocess.CompletedProcess:
    """Import the copy of the package at ``root`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", f"import {COPY}"], cwd=root, text=True,
                          capture_output=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def copy_package(dst: Path, with_extension: bool) -> None:
    ignore = shutil.ignore_patterns("__pycache__", *([] if with_extension else ["_C*.so"]))
    shutil.copytree(PACKAGE, dst / COPY, ignore=ignore)


def test_missing_extension_says_how_to_build(tmp_path):
    copy_package(tmp_path, with_extension=False)
    result = import_from(tmp_path)
    assert result.returncode != 0
    assert "ImportError: accordion_hvd's compiled extension accordion_hvd._C could not be loaded" in result.stderr
    assert "make build" in result.stderr


def test_stale_extension_is_refused(tmp_path):
    copy_package(tmp_path, with_extension=True)
    shutil.copytree(REPO / "csrc", tmp_path / "csrc")
    shutil.copy(REPO / "CMakeLists.txt", tmp_path)
    assert import_from(tmp_path).returncode == 0, "an unchanged copy of the checkout must import"

    with open(tmp_path / "csrc" / "ops.cpp", "a") as fh:
        fh.write("\n// an edit that was never compiled\n")
    result = import_from(tmp_path)
    assert result.returncode != 0
    assert "accordion_hvd._C is stale: csrc/ changed since it was built" in result.stderr
    assert "make build" in result.stderr


def test_extension_built_for_another_torch_is_refused():
    fake = types.SimpleNamespace(torch_version="1.13.0", source_hash="x")
    with pytest.raises(ImportError, match=r"built against torch 1\.13\.0, but torch .* is installed"):
        _extension.check_build(fake, torch.__version__, None)


def test_installed_extension_matches_this_checkout():
    assert accordion_hvd._C.torch_version == torch.__version__
    assert accordion_hvd._C.source_hash == source_hash(REPO)


def test_source_hash_covers_kernels_and_cmake(tmp_path):
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text("project(x)")
    kernel = tmp_path / "csrc" / "cuda" / "k.cu"
    kernel.write_text("a")
    (tmp_path / "csrc" / "notes.md").write_text("not a source")
    first = source_hash(tmp_path)
    (tmp_path / "csrc" / "notes.md").write_text("changed, but not a source")
    assert source_hash(tmp_path) == first
    kernel.write_text("b")
    assert source_hash(tmp_path) != first
    assert source_hash(tmp_path / "nowhere") is None


# The build's own check (setup.py runs it after every build): an error raised in _C's C++ must
# reach Python as an exception. accordion_hvd/_build_check.py says where a build failed it.
def test_this_build_raises_its_errors():
    from accordion_hvd import _build_check

    assert _build_check.errors_raise(accordion_hvd._C.__file__) is None


def test_build_check_names_a_crash_and_a_wrong_answer():
    from accordion_hvd import _build_check

    library = accordion_hvd._C.__file__
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert _build_check.errors_raise(library, probe=crash) == \
        "the process was killed by SIGSEGV while raising an error"
    silent = "import sys, torch; torch.ops.load_library(sys.argv[1]); sys.exit('accepted k > n')"
    assert _build_check.errors_raise(library, probe=silent) == "accepted k > n"
