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
