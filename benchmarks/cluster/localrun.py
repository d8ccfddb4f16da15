"""Run ``horovodrun`` (Gloo or MPI) or ``torchrun`` on this machine, never hanging: for the
tests (tests/launch.py) and the benchmarks that launch local jobs (reliability.py).

Every launch has a timeout; on expiry the whole process group (the launcher, mpirun and the
workers) is killed and an AssertionError carries the output so far.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BIN = Path(sys.executable).parent

# Open MPI refuses to run as root without the first; several ranks on a 2-core machine need
# the second. Harmless elsewhere.
MPI_ARGS = "--allow-run-as-root --oversubscribe"


def horovodrun(args: list[str], *, np: int = 2, backend: str = "gloo", timeout: float = 180,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``horovodrun -np NP -H localhost:NP --gloo|--mpi python ARGS...``; returns the result."""
    if backend not in ("gloo", "mpi"):
        raise ValueError(f"backend must be 'gloo' or 'mpi', got {backend!r}")
    # horovodrun's own code, its build checks asked once per process (horovodrun_known_build.py)
    cmd = [sys.executable, str(Path(__file__).with_name("horovodrun_known_build.py")),
           "-np", str(np), "-H", f"localhost:{np}", f"--{backend}"]
    if backend == "mpi":
        cmd.append(f"--mpi-args={MPI_ARGS}")
    return _launch([*cmd, sys.executable, *args], timeout, {"HOROVOD_KNOWN_BUILD": horovod_build(), **(env or {})})


@functools.cache
def horovod_build() -> str:
    """What Horovod was built with, by its own checks, in a process of its own: "gloo,mpi"."""
    ask = ("from horovod.common.util import gloo_built, mpi_built; "
           "print(','.join(n for n, built in (('gloo', gloo_built), ('mpi', mpi_built)) if built()))")
    result = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"cannot ask Horovod what it was built with:\n{result.stdout}{result.stderr}")
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""


def torchrun(args: list[str], *, np: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node NP python ARGS...`` (the DDP front end)."""
    return _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(np), *args], timeout, env)


def launch(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Any command, with the same timeout and environment (one process of a local job)."""
    return _launch(cmd, timeout, env)


def _launch(cmd: list[str], timeout: float, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    """Run a launcher in its own process group; on timeout kill the group and fail with the output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{Path(cmd[0]).name} timed out after {timeout} s: {' '.join(cmd)}\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
