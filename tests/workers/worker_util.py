"""Shared by the worker scripts (their directory is on sys.path when they run)."""

import sys


def checker(rank: int):
    """check(condition, message): on failure print which rank failed and why, then exit 1."""
    def check(condition, message):
        if not condition:
            print(f"rank {rank}: FAILED: {message}", flush=True)
            sys.exit(1)
    return check
