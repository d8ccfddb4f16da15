"""What the tests launch: a worker script or a module on every rank, under a real
``horovodrun`` (Gloo or MPI) or ``torchrun``, asserting that it succeeded. The launchers
themselves (with a timeout, never hanging) are benchmarks/cluster/localrun.py, shared with the
benchmarks.
"""

from __future__ import annotations

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


__all__ = ["horovodrun", "run_ddp_module", "run_ddp_worker", "run_module", "run_worker", "succeeded", "torchrun"]
