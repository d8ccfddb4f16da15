"""What the tests launch: a worker script or a module on every rank, under a real
``horovodrun`` (Gloo or MPI) or ``torchrun``, asserting that it succeeded. The launchers
themselves (with a timeout, never hanging) are benchmarks/cluster/localrun.py, shared with the
benchmarks.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "cluster"))
from localrun import horovodrun, torchrun  # noqa: E402

WORKERS = Path(__file__).resolve().parent / "workers"


def succeeded(result) -> str:
    """A launcher's output, after asserting that it exited with 0."""
    assert result.returncode == 0, f"{' '.join(result.args)} exited with {result.returncode}:\n{result.stdout}"
    return result.stdout


def run_ddp_worker(script: str, *script_args: str, **kwargs) -> str:
    """Run tests/workers/SCRIPT under torchrun; assert it succeeded; return its output."""
    return succeeded(torchrun([str(WORKERS / script), *script_args], **kwargs))


def run_ddp_module(module: str, *module_args: str, **kwargs) -> str:
    """Run ``python -m MODULE ARGS...`` under torchrun; assert it succeeded; return its output."""
    return succeeded(torchrun(["-m", module, *module_args], **kwargs))


def run_worker(script: str, *script_args: str, **kwargs) -> str:
    """Run tests/workers/SCRIPT under horovodrun; assert it succeeded; return its output."""
    return succeeded(horovodrun([str(WORKERS / script), *script_args], **kwargs))


def run_module(module: str, *module_args: str, **kwargs) -> str:
    """Run ``python -m MODULE ARGS...`` under horovodrun; assert it succeeded; return its output."""
    return succeeded(horovodrun(["-m", module, *module_args], **kwargs))


def run_worker_in_turn(script: str, args: tuple[str, ...], all_args: tuple[tuple[str, ...], ...], *,
                       np: int = 2, backend: str = "gloo") -> str:
    """The output of ``SCRIPT ARGS`` under horovodrun, from one launch that runs SCRIPT with
    every argument set of ALL_ARGS in turn (tests/workers/in_turn.py): the parametrized cases
    of a test share one start-up. The launch happens once per (script, all_args, np, backend)
    in a session; this case passes only if its own run ended on every rank (a run that failed
    stops the ones after it too). The output is the whole job's (every run's lines)."""
    assert args in all_args, (args, all_args)
    result = _in_turn(script, tuple(" ".join(a) for a in all_args), np, backend)
    key = " ".join(args)
    done = result.stdout.count(f"in_turn: done {key}\n")
    assert done == np, (f"{script} {key}: finished on {done} of {np} ranks in the job that ran "
                        f"{len(all_args)} argument sets in turn (exit {result.returncode}):\n{result.stdout}")
    return result.stdout


@functools.cache
def _in_turn(script: str, all_args: tuple[str, ...], np: int, backend: str) -> subprocess.CompletedProcess:
    try:
        return horovodrun([str(WORKERS / "in_turn.py"), script, *all_args], np=np, backend=backend,
                          timeout=120 + 30 * len(all_args))
    except AssertionError as exc:  # the job timed out: kept, so that its other cases fail without a relaunch
        return subprocess.CompletedProcess([], -9, str(exc), None)


__all__ = ["horovodrun", "run_ddp_module", "run_ddp_worker", "run_module", "run_worker", "run_worker_in_turn",
           "succeeded", "torchrun"]
