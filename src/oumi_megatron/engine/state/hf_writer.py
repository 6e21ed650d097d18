"""HF safetensors folders written by the ranks that hold the weights, one shard at a time.

``save_hf_folder`` takes each pipeline stage's own tensors (``HFWeightExporter.stage_tensors``: gathered over TP / EP
inside the stage, never sent to another stage) and cuts each stage's stream into shards of at most
``max_shard_size`` bytes, with huggingface_hub's rule (``split_torch_state_dict_into_shards``: in order, a new shard
when the next tensor does not fit, a tensor larger than the limit alone). Every rank of a stage sees the same stream,
so all of them cut it the same way without talking; shard k of a stage is written by the stage's k-th rank (round
robin), in the background while the stage exports on. A rank holds its own parameters plus at most one shard in host
memory (it waits for its previous shard's write before it fills the next), so an export costs no rank the whole
model: at 70B on TP 8 x PP 2, 16 ranks write ~28 shards of 5 GB in parallel where rank 0 alone held 141 GB.

When every stage is done, rank 0 numbers the shards stage by stage in HF's names (``model-00001-of-00029.safetensors``;
one shard: ``model.safetensors``), writes ``model.safetensors.index.json`` and copies the config and tokenizer files;
``atomic_directory`` makes the folder appear complete or not at all.

The files are safetensors as ``safetensors.torch.save_file`` writes them (the same header and data order, with
transformers' ``{"format": "pt"}`` metadata), written from each tensor's memory without the byte copy of the whole
shard that ``save_file`` makes first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.utils.atomic import HF_MODEL, atomic_directory
from oumi_megatron.utils.disk import parse_size
from oumi_megatron.utils.ranks import global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    # safetensors' dtype names, and their rank in its Dtype enum: it orders a file's tensors by dtype, largest
    # rank first, then by name
    torch.bool: ("BOOL", 0), torch.uint8: ("U8", 4), torch.int8: ("I8", 5), torch.float8_e5m2: ("F8_E5M2", 6),
    torch.float8_e4m3fn: ("F8_E4M3", 7), torch.int16: ("I16", 9), torch.uint16: ("U16", 10), torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12), torch.int32: ("I32", 13), torch.uint32: ("U32", 14), torch.float32: ("F32", 15),
    torch.float64: ("F64", 17), torch.int64: ("I64", 18), torch.uint64: ("U64", 19),
}


def check_shard_size(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.hf_max_shard_size``: the largest safetensors file of an export."""
    size = config.megatron.hf_max_shard_size
    try:
        ok = parse_size(size) > 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        found.add("megatron.hf_max_shard_size", f"must be a size such as 5GB, 500MB or a number of bytes > 0, got {size!r}.")


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of CPU ``tensors``, streamed from their memory (no second copy)."""
    ordered = sorted(tensors, key=lambda nt: (-_DTYPES[nt[1].dtype][1], nt[0]))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in ordered:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, t in ordered:
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


@dataclass
class _Shard:
    writer: int
    """The global rank that writes it."""
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """This rank's host copies, if it is the writer."""


class _Background:
    """One write at a time in a thread of its own. A failed write is kept in ``error`` (and no further write starts),
    not raised: the rank goes on through the export's collectives and reports it (``save_hf_folder``)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self, fn: Any) -> None:
        self.wait()
        if self.error is not None:
            return

        def run() -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported by finish()
                self.error = f"{type(e).__name__}: {e}"

        self.thread = threading.Thread(target=run, name="hf-shard-writer", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class StageShards:
    """One pipeline stage's tensor stream cut into shards, the same way on every rank of the stage (see the module
    docstring); this rank keeps and writes only the shards it is the writer of."""

    def __init__(self, folder: Path, stage: int, stage_ranks: list[int], max_bytes: int, rank: int) -> None:
        self.folder, self.stage, self.stage_ranks, self.max_bytes, self.rank = folder, stage, stage_ranks, max_bytes, rank
        self.opened = 0
        self.closed: list[_Shard] = []  # in HF's order: a shard is listed when it closes
        self.current: _Shard | None = None
        self.names = hashlib.sha256()  # the stream as this rank saw it, to check the stage agreed
        self.background = _Background()

    def _open(self) -> _Shard:
        shard = _Shard(writer=self.stage_ranks[self.opened % len(self.stage_ranks)])
        self.opened += 1
        return shard

    def _keep(self, shard: _Shard, name: str, tensor: torch.Tensor) -> None:
        if shard.writer == self.rank:
            if not shard.tensors:
                self.background.wait()  # the previous shard's bytes leave before this one's arrive
            shard.tensors.append((name, tensor.detach().contiguous().cpu()))
        shard.names.append(name)
        shard.nbytes += tensor.numel() * tensor.element_size()

    def _close(self, shard: _Shard) -> None:
        index = len(self.closed)
        self.closed.append(shard)
        if shard.writer == self.rank:
            path, tensors = self.temp_path(index), shard.tensors
            shard.tensors = []
            self.background.start(lambda: write_safetensors(path, tensors, {"format": "pt"}))

    def temp_path(self, index: int) -> Path:
        return self.folder / f".stage{self.stage:04d}-{index:05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.update(name.encode() + b"\0")
        size = tensor.numel() * tensor.element_size()
        if size > self.max_bytes:  # alone, and the current shard goes on
            shard = self._open()
            self._keep(shard, name, tensor)
            self._close(shard)
            return
        if self.current is not None and self.current.nbytes + size > self.max_bytes:
            self._close(self.current)
            self.current = None
        if self.current is None:
            self.current = self._open()
        self._keep(self.current, name, tensor)

    def finish(self) -> dict[str, Any]:
        """Closes the last shard, waits for this rank's writes; what rank 0 needs to name the files (and this rank's
        write error, if any)."""
        if self.current is not None:
            self._close(self.current)
            self.current = None
        self.background.wait()
        return {"stage": self.stage, "rank": self.rank, "stream": self.names.hexdigest(), "count": len(self.closed),
                "mine": [(i, s.names, s.nbytes) for i, s in enumerate(self.closed) if s.writer == self.rank],
                "error": self.background.error}


def _stage_ranks(stage: int) -> list[int]:
    """The global ranks of this pipeline stage (every one of them sees the stage's whole stream)."""
    if not dist.is_initialized():
        return [0]
    stages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    return [r for r, s in enumerate(stages) if s == stage]


def _tied(config: dict[str, Any]) -> bool:
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


class HFExportError(RuntimeError):
    """An HF export that could not be written (the message names the rank and file); the folder is not replaced."""


def _name_files(folder: Path, reports: list[dict[str, Any]]) -> None:
    """Rank 0: checks every rank wrote its shards and every rank of a stage cut the same stream, gives the shards HF's
    names stage by stage, writes the index (more than one shard)."""
    failed = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
    if failed:
        raise HFExportError(f"writing the HF shards failed ({'; '.join(failed)}); {folder.parent} keeps what it had")
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for report in reports:
        by_stage.setdefault(report["stage"], []).append(report)
    shards: list[tuple[int, int, list[str], int]] = []  # (stage, index, names, bytes) in file order
    for stage in sorted(by_stage):
        seen = {(r["stream"], r["count"]) for r in by_stage[stage]}
        if len(seen) != 1:
            raise HFExportError(f"the ranks of pipeline stage {stage} exported different tensors "
                               f"({len(seen)} different streams); the export is not written")
        mine = sorted((i, names, nbytes) for r in by_stage[stage] for i, names, nbytes in r["mine"])
        if [i for i, _, _ in mine] != list(range(by_stage[stage][0]["count"])):
            raise HFExportError(f"the shards of pipeline stage {stage} were not all written")
        shards += [(stage, i, names, nbytes) for i, names, nbytes in mine]
    total = len(shards)
    weight_map: dict[str, str] = {}
    for number, (stage, index, names, _) in enumerate(shards, start=1):
        name = "model.safetensors" if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"
        (folder / f".stage{stage:04d}-{index:05d}.safetensors").rename(folder / name)
        for tensor in names:
            if tensor in weight_map:
                raise HFExportError(f"{tensor} was exported twice")
            weight_map[tensor] = name
    if total > 1:
        index_json = {"metadata": {"total_size": sum(nbytes for *_, nbytes in shards)}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")


def save_hf_folder(stage_tensors: Iterable[tuple[str, torch.Tensor]], stage: int, hf_artifacts: str | Path,
                   out_dir: str | Path, max_shard_size: int | str = "5GB") -> Path:
    """Collective: an HF folder at ``out_dir`` (config, tokenizer, generation config from ``hf_artifacts``; safetensors
    shards of ``stage_tensors``, this rank's pipeline stage's tensors), written atomically."""
    hf_artifacts = Path(hf_artifacts)
    config = json.loads((hf_artifacts / "config.json").read_text())
    skip = {"lm_head.weight"} if _tied(config) else set()  # tied: HF checkpoints hold only the embedding
    rank = global_rank()
    ranks = _stage_ranks(stage)
    with atomic_directory(out_dir, HF_MODEL) as tmp:
        shards = StageShards(tmp, stage, ranks, parse_size(max_shard_size), rank)
        for name, tensor in stage_tensors:
            if name not in skip:
                shards.add(name, tensor)
        report = shards.finish()
        reports: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [report]
        if dist.is_initialized():
            dist.gather_object(report, reports if rank == 0 else None, dst=0)
        verdict: list[str | None] = [None]
        if rank == 0:
            try:
                for path in hf_artifacts.iterdir():
                    # a link is not followed: a checkpoint from elsewhere could point one at any file of this host
                    if path.is_file() and not path.is_symlink() and not path.name.endswith(_WEIGHT_FILES):
                        shutil.copy2(path, tmp / path.name, follow_symlinks=False)
                _name_files(tmp, reports)
            except (OSError, HFExportError) as e:
                verdict[0] = str(e) if isinstance(e, HFExportError) else f"{type(e).__name__}: {e}"
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)  # every rank stops with the same error, none waits alone
        if verdict[0] is not None:
            raise HFExportError(f"HF export to {out_dir}: {verdict[0]}")
    return Path(out_dir)
