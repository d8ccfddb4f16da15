"""Fingerprint of the C++/CUDA sources, shared by setup.py and the import-time check.

setup.py compiles the fingerprint of ``csrc/`` and ``CMakeLists.txt`` into the extension;
in a source checkout, importing the package recomputes it and refuses an extension built
from other sources (see ``_extension.py``). Standard library only: setup.py loads this
file before torch or the package can be imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def source_files(root: Path) -> list[Path]:
    """The files whose content decides what the extension is, in a stable order."""
    files = [p for p in (root / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()]
    files.append(root / "CMakeLists.txt")
    return sorted(files)


def source_hash(root: Path) -> str | None:
    """Hash of the sources under ``root``, or None if ``root`` is not a source checkout."""
    root = Path(root)
    if not (root / "csrc").is_dir() or not (root / "CMakeLists.txt").is_file():
        return None
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]
