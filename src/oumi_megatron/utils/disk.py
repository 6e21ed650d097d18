"""Sizes on disk: HF's size strings, and free space before writing (a full disk found halfway through a save leaves
a partial folder and a lost step)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

GIB = 2**30
MARGIN = 1.05
"""Room above the estimate: metadata, the manifests, the filesystem's own rounding."""


def human_bytes(n: float) -> str:
    """``n`` bytes in the unit that reads best: 512 B, 3.4 MiB, 12.1 GiB, 2.3 TiB (powers of 1024, as GiB is elsewhere)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def folder_bytes(path: str | Path) -> int:
    """Bytes of the files below ``path`` (0 where it does not exist); files that vanish while counted are skipped."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


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
    return (f"{path} has {human_bytes(free)} free and {what} needs ~{human_bytes(need)}: {fix}. Nothing was written; "
            "what is on disk is intact")
