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
