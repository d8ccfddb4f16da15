"""Shared by the worker scripts (their directory is on sys.path when they run)."""

import sys


def say(line: str) -> None:
    """Print one line in a single write: with PYTHONUNBUFFERED, print() writes the text and
    the newline separately, and mpirun can put another rank's output in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checker(rank: int):
    """check(condition, message): on failure print which rank failed and why, then exit 1."""
    def check(condition, message):
        if not condition:
            say(f"rank {rank}: FAILED: {message}")
            sys.exit(1)
    return check


def leave_torch_distributed(dist) -> None:
    """End a torchrun worker whose checks all passed: a barrier, every process group destroyed,
    then exit at once. Skipping the interpreter's teardown is deliberate: with Gloo, torch's
    worker threads can still hold work objects whose destruction at interpreter finalization
    aborts the process ("terminate called without an active exception", SIGABRT; pytorch
    issues 190489 and PR 179291). Seen once in this suite, on a loaded machine, after both
    ranks had printed OK; what the test checks is done before this point."""
    import os
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
