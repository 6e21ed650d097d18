"""HF -> Megatron-Core conversion (once) and Megatron-Core -> HF export, through Megatron-Bridge.

A converted checkpoint folder (``output_dir/megatron_checkpoint/``) holds:

* ``model/``: the weights as a Megatron-Core distributed checkpoint (loads under any TP/PP/VPP layout);
* ``hf/``: the source model's config, tokenizer and generation config (what export and the bridge need);
* ``oumi_megatron.json``: where it came from (path, config hash, weight files) and how it was saved.

Both directions are collective (every rank calls them) and write atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.kernels.cuda_graphs import attach_cuda_graphs, cuda_graphs_enabled
from oumi_megatron.engine.model import build_model_chunks, configure_provider, default_dtype, load_bridge
from oumi_megatron.engine.parallel.distributed import ParallelSizes, init_model_parallel
from oumi_megatron.engine.state.checkpoint_io import load_model, save_model
from oumi_megatron.engine.wrappers import unwrap
from oumi_megatron.utils.atomic import atomic_directory
from oumi_megatron.utils.ranks import global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams

META_FILE = "oumi_megatron.json"
FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _resolve_local(hf_path: str | Path) -> Path:
    """A local folder for ``hf_path`` (a hub name is resolved through the local HF cache / download)."""
    local = Path(hf_path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(hf_path)))


def source_fingerprint(hf_path: str | Path) -> dict[str, Any]:
    """What identifies a source model: its config, and the name, size and modification time (ns) of each
    weight file. The time catches weights rewritten in place with the same size; a copy that keeps
    sizes and times (cp -p, rsync -a) of different weights would not be caught, and hashing every
    weight file (140 GB at 70B) at every start costs minutes, so a changed time forces a
    re-conversion instead (a touched file reconverts, which is safe)."""
    local = _resolve_local(hf_path)
    config_sha = hashlib.sha256((local / "config.json").read_bytes()).hexdigest()
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in local.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)
    )
    return {"source": str(hf_path), "config_sha256": config_sha, "weight_files": [list(w) for w in weights]}


def read_meta(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _default_params() -> MegatronParams:
    from oumi_megatron.config.megatron_params import MegatronParams

    return MegatronParams()


def convert_hf_to_megatron(
    hf_path: str | Path,
    out_dir: str | Path,
    params: MegatronParams | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Converts an HF causal LM into a Megatron-Core distributed checkpoint at ``out_dir``.

    Collective over the ranks of the layout in ``params`` (default: one rank, TP=PP=1).
    ``trust_remote_code`` (``model.trust_remote_code``) lets transformers run the model folder's own
    configuration/modeling code; off by default.
    """
    params = params or _default_params()
    dtype = dtype or default_dtype()
    init_model_parallel(ParallelSizes.from_params(params))
    bridge = load_bridge(hf_path, trust_remote_code=trust_remote_code)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=True), params, dtype)
    chunks = build_model_chunks(provider, ddp_config=None, load_hf_weights=True)
    meta = {
        "format_version": FORMAT_VERSION,
        **source_fingerprint(hf_path),
        "dtype": str(dtype).replace("torch.", ""),
        "saved_layout": {
            "tensor_model_parallel_size": params.tensor_model_parallel_size,
            "pipeline_model_parallel_size": params.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": params.virtual_pipeline_model_parallel_size,
        },
    }
    with atomic_directory(out_dir) as tmp:
        if global_rank() == 0:
            (tmp / "model").mkdir()
            bridge.hf_pretrained.save_artifacts(tmp / "hf")
        if dist.is_initialized():
            dist.barrier()
        save_model(chunks, tmp / "model")
        if global_rank() == 0:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    return Path(out_dir)


def checkpoint_matches_source(checkpoint_dir: str | Path, hf_path: str | Path) -> tuple[bool, str]:
    """Whether ``checkpoint_dir`` is a complete conversion of ``hf_path`` (and why not)."""
    meta = read_meta(checkpoint_dir)
    if meta is None:
        return False, f"{checkpoint_dir} has no {META_FILE}"
    if meta.get("format_version") != FORMAT_VERSION:
        return False, f"format version {meta.get('format_version')} != {FORMAT_VERSION}"
    current = source_fingerprint(hf_path)
    for key in ("config_sha256", "weight_files"):
        if meta.get(key) != current[key]:
            return False, f"the source model changed ({key} differs)"
    return True, "matches"


def ensure_converted(hf_path: str | Path, out_dir: str | Path, params: MegatronParams | None, dtype: torch.dtype | None = None,
                     trust_remote_code: bool = False) -> Path:
    """Reuses ``out_dir`` if it is a complete conversion of ``hf_path``, else converts (again)."""
    ok, reason = checkpoint_matches_source(out_dir, hf_path) if Path(out_dir).exists() else (False, "missing")
    if global_rank() == 0:
        logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed, plain logging elsewhere
        if ok:
            logger.info(f"Reusing the converted checkpoint {out_dir} (it matches {hf_path}).")
        elif reason == "missing":
            logger.info(f"Converting {hf_path} to a Megatron-Core checkpoint in {out_dir} (once).")
        else:
            logger.warning(f"Re-converting {hf_path} into {out_dir}: {reason}.")
    if ok:
        return Path(out_dir)
    return convert_hf_to_megatron(hf_path, out_dir, params, dtype, trust_remote_code=trust_remote_code)


def load_bridge_for_checkpoint(checkpoint_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The bridge of a converted checkpoint, from its saved HF config/tokenizer (no source needed)."""
    return load_bridge(Path(checkpoint_dir) / "hf", trust_remote_code=trust_remote_code, config_only=True)


def build_from_checkpoint(checkpoint_dir: str | Path, params: MegatronParams, dtype: torch.dtype | None = None,
                          ddp_config: Any | None = None, trust_remote_code: bool = False,
                          schedule: str = "none") -> tuple[Any, list[torch.nn.Module]]:
    """(bridge, model chunks) for the current layout, weights loaded from ``checkpoint_dir/model``
    (``schedule``: the pipeline schedule the training engine runs)."""
    dtype = dtype or default_dtype()
    graphs = ddp_config is not None and cuda_graphs_enabled(params)  # training only (engine/kernels/cuda_graphs.py)
    init_model_parallel(ParallelSizes.from_params(params), cuda_graphs=graphs)
    bridge = load_bridge_for_checkpoint(checkpoint_dir, trust_remote_code)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=False), params, dtype, cuda_graphs=graphs,
                                  schedule=schedule)
    chunks = build_model_chunks(provider, ddp_config=ddp_config, load_hf_weights=False)
    load_model(chunks, Path(checkpoint_dir) / "model")
    if graphs:
        attach_cuda_graphs(chunks)
    return bridge, chunks


def save_hf(bridge: Any, chunks: list[torch.nn.Module], hf_artifacts: str | Path, out_dir: str | Path) -> Path:
    """Collective: writes an HF folder (config, safetensors, tokenizer, generation config) atomically.

    ``hf_artifacts`` is the folder whose tokenizer / generation config files are copied along.
    """
    with atomic_directory(out_dir) as tmp:
        bridge.save_hf_pretrained([unwrap(c) for c in chunks], tmp, show_progress=False, source_path=str(hf_artifacts))
        if global_rank() == 0:
            _drop_tied_output_weight(tmp)
    return Path(out_dir)


def _drop_tied_output_weight(folder: Path) -> None:
    """Megatron-Bridge writes ``lm_head.weight`` even for models with tied embeddings (Qwen2-0.5B,
    Llama-3.2-1B, ...), whose HF checkpoints hold only ``model.embed_tokens.weight``. Remove it so the
    export has exactly the tensors of the model it came from (transformers re-ties on load)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        return
    name = "lm_head.weight"
    removed = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if name not in f.keys():
                continue
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        removed += tensors.pop(name).nbytes
        save_file(tensors, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if removed and index.is_file():
        data = json.loads(index.read_text())
        data.get("weight_map", {}).pop(name, None)
        if "total_size" in data.get("metadata", {}):
            data["metadata"]["total_size"] -= removed
        index.write_text(json.dumps(data, indent=2))


def export_to_hf(checkpoint_dir: str | Path, out_dir: str | Path, params: MegatronParams | None = None) -> Path:
    """Exports a converted (or trained) Megatron checkpoint to an HF folder.

    ``checkpoint_dir`` is a ``megatron_checkpoint/`` folder or a training checkpoint (which holds the
    same ``model/`` and ``hf/``). Collective over the layout in ``params`` (default: one rank).
    """
    params = params or _default_params()
    meta = read_meta(checkpoint_dir) or {}
    dtype = getattr(torch, meta.get("dtype", "")) if meta.get("dtype") else default_dtype()
    bridge, chunks = build_from_checkpoint(checkpoint_dir, params, dtype=dtype)
    return save_hf(bridge, chunks, Path(checkpoint_dir) / "hf", out_dir)

