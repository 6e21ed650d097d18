"""Sizes on disk: HF's size strings, and free space before writing (a full disk found halfway through a save leaves
a partial folder and a lost step)."""

from __future__ import annotations

import shutil
from pathlib import Path

GIB = 2**30
MARGIN = 1.05
"""Room above the estimate: metadata, the manifests, the filesystem's own rounding."""


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB``, ``500MB`` (TB, GB, MB, KB: powers of 1000, as huggingface_hub reads them) or an int."""
    if isinstance(size, int):
        return size
    if size.strip().isdigit():
        return int(size)
    from huggingface_hub.serialization._base import parse_size_to_int

    return int(parse_size_to_int(size))


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def space_problem(path: str | Path, need: float, what: str, fix: str) -> str | None:
    """None if ``path``'s filesystem has room for ``need`` bytes (with a margin), else a message naming both, ``what``
    needs them and ``fix``."""
    free = free_bytes(path)
    if free >= MARGIN * need:
        return None
    return (f"{path} has {free / GIB:.1f} GiB free and {what} needs ~{need / GIB:.1f} GiB: {fix}. Nothing was written; "
            "what is on disk is intact")
