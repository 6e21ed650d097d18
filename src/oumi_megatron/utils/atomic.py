"""Atomic directory writes: a folder either appears complete or not at all.

Every rank writes into ``.<name>.partial`` next to the target; after a barrier, rank 0 makes its files durable (fsync)
and renames it into place (replacing an older version via a second rename). A crash at any point leaves either the old
folder or no folder at ``path``, never a half-written one; leftovers of ``.partial`` are removed on the next write.
The folders are created private to the user (``PRIVATE_DIR_MODE``: they hold models, prompts and completions).

A folder written for a command's ``--out`` carries a marker of its kind (``OUTPUT_MARKER``), so a later write of the
same kind may replace it while anything else (a folder of the user's) is refused unless they say ``--overwrite``
(``check_output_dir``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from oumi_megatron.errors import UserInputError
from oumi_megatron.utils.ranks import global_rank

PRIVATE_DIR_MODE = 0o750
"""Output folders: the user reads and writes, their group reads, nobody else enters (the umask may take more away)."""
OUTPUT_MARKER = ".oumi_megatron_output"
"""A file in each folder this package writes for an ``--out``: ``{"kind": ...}``, what it holds."""
HF_MODEL, HF_ADAPTER, MEGATRON_CHECKPOINT = "hf_model", "hf_adapter", "megatron_checkpoint"
"""The kinds of marked folders: an HF model, an HF PEFT adapter, a converted Megatron-Core checkpoint (the first two
are also the final export's folder names in a run's output_dir)."""


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
        tmp.mkdir(mode=PRIVATE_DIR_MODE)
    _barrier()
    return tmp


def fsync_tree(folder: Path) -> None:
    """Every file and folder under ``folder`` (itself included) flushed to the disk: a rename that commits them must not
    reach the disk before their contents (a crash after it would leave a complete-looking folder of empty files)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(Path(root))


def fsync_dir(folder: Path) -> None:
    """A folder's entries (a rename into it) flushed to the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(path: str | Path) -> None:
    """Collective: move the finished ``.<name>.partial`` into place (replacing an older ``path``)."""
    path = Path(path)
    _barrier()
    if global_rank() == 0:
        fsync_tree(partial_path(path))
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        partial_path(path).rename(path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


@contextlib.contextmanager
def atomic_directory(path: str | Path, kind: str | None = None) -> Iterator[Path]:
    """Yields a temporary folder to write into (collective when torch.distributed is initialized). ``kind``: the folder
    is marked as an output of that kind (``check_output_dir``)."""
    tmp = begin(path)
    yield tmp
    if kind is not None and global_rank() == 0:
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    commit(path)


def output_kind(path: str | Path) -> str | None:
    """The kind a folder of ours was written as; None for anything else."""
    try:
        kind = json.loads((Path(path) / OUTPUT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def check_output_dir(path: str | Path, kind: str, overwrite: bool = False, flag: str = "--out") -> None:
    """``UserInputError`` unless ``path`` may be written as ``kind``: it does not exist, is an empty folder, or is an
    earlier output of the same kind; with ``overwrite`` any folder (never a file). Before any work: the write replaces
    the whole folder."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise UserInputError(f"{flag} {path}: a file is there, not a folder. Name a folder.")
    if overwrite or output_kind(path) == kind or not any(path.iterdir()):
        return
    raise UserInputError(f"{flag} {path}: the folder holds files this command did not write (no {OUTPUT_MARKER} of a "
                         f"{kind!r}), and writing replaces the whole folder. Name a new or empty folder, or pass "
                         "--overwrite to replace it.")
