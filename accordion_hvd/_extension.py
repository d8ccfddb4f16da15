"""Loads the compiled extension ``accordion_hvd._C`` or says exactly how to build it.

There is deliberately no silent fallback to the plain-torch reference: a broken or stale
build must be noticed, not hidden. (Tests call ``accordion_hvd.reference`` explicitly.)
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from ._source_hash import source_hash

BUILD_HINT = (
    "build it from the repository root with `make build` "
    "(or `pip install --no-build-isolation -e .`)"
)
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def check_build(module: ModuleType, torch_version: str, expected_source_hash: str | None) -> None:
    """Raise ImportError if ``module`` was built for another torch or from other sources."""
    built_for = getattr(module, "torch_version", "unknown")
    if built_for != torch_version:
        raise ImportError(
            f"accordion_hvd._C was built against torch {built_for}, but torch {torch_version} "
            f"is installed: the extension is stale; {BUILD_HINT}"
        )
    built_from = getattr(module, "source_hash", "unknown")
    if expected_source_hash is not None and built_from != expected_source_hash:
        raise ImportError(
            f"accordion_hvd._C is stale: csrc/ changed since it was built "
            f"(built from sources {built_from}, checkout has {expected_source_hash}); {BUILD_HINT}"
        )


@functools.cache
def load() -> ModuleType:
    try:
        from . import _C
    except ImportError as exc:
        raise ImportError(
            f"accordion_hvd's compiled extension accordion_hvd._C could not be loaded ({exc}); "
            f"{BUILD_HINT}"
        ) from exc
    # In a source checkout (an editable install), also compare with the sources on disk.
    check_build(_C, torch.__version__, source_hash(SOURCE_ROOT))
    return _C
