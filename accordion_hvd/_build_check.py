"""A freshly built extension must raise its errors as Python exceptions, not crash.

Seen on a GPU image (torch 2.11 + CUDA 13, Ubuntu 24.04): its environment sets
``CXX=/opt/gcc/bin/g++`` and ``CUDAHOSTCXX=/opt/gcc/bin/g++``, a wrapper around the system's
g++ 13. Everything built with it compiled, loaded and computed correctly, but the first
error the extension raised (any bad argument, e.g. ``topk_ef`` with k > n) killed the
process with SIGSEGV in libstdc++'s stream code while the message was being formatted.
Built by ``/usr/bin/g++`` for both the C++ and the CUDA host code, the same sources raise
cleanly and pass every test. A build like the first would turn every user error into a
crash of the training job, so setup.py checks each build once, in a separate process,
before calling it done.

setup.py loads this file by path (the package itself cannot be imported before its
extension exists), so it imports nothing from the package.
"""

from __future__ import annotations

import signal
import subprocess
import sys

# Loads the library on its own (its TORCH_LIBRARY registrations run at load) and triggers
# one argument error from the C++ side.
PROBE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.accordion.topk_ef(torch.ones(4), torch.zeros(4), 5)
except RuntimeError as exc:
    sys.exit(0 if "k must be in" in str(exc) else f"raised, but not our message: {exc}")
sys.exit("topk_ef accepted k = 5 > numel = 4 without an error")
"""


def errors_raise(library: str, probe: str = PROBE, timeout: float = 300) -> str | None:
    """None if an error raised inside ``library`` reaches Python as an exception; otherwise
    what happened instead (the signal that killed the probe, or its last words)."""
    try:
        proc = subprocess.run([sys.executable, "-c", probe, library], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the probe did not finish in {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"the process was killed by {name} while raising an error"
    said = (proc.stderr or proc.stdout).strip()
    return said.splitlines()[-1][-300:] if said else f"exit status {proc.returncode}"
