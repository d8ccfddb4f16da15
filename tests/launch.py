"""Run a command under a real ``horovodrun`` (Gloo or MPI), or ``torchrun``, from a test,
never hanging.

Every launch has a timeout; on expiry the whole process group (horovodrun, mpirun and the
workers) is killed and the test fails with the output so far.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parent / "workers"

# Open MPI refuses to run as root without these, and 2 ranks on a 1-core machine need
# oversubscription. Harmless elsewhere.
MPI_ARGS = "--allow-run-as-root --oversubscribe"


def horovodrun(args: list[str], *, np: int = 2, backend: str = "gloo", timeout: float = 180,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``horovodrun -np NP -H localhost:NP --gloo|--mpi python ARGS...``; returns the result."""
    if backend not in ("gloo", "mpi"):
        raise ValueError(f"backend must be 'gloo' or 'mpi', got {backend!r}")
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", f"--{backend}"]
    if backend == "mpi":
        cmd.append(f"--mpi-args={MPI_ARGS}")
    return _launch([*cmd, sys.executable, *args], timeout, env)


def torchrun(args: list[str], *, np: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node NP python ARGS...`` (the DDP front end)."""
    return _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(np), *args], timeout, env)


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


def run_ddp_worker(script: str, *script_args: str, **kwargs) -> str:
    """Run tests/workers/SCRIPT under torchrun; assert it succeeded; return its output."""
    result = torchrun([str(WORKERS / script), *script_args], **kwargs)
    assert result.returncode == 0, f"{' '.join(result.args)} exited with {result.returncode}:\n{result.stdout}"
    return result.stdout


def run_worker(script: str, *script_args: str, **kwargs) -> str:
    """Run tests/workers/SCRIPT under horovodrun; assert it succeeded; return its output."""
    result = horovodrun([str(WORKERS / script), *script_args], **kwargs)
    assert result.returncode == 0, f"{' '.join(result.args)} exited with {result.returncode}:\n{result.stdout}"
    return result.stdout


def run_module(module: str, *module_args: str, **kwargs) -> str:
    """Run ``python -m MODULE ARGS...`` under horovodrun; assert it succeeded; return its output."""
    result = horovodrun(["-m", module, *module_args], **kwargs)
    assert result.returncode == 0, f"{' '.join(result.args)} exited with {result.returncode}:\n{result.stdout}"
    return result.stdout
