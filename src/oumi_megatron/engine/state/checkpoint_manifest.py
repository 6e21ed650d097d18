"""What a complete checkpoint holds, written per rank and verified per rank.

Every file of a checkpoint belongs either to one rank (``rank_XXXXX.json`` and the distributed checkpoint's
``__R_I.distcp`` files, which torch names by the rank that wrote them) or to the checkpoint as a whole (metadata,
``hf/``, ``trainer_state.json``, written by rank 0). Each rank lists its own files in ``manifest_rank_XXXXX.json``
(size, and the SHA-256 of files under 16 MiB); rank 0 lists the shared ones in ``manifest.json`` with the world size
that saved. Verifying is split the same way: rank r of a world of W checks the manifests of the saved ranks r, r + W,
... and rank 0 the shared one, then one reduction says whether all passed. A rank reads O(its own files) however many
ranks there are (the resume check used to stat every rank's files and hash every small one on every rank: O(ranks^2)
reads in all); the big tensor files are only sized, which catches truncation without reading terabytes.

Checkpoints written before per-rank manifests (one ``manifest.json`` listing every file) are verified whole by rank 0;
checkpoints without any manifest are accepted as complete.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from oumi_megatron.utils.ranks import first_failure

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
HASH_BELOW = 16 * 2**20
"""Files smaller than this are hashed as well as sized (metadata, per-rank state)."""
_RANK_MANIFEST = re.compile(r"^manifest_rank_(\d{5})\.json$")
_OWNED = (re.compile(r"^rank_(\d{5})\.json$"), re.compile(r"^__(\d+)_\d+\.distcp$"))


def rank_manifest_name(rank: int) -> str:
    return f"manifest_rank_{rank:05d}.json"


def owner(path: Path) -> int | None:
    """The rank a checkpoint file belongs to, or None for a shared file."""
    for pattern in _OWNED:
        m = pattern.match(path.name)
        if m:
            return int(m.group(1))
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entries(checkpoint: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(files):
        size = path.stat().st_size
        out[str(path.relative_to(checkpoint))] = {"size": size, **({"sha256": _sha256(path)} if size < HASH_BELOW else {})}
    return out


TENSOR_DIRS = ("model", "optimizer")
"""The checkpoint's distributed-checkpoint folders, where each rank's ``__R_I.distcp`` files are."""


def rank_files(checkpoint: Path, rank: int) -> list[Path]:
    """The files ``rank`` wrote: its rank state and its tensor files, found by their names (torch numbers a rank's files
    0, 1, ...), so a rank touches only its own files, not a listing of every rank's."""
    mine = [p for p in [checkpoint / f"rank_{rank:05d}.json"] if p.is_file()]
    for sub in TENSOR_DIRS:
        index = 0
        while (checkpoint / sub / f"__{rank}_{index}.distcp").is_file():
            mine.append(checkpoint / sub / f"__{rank}_{index}.distcp")
            index += 1
    return mine


def write_rank_manifest(checkpoint: Path, rank: int) -> None:
    """This rank's files (its rank state and the tensor files it wrote), in its own manifest."""
    mine = rank_files(checkpoint, rank)
    (checkpoint / rank_manifest_name(rank)).write_text(json.dumps({"rank": rank, "files": _entries(checkpoint, mine)}))


def write_manifest(checkpoint: Path, world_size: int) -> None:
    """The shared files (everything no rank owns, but the manifests and the state file written after them), and the
    world size whose rank manifests make the checkpoint whole. Rank 0, after every rank wrote its own manifest (it
    lists the checkpoint's folders: names only, once per save)."""
    shared = [p for p in checkpoint.rglob("*") if p.is_file() and owner(p) is None
              and p.name != STATE_FILE and not (p.parent == checkpoint and (p.name == MANIFEST_FILE or _RANK_MANIFEST.match(p.name)))]
    (checkpoint / MANIFEST_FILE).write_text(json.dumps({"world_size": world_size, "files": _entries(checkpoint, shared)},
                                                       indent=1))


@dataclass
class Share:
    """One rank's part of a verification: what is wrong (None: nothing), and the bytes it read to find out."""

    problem: str | None = None
    bytes_read: int = 0


def _inside(checkpoint: Path, name: str) -> Path | None:
    """``checkpoint / name`` where ``name`` is a relative path that stays inside the checkpoint and passes through no
    link; None otherwise (a manifest written elsewhere could name any file of this host)."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        return None
    path = checkpoint
    for part in parts:
        path = path / part
        if path.is_symlink():
            return None
    return path


def _check_files(checkpoint: Path, files: dict[str, Any], share: Share) -> None:
    for name, want in files.items():
        path = _inside(checkpoint, str(name))
        if path is None:
            share.problem = f"a manifest of {checkpoint} names {name!r}, which is not a file inside it (refused)"
            return
        if not path.is_file():
            share.problem = f"{path} is missing"
            return
        size = path.stat().st_size
        if size != want["size"]:
            share.problem = f"{path} has {size} bytes, {want['size']} were written (truncated or changed)"
            return
        if "sha256" in want:
            share.bytes_read += size
            if _sha256(path) != want["sha256"]:
                share.problem = f"{path} does not match the checksum written with it (damaged)"
                return


def _read_json(path: Path, share: Share) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        share.problem = f"{path} cannot be read ({e})"
        return None
    share.bytes_read += len(text)
    try:
        return json.loads(text)
    except ValueError as e:
        share.problem = f"{path} is damaged ({e})"
        return None


def verify_share(checkpoint: str | Path, rank: int, world_size: int) -> Share:
    """Rank ``rank``'s part of verifying ``checkpoint`` in a world of ``world_size`` (read-only, no communication):
    rank 0 the state file and the shared files, every rank the manifests of the saved ranks congruent to it. The shared
    manifest, which every rank reads, lists a fixed number of files however many ranks saved."""
    checkpoint = Path(checkpoint)
    share = Share()
    if not checkpoint.is_dir():
        share.problem = f"{checkpoint} does not exist"
        return share
    if not (checkpoint / STATE_FILE).is_file():
        share.problem = f"{checkpoint / STATE_FILE} is missing (an incomplete checkpoint)"
        return share
    manifest_path = checkpoint / MANIFEST_FILE
    if not manifest_path.is_file():
        return share  # written before manifests existed
    if rank == 0:
        _read_json(checkpoint / STATE_FILE, share)
    manifest: Any = None if share.problem else _read_json(manifest_path, share)
    if share.problem:
        return share
    try:
        saved_world = manifest.get("world_size")  # None: the whole-checkpoint manifest of earlier versions
        if rank == 0:
            _check_files(checkpoint, manifest["files"], share)
        for saved_rank in range(rank, int(saved_world or 0), world_size):
            if share.problem:
                break
            path = checkpoint / rank_manifest_name(saved_rank)
            if not path.is_file():
                share.problem = f"{path} is missing (rank {saved_rank} of the {saved_world} that saved did not finish)"
                break
            mine = _read_json(path, share)
            if mine is not None:
                _check_files(checkpoint, mine["files"], share)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        share.problem = f"a manifest of {checkpoint} is damaged ({type(e).__name__}: {e})"
    return share


def verify_checkpoint(checkpoint: str | Path) -> str | None:
    """None if ``checkpoint`` is complete and matches its manifests, else what is wrong (naming the file). Collective
    when torch.distributed is initialized (each rank checks its share, one reduction), on its own otherwise (one
    process checks everything)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return verify_share(checkpoint, 0, 1).problem
    return first_failure(verify_share(checkpoint, dist.get_rank(), dist.get_world_size()).problem)
