"""Set-up and build failures end in one line that says what is missing, not a long log."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(cmd, **kwargs):
    return subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=120, **kwargs)


def diagnose(tmp_path, log_text):
    log = tmp_path / "step.log"
    log.write_text(log_text)
    return run(["bash", "-c", f"ACC_LOG_DIR={tmp_path} source scripts/lib.sh && diagnose_log {log}"]).stdout.strip()


@pytest.mark.parametrize("log,cause", [
    ("WARNING: Retrying ... NewConnectionError('<pip._vendor...>: Failed to establish a new connection: "
     "[Errno -3] Temporary failure in name resolution')\nERROR: No matching distribution found for horovod==0.28.1",
     "no network: the package index could not be reached"),
    ("Err:1 http://deb.debian.org/debian bookworm InRelease\n  Could not resolve host: deb.debian.org",
     "no network: the package index could not be reached"),
    ("CMake Error at CMakeLists.txt:3 (project):\n  No CMAKE_CXX_COMPILER could be found.",
     "no C++ compiler found (install g++, e.g. apt-get install g++)"),
    ("error: command 'g++' failed: No such file or directory",
     "no C++ compiler found (install g++, e.g. apt-get install g++)"),
    ("OSError: [Errno 28] No space left on device", "the disk is full"),
    ("some other failure", ""),
])
def test_logs_are_diagnosed_in_one_line(tmp_path, log, cause):
    assert diagnose(tmp_path, log) == cause


def test_setup_without_a_compiler_says_so(tmp_path):
    # A PATH with the shell tools and Python that setup.sh needs, but no C++ compiler.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "realpath", "id", "cat", "sha256sum", "cut"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    os.symlink(sys.executable, bin_dir / "python3")
    result = run(["bash", "scripts/setup.sh"],
                 env={"PATH": str(bin_dir), "HOME": str(tmp_path), "ACC_LOG_DIR": str(tmp_path / "logs")})
    assert result.returncode == 1
    assert result.stderr.strip() == "setup error: no C++ compiler found: install g++ (apt-get install g++)"


def test_extension_build_without_a_compiler_says_so(tmp_path):
    result = run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "t"),
                  "--build-lib", str(tmp_path / "l")],
                 env={**os.environ, "CXX": str(tmp_path / "no-such-g++")})
    assert result.returncode != 0
    assert "error: no C++ compiler found (looked for $CXX, c++, g++): install g++" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


def can_cut_network() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-n", "true"]).returncode == 0


@pytest.mark.skipif(not can_cut_network(), reason="cannot make a network namespace here (unshare -n needs root)")
def test_horovod_build_without_network_says_so(tmp_path):
    # In a new network namespace nothing is reachable; with an empty cache the script must
    # download the sdist, and must say plainly that the network is the problem.
    env = {**os.environ, "ACCORDION_CACHE": str(tmp_path / "cache"), "ACC_LOG_DIR": str(tmp_path / "logs"),
           "PY": sys.executable, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}
    result = run(["unshare", "-n", "bash", "scripts/build_horovod.sh"], env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("setup error: downloading the Horovod 0.28.1 sdist failed: no network"), result.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the venv's Python in build_horovod.sh's decisions: torch's version and CUDA,
# and where the nvidia-nccl wheel lives (FAKE_NCCL_DIR, or not installed).
case "$*" in
  *"import sys, torch"*) echo "2.13.0+cu128 $FAKE_TORCH_CUDA cp311" ;;
  *nvidia.nccl*) [ -n "${FAKE_NCCL_DIR:-}" ] && echo "$FAKE_NCCL_DIR" || exit 1 ;;
  *) exit 3 ;;
esac
"""


def plan(tmp_path, torch_cuda="12.8", nccl=True, **env):
    """What build_horovod.sh would build, from a stand-in Python (nothing is built)."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    wheel = tmp_path / "nvidia" / "nccl"
    if nccl:
        (wheel / "include").mkdir(parents=True)
        (wheel / "lib").mkdir()
        (wheel / "include" / "nccl.h").write_text("")
        (wheel / "lib" / "libnccl.so.2").write_text("")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ACCORDION_HOROVOD"))}
    full.update(PY=str(python), FAKE_TORCH_CUDA=torch_cuda, FAKE_NCCL_DIR=str(wheel) if nccl else "",
                ACCORDION_HOROVOD_PLAN_ONLY="1", ACCORDION_NCCL_LINK_DIR=str(tmp_path / "link"), **env)
    result = run(["bash", "scripts/build_horovod.sh"], env=full)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_cuda_torch_with_the_nccl_wheel_builds_nccl_operations(tmp_path):
    line = plan(tmp_path)
    assert f"flavour=cu12.8-nccl gpu_operations=NCCL nccl_include={tmp_path}/nvidia/nccl/include" in line, line
    link = tmp_path / "link" / "libnccl.so"  # Horovod's FindNCCL wants libnccl.so; the wheel has .so.2
    assert f"nccl_lib={tmp_path / 'link'}" in line and os.readlink(link).endswith("lib/libnccl.so.2")


@pytest.mark.parametrize("case,kwargs,expected", [
    ("cpu-torch", {"torch_cuda": "cpu"}, "plan: flavour=cpu gpu_operations=none"),
    ("no-nccl", {"nccl": False}, "plan: flavour=cpu gpu_operations=none"),
    ("nccl-off", {"ACCORDION_HOROVOD_NCCL": "off"}, "plan: flavour=cpu gpu_operations=none"),
])
def test_without_cuda_or_nccl_horovod_is_built_without_gpu_operations(tmp_path, case, kwargs, expected):
    assert plan(tmp_path, **kwargs).startswith(expected)


def test_an_nccl_home_is_used_as_given(tmp_path):
    line = plan(tmp_path, nccl=False, HOROVOD_NCCL_HOME="/opt/nccl")
    assert line.startswith("plan: flavour=cu12.8-nccl gpu_operations=NCCL nccl_include=/opt/nccl"), line
