"""Atomic directory writes: a folder either appears complete or not at all.

Every rank writes into ``.<name>.partial`` next to the target; after a barrier, rank 0 renames it into
place (replacing an older version via a second rename). A crash at any point leaves either the old
folder or no folder at ``path``, never a half-written one; leftovers of ``.partial`` are removed on
the next write.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from oumi_megatron.utils.ranks import global_rank


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def begin(path: str | Path) -> Path:
    """Collective: a fresh, empty ``.<name>.partial`` folder next to ``path`` to write into."""
    path = Path(path)
    tmp = partial_path(path)
    if global_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    return tmp


def commit(path: str | Path) -> None:
    """Collective: move the finished ``.<name>.partial`` into place (replacing an older ``path``)."""
    path = Path(path)
    _barrier()
    if global_rank() == 0:
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial_path(path).rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yields a temporary folder to write into (collective when torch.distributed is initialized)."""
    tmp = begin(path)
    yield tmp
    commit(path)
