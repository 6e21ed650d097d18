"""HF -> Megatron-Core conversion (once) and Megatron-Core -> HF export, through Megatron-Bridge.

A converted checkpoint folder (``output_dir/megatron_checkpoint/``) holds:

* ``model/``: the weights as a Megatron-Core distributed checkpoint (loads under any TP/PP/VPP layout);
* ``hf/``: the source model's config, tokenizer and generation config (what export and the bridge need);
* ``oumi_megatron.json``: where it came from (path, config hash, weight files) and how it was saved.

Both directions are collective (every rank calls them) and write atomically. Whether a conversion is reused is decided
once, by global rank 0, and a hub model is downloaded once per node (``ensure_converted``): per-node decisions
disagree when nodes hold their own copies of the model (their modification times differ), and half a world
converting while the other half builds the engine waits forever in mismatched collectives.
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
from oumi_megatron.engine.parallel.distributed import init_distributed, init_model_parallel
from oumi_megatron.engine.state.checkpoint_io import META_FILE, load_model, read_meta, save_model
from oumi_megatron.errors import UserInputError
from oumi_megatron.model_shape import download_problem
from oumi_megatron.utils.atomic import MEGATRON_CHECKPOINT, atomic_directory, partial_path
from oumi_megatron.utils.progress import Progress
from oumi_megatron.utils.ranks import first_failure, from_rank0, global_rank, local_rank

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.parallel.layout import ParallelLayout

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _resolve_local(hf_path: str | Path) -> Path:
    """A local folder for ``hf_path`` in this process (a hub name is resolved through the local HF cache / download)."""
    local = Path(hf_path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(hf_path)))
    except Exception as e:  # noqa: BLE001 - offline, gated, no such model: one line saying what it needs
        raise UserInputError(download_problem(str(hf_path), e)) from e


def resolve_source(hf_path: str | Path) -> Path:
    """Collective: a local folder for ``hf_path`` on every rank. A hub name is downloaded by each node's local rank 0
    while the other ranks wait, then found in the node's cache (one download per node, no rank asks the hub alone);
    a failed download stops every rank with its error."""
    local = Path(hf_path).expanduser()
    if local.is_dir() or not dist.is_initialized():
        return _resolve_local(hf_path)
    from huggingface_hub import snapshot_download

    found, problem = None, None
    if local_rank() == 0:
        try:
            found = snapshot_download(str(hf_path))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            problem = f"{download_problem(str(hf_path), e)} (rank {global_rank()})"
    problem = first_failure(problem)  # also the barrier: every node's download is done
    if problem is not None:
        raise UserInputError(problem)
    return Path(found or snapshot_download(str(hf_path), local_files_only=True))


def source_fingerprint(hf_path: str | Path, name: str | None = None) -> dict[str, Any]:
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
    return {"source": name or str(hf_path), "config_sha256": config_sha, "weight_files": [list(w) for w in weights]}


def _one_rank_default(layout: ParallelLayout | None, params: MegatronParams | None) -> tuple[ParallelLayout, MegatronParams]:
    """(layout, params) where a caller gives neither: the default params' layout (one rank, TP=PP=1); where it gives
    only params, their layout."""
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.parallel.layout import engine_layout

    params = params or MegatronParams()
    return (layout if layout is not None else engine_layout(params)), params


def convert_hf_to_megatron(
    hf_path: str | Path,
    out_dir: str | Path,
    layout: ParallelLayout | None = None,
    params: MegatronParams | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    source: Path | None = None,
) -> Path:
    """Converts an HF causal LM into a Megatron-Core distributed checkpoint at ``out_dir``.

    Collective over the ranks of ``layout``, the one resolved from ``params`` (default: one rank, TP=PP=1).
    ``trust_remote_code`` (``model.trust_remote_code``) lets transformers run the model folder's own
    configuration/modeling code; off by default. ``source``: ``hf_path``'s local folder where the caller resolved it
    (``resolve_source``).
    """
    layout, params = _one_rank_default(layout, params)
    dtype = dtype or default_dtype()
    init_model_parallel(layout)
    source = source or resolve_source(hf_path)
    with Progress(f"Reading {hf_path}'s weights for the conversion", reads=source):
        bridge = load_bridge(source, trust_remote_code=trust_remote_code)
        provider = configure_provider(bridge.to_megatron_provider(load_weights=True), params, dtype)
        chunks = build_model_chunks(provider, ddp_config=None, load_hf_weights=True)
    meta = {
        "format_version": FORMAT_VERSION,
        **(source_fingerprint(source, name=str(hf_path)) if global_rank() == 0 else {}),
        "dtype": str(dtype).replace("torch.", ""),
        "saved_layout": {
            "tensor_model_parallel_size": params.tensor_model_parallel_size,
            "pipeline_model_parallel_size": params.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": params.virtual_pipeline_model_parallel_size,
        },
    }
    with Progress(f"Writing the converted checkpoint {out_dir}", watch=partial_path(Path(out_dir))) as progress:
        with atomic_directory(out_dir, MEGATRON_CHECKPOINT) as tmp:
            if global_rank() == 0:
                (tmp / "model").mkdir()
                bridge.hf_pretrained.save_artifacts(tmp / "hf")
            if dist.is_initialized():
                dist.barrier()
            save_model(chunks, tmp / "model")
            if global_rank() == 0:
                (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        progress.result = Path(out_dir)
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


def ensure_converted(hf_path: str | Path, out_dir: str | Path, layout: ParallelLayout, params: MegatronParams,
                     dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> Path:
    """Collective: reuses ``out_dir`` if it is a complete conversion of ``hf_path``, else converts (again). Global rank 0
    decides, from its own view of the source model, and every rank follows (see the module docstring)."""
    init_distributed()
    source = resolve_source(hf_path)  # the download (once per node) before rank 0 looks at the files
    verdict = None
    if global_rank() == 0:
        verdict = checkpoint_matches_source(out_dir, source) if Path(out_dir).exists() else (False, "missing")
    ok, reason = from_rank0(verdict)
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
    return convert_hf_to_megatron(hf_path, out_dir, layout, params, dtype, trust_remote_code=trust_remote_code, source=source)


def load_bridge_for_checkpoint(checkpoint_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The bridge of a converted checkpoint, from its saved HF config/tokenizer (no source needed)."""
    return load_bridge(Path(checkpoint_dir) / "hf", trust_remote_code=trust_remote_code, config_only=True)


def build_from_checkpoint(checkpoint_dir: str | Path, layout: ParallelLayout, params: MegatronParams,
                          dtype: torch.dtype | None = None, ddp_config: Any | None = None,
                          trust_remote_code: bool = False, peft: Any = None) -> tuple[Any, list[torch.nn.Module]]:
    """(bridge, model chunks) for ``layout``, weights loaded from ``checkpoint_dir/model`` (the model is built for
    the layout's pipeline schedule). ``peft``: Megatron-Bridge's LoRA, applied after the base weights are loaded and
    before DDP wraps the chunks (engine/peft.py)."""
    from oumi_megatron.engine.peft import pre_wrap_hooks

    dtype = dtype or default_dtype()
    graphs = ddp_config is not None and cuda_graphs_enabled(params)  # training only (engine/kernels/cuda_graphs.py)
    init_model_parallel(layout, cuda_graphs=graphs)
    bridge = load_bridge_for_checkpoint(checkpoint_dir, trust_remote_code)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=False), params, dtype, cuda_graphs=graphs,
                                  schedule=layout.pipeline_schedule)
    model_dir = Path(checkpoint_dir) / "model"
    with Progress(f"Loading the model's weights from {model_dir}", reads=model_dir):
        if peft is not None:
            chunks = build_model_chunks(provider, ddp_config=ddp_config, load_hf_weights=False,
                                        pre_wrap_hooks=pre_wrap_hooks(peft, lambda bare: load_model(bare, model_dir)))
        else:
            chunks = build_model_chunks(provider, ddp_config=ddp_config, load_hf_weights=False)
            load_model(chunks, model_dir)
    if graphs:
        attach_cuda_graphs(chunks)
    return bridge, chunks


def save_hf(bridge: Any, chunks: list[torch.nn.Module], hf_artifacts: str | Path, out_dir: str | Path,
            max_shard_size: int | str = "5GB") -> Path:
    """Collective: writes an HF folder (config, safetensors, tokenizer, generation config) atomically, each pipeline
    stage's ranks writing their stage's shards (engine/state/hf_writer.py).

    ``hf_artifacts`` is the folder whose config / tokenizer / generation config files are copied along.
    """
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter

    with Progress(f"Exporting the HF model to {out_dir}", watch=partial_path(Path(out_dir))) as progress:
        progress.result = HFWeightExporter(bridge, chunks, hf_artifacts, max_shard_size).save(out_dir)
    return progress.result


def _saved_dtype(checkpoint_dir: Path) -> torch.dtype:
    """The dtype a checkpoint's weights were saved in: its meta's (conversions and training checkpoints record it),
    else its HF config's, else the device's default."""
    meta = read_meta(checkpoint_dir) or {}
    name = meta.get("dtype")
    if not name and (checkpoint_dir / "hf" / "config.json").is_file():
        config = json.loads((checkpoint_dir / "hf" / "config.json").read_text())
        name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else default_dtype()


def export_to_hf(checkpoint_dir: str | Path, out_dir: str | Path, layout: ParallelLayout | None = None,
                 params: MegatronParams | None = None) -> Path:
    """Exports a converted (or trained) Megatron checkpoint to an HF folder.

    ``checkpoint_dir`` is a ``megatron_checkpoint/`` folder or a training checkpoint (which holds the
    same ``model/`` and ``hf/``). Collective over the ranks of ``layout``, the one resolved from ``params``
    (default: one rank).
    """
    if "lora" in (read_meta(checkpoint_dir) or {}):
        raise UserInputError(f"{checkpoint_dir} is a LoRA run's checkpoint (its model/ holds the adapters alone): "
                             "export it with export_lora (oumi-megatron export does so by itself).")
    layout, params = _one_rank_default(layout, params)
    bridge, chunks = build_from_checkpoint(checkpoint_dir, layout, params, dtype=_saved_dtype(Path(checkpoint_dir)))
    return save_hf(bridge, chunks, Path(checkpoint_dir) / "hf", out_dir, params.hf_max_shard_size)


def base_identity(converted: Path | None) -> dict[str, Any]:
    """What names a LoRA run's frozen base: the converted checkpoint's folder and its source model's fingerprint."""
    meta = (read_meta(converted) or {}) if converted is not None else {}
    return {"checkpoint": str(Path(converted).resolve()) if converted is not None else None,
            **{k: meta.get(k) for k in ("source", "config_sha256", "weight_files")}}


def is_lora_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether ``checkpoint_dir`` is a LoRA run's training checkpoint (adapters alone, its base named in its meta)."""
    return "lora" in (read_meta(checkpoint_dir) or {})


def export_lora(checkpoint_dir: str | Path, out_dir: str | Path, layout: ParallelLayout | None = None,
                params: MegatronParams | None = None, save_mode: str | None = None) -> list[Path]:
    """Collective: a LoRA run's training checkpoint exported as its run's final export would be (``save_mode``, Oumi's
    ``peft_save_mode`` in lower case; default the run's): the folders ``hf_adapter/`` and / or ``hf_model/`` in
    ``out_dir``. The frozen base is the converted checkpoint the meta names, checked against its recorded fingerprint."""
    from oumi_megatron.config.lora import SAVE_MODES, LoraSettings
    from oumi_megatron.engine.peft import bridge_peft
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter, save_policy

    ckpt = Path(checkpoint_dir)
    meta = read_meta(ckpt) or {}
    if "lora" not in meta:
        raise UserInputError(f"{ckpt} is not a LoRA run's checkpoint (no 'lora' in its {META_FILE}).")
    lora = LoraSettings.from_json(meta["lora"])
    mode = save_mode or lora.save_mode
    if mode not in SAVE_MODES:
        raise UserInputError(f"--peft-save-mode {mode!r} is not one of {SAVE_MODES}.")
    base = meta.get("base") or {}
    base_dir = Path(str(base.get("checkpoint") or ""))
    if not base.get("checkpoint") or not (base_dir / "model").is_dir():
        raise UserInputError(f"{ckpt}'s adapters apply to the converted base {base.get('checkpoint')!r} ({base.get('source')}),"
                             " which is not there. Convert the same model there again (oumi-megatron convert --hf "
                             f"{base.get('source')} --out {base.get('checkpoint')}), or export from the run's own folder.")
    now = base_identity(base_dir)
    if any(now.get(k) != base.get(k) for k in ("config_sha256", "weight_files")):
        raise UserInputError(f"{base_dir} holds other weights than the base {ckpt}'s adapters were trained on "
                             f"({base.get('source')}): it was converted again from another model.")
    layout, params = _one_rank_default(layout, params)
    peft = bridge_peft(lora)
    bridge, chunks = build_from_checkpoint(base_dir, layout, params, dtype=_saved_dtype(base_dir), peft=peft)
    load_model(chunks, ckpt / "model", adapters_only=True)
    weights = HFWeightExporter(bridge, chunks, base_dir / "hf", params.hf_max_shard_size, peft=peft,
                               base_model=str(base.get("source") or ""))
    return save_policy(weights, out_dir, mode)

