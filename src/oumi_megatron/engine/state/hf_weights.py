"""The policy's weights under their Hugging Face names: the one exporter every consumer uses.

``HFWeightExporter`` streams ``(hf_name, tensor)`` through Megatron-Bridge, collectively over the training ranks:
``__call__`` the whole model on every rank (gathered over TP / PP / EP: full tensors), ``stage_tensors`` each pipeline
stage's own tensors on that stage's ranks (gathered over TP / EP only; nothing crosses stages). ``save`` writes an HF
folder from ``stage_tensors``, each stage's ranks writing their own shards (engine/state/hf_writer.py). The trainer owns
one and hands it to the rollout backend's ``sync_weights`` (rollout/base.py), whose transport (rollout/weight_sync/)
streams it (vLLM workers over NCCL / gloo, in-process buckets) or has it saved (``weight_sync_method: checkpoint``);
the final export (output_dir/hf_model) goes through ``save`` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.state.hf_writer import save_hf_folder
from oumi_megatron.engine.wrappers import unwrap
from oumi_megatron.utils.atomic import HF_ADAPTER, HF_MODEL

if TYPE_CHECKING:
    from oumi_megatron.engine.peft import AdapterWeights


class HFWeightExporter:
    """``(hf_name, tensor)`` for the whole model, on every rank (collective over the training ranks).

    Bridge's conversion plan (which Megatron parameter becomes which HF tensors) is built on the first
    call and reused: the parameters are updated in place, so the plan stays valid, and rebuilding it
    each time is most of the export's cost on a small model. With LoRA adapters on the chunks (engine/peft.py) each
    adapted weight is exported merged, W + alpha/r B A (Bridge's merge, TP-aware); without them merging (another
    per-call plan) is off."""

    def __init__(self, bridge: Any, chunks: list[torch.nn.Module], hf_artifacts: str | Path | None = None,
                 max_shard_size: int | str = "5GB", peft: Any = None, base_model: str = "") -> None:
        """``hf_artifacts``: the folder whose config / tokenizer files ``save`` copies along (the converted
        checkpoint's ``hf/``); ``max_shard_size``: of ``save``'s safetensors files (``megatron.hf_max_shard_size``);
        ``peft``: the LoRA the chunks carry (engine/peft.py; None: none), exported merged into the base weights, and
        alone by ``adapters``; ``base_model``: the HF model they apply to (``model.model_name``)."""
        self.bridge, self.chunks, self.hf_artifacts, self.max_shard_size = bridge, chunks, hf_artifacts, max_shard_size
        self.peft, self.base_model = peft, base_model
        self.merge_adapters = peft is not None
        self._base_only = False  # save(base=True): the frozen base weights, adapters left out
        self.models = [unwrap(c) for c in chunks]
        self.tasks: list[Any] | None = None
        self.own_tasks: list[Any] | None = None
        self.stripped_configs: dict[tuple[int, int, int], tuple[Any, Any]] = {}  # see _strip_each_config_once

    def _build_tasks(self) -> list[Any]:
        # what export_hf_weights builds when given none (the public get_conversion_tasks insists on
        # HF weights, which our config-only bridge does not hold)
        return self.bridge._model_bridge.build_conversion_tasks(self.bridge.hf_pretrained, self.models)

    def _all_tasks(self) -> list[Any]:
        if self.tasks is None:
            self.tasks = self._build_tasks()
        return self.tasks

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with _strip_each_config_once(self.stripped_configs):
            yield from self.bridge.export_hf_weights(self.models, cpu=False, show_progress=False,
                                                     conversion_tasks=self._all_tasks(),
                                                     merge_adapter_weights=self.merge_adapters)

    def _stage_tasks(self) -> list[Any]:
        """The tasks of the parameters this stage holds; a parameter several stages hold (shared weights of some
        architectures) is the lowest such stage's, as in Bridge's own broadcast. Task objects of their own, not the
        whole-model export's: a mapping settles what it learns over the stages (AutoMapping's parallelism type) on its
        first use, and one used here by its own stage alone would skip that collective in a whole-model export that
        the other stages still enter (a hang at PP > 1 when ``__call__`` follows ``stage_tensors``)."""
        if self.own_tasks is None:
            from megatron.core import parallel_state as ps

            mine = [t for t in self._build_tasks() if t is not None and t.megatron_module is not None]
            lower: set[str] = set()
            if ps.get_pipeline_model_parallel_world_size() > 1:
                names: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
                dist.all_gather_object(names, [t.global_param_name for t in mine],
                                       group=ps.get_pipeline_model_parallel_group())
                lower = {n for stage in names[:ps.get_pipeline_model_parallel_rank()] for n in stage}
            self.own_tasks = [t for t in mine if t.global_param_name not in lower]
        return self.own_tasks

    def stage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` of this pipeline stage's own parameters, full tensors on every rank of the stage
        (collective over the stage's TP / EP groups; no stage waits for another)."""
        from megatron.core import parallel_state as ps

        tasks = self._stage_tasks()
        within = ps.get_pipeline_model_parallel_world_size() == 1
        with _strip_each_config_once(self.stripped_configs), (contextlib.nullcontext() if within else _stage_local()):
            for name, tensor in self.bridge.export_hf_weights(self.models, cpu=False, show_progress=False,
                                                              conversion_tasks=tasks,
                                                              merge_adapter_weights=self.merge_adapters and not self._base_only):
                # unmerged, an adapted layer's base weight comes under PEFT's name for it (``q_proj.base_layer.weight``)
                yield (name.replace(".base_layer.", ".") if self.peft is not None else name), tensor

    def tp_shards_unsupported(self) -> str | None:
        """Why ``tp_shards`` cannot serve this model (None: it can); the same answer on every rank (collective)."""
        from oumi_megatron.engine.state.tp_shards import unsupported

        reasons: list[Any] = [None] * dist.get_world_size()
        mine = ("LoRA adapters are merged into gathered weights" if self.merge_adapters
                else unsupported(self.bridge, self._stage_tasks()))
        dist.all_gather_object(reasons, mine)
        return next((r for r in reasons if r is not None), None)

    def tp_shards(self, vocab: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, this rank's TP shard)`` for the whole model, no gather over TP (engine/state/tp_shards.py);
        ``vocab``: the rows of the real vocabulary this rank's engine holds. Collective over the TP and PP groups."""
        from oumi_megatron.engine.state.tp_shards import tp_shards

        yield from tp_shards(self._stage_tasks(), vocab)

    def adapters(self) -> AdapterWeights | None:
        """Collective: the LoRA adapter alone, whole, on every rank (None without LoRA): what ``hf_adapter/`` holds (and
        what an engine holding the base could take at a sync instead of the merged weights: not built yet)."""
        if self.peft is None:
            return None
        from oumi_megatron.engine.peft import adapter_weights

        return adapter_weights(self.bridge, self.chunks, self.peft, self.base_model)

    def save(self, folder: str | Path, base: bool = False) -> Path:
        """Collective: the weights as an HF folder (config, safetensors, tokenizer), written atomically, each
        pipeline stage's ranks writing that stage's shards; with LoRA, the adapters merged in, or (``base``) the frozen
        base weights alone."""
        if self.hf_artifacts is None:
            raise ValueError("HFWeightExporter.save needs hf_artifacts (the folder with the model's config and tokenizer)")
        from megatron.core import parallel_state as ps

        self._base_only = base
        try:
            return save_hf_folder(self.stage_tensors(), ps.get_pipeline_model_parallel_rank(), self.hf_artifacts, folder,
                                  self.max_shard_size)
        finally:
            self._base_only = False


# HF_MODEL, HF_ADAPTER (utils/atomic.py): the final export's folders in output_dir, the HF model (merged under LoRA, or
# its base) and the HF PEFT adapter, each marked as what it holds
EXPORTS = {None: (HF_MODEL,), "adapter_only": (HF_ADAPTER,), "adapter_and_base_model": (HF_ADAPTER, HF_MODEL),
           "merged": (HF_MODEL,)}
"""The folders each ``peft.peft_save_mode`` writes (None: full fine-tuning)."""


def export_folders(save_mode: str | None) -> tuple[str, ...]:
    return EXPORTS[save_mode]


def save_policy(weights: HFWeightExporter, out_dir: str | Path, save_mode: str | None) -> list[Path]:
    """Collective: the policy's final export into ``out_dir``, each folder atomic: ``hf_model/`` (full fine-tuning);
    under LoRA as ``peft.peft_save_mode`` says (``save_mode``): ``adapter_only`` ``hf_adapter/`` (an HF PEFT adapter on
    ``model.model_name``), ``adapter_and_base_model`` ``hf_adapter/`` and the base weights in ``hf_model/``, ``merged``
    ``hf_model/`` with the adapters merged in (plain transformers loads it)."""
    from oumi_megatron.engine.peft import save_adapter
    from oumi_megatron.utils.atomic import partial_path
    from oumi_megatron.utils.progress import Progress

    out = Path(out_dir)
    written = []
    for folder in export_folders(save_mode if weights.peft is not None else None):
        with Progress(f"Exporting {out / folder}", watch=partial_path(out / folder)) as progress:
            if folder == HF_ADAPTER:
                adapter = weights.adapters()
                assert adapter is not None
                written.append(save_adapter(adapter, out / folder))
            else:
                written.append(weights.save(out / folder, base=save_mode == "adapter_and_base_model"))
            progress.result = written[-1]
    return written


@contextlib.contextmanager
def _stage_local() -> Iterator[None]:
    """Bridge's mappings broadcast every tensor (and some metadata) from the pipeline stage that holds it to all the
    others. When each stage converts only the tensors it holds (``stage_tensors``), the holder is always the caller:
    the broadcasts become identity for the duration, and a tensor missing here is a bug, not something to wait for."""
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    def local(self: Any, value: Any, cache_key: str | None = None) -> Any:
        if value is None:
            raise RuntimeError(f"HF export: {getattr(self, 'megatron_param', '?')} is not on this pipeline stage")
        return value

    saved = MegatronParamMapping.broadcast_from_pp_rank, MegatronParamMapping.broadcast_obj_from_pp_rank
    MegatronParamMapping.broadcast_from_pp_rank = local
    MegatronParamMapping.broadcast_obj_from_pp_rank = local
    try:
        yield
    finally:
        MegatronParamMapping.broadcast_from_pp_rank, MegatronParamMapping.broadcast_obj_from_pp_rank = saved


@contextlib.contextmanager
def _strip_each_config_once(done: dict[tuple[int, int, int], tuple[Any, Any]]) -> Iterator[None]:
    """Megatron-Bridge strips the TransformerConfig of non-picklable attributes (a recursive walk of
    ~350 calls) for every fused QKV / gate-up tensor, to broadcast it over pipeline stages, and does so
    even without pipeline parallelism: about half of an export's host time. Here each config object is
    stripped once, and the stripped copy is kept in ``done`` (the exporter's, so across exports) and
    only read: Bridge reads the architecture from it (heads, groups, sizes), which training never
    changes, and itself reuses one copy across layers when PP > 1. scripts/bench_export_host.py (CPU,
    16 layers, 147 tensors, best of 100): 7.5-7.9 ms as is, 3.9-4.2 ms stripped once per export,
    3.6-3.7 ms once per exporter (the same as not stripping at all). Scoped to the export: Bridge's
    function is restored when the export ends."""
    from megatron.bridge.models.conversion import param_mapping

    original = param_mapping.remove_non_pickleables

    def strip_once(obj: Any, max_depth: int = 3, current_depth: int = 0) -> Any:
        key = (id(obj), max_depth, current_depth)
        if key in done and done[key][0] is obj:  # ``is``: the id of a freed object may be reused
            return done[key][1]
        result = original(obj, max_depth=max_depth, current_depth=current_depth)
        done[key] = (obj, result)  # keeps ``obj`` alive, so its id stays its own
        return result

    param_mapping.remove_non_pickleables = strip_once
    try:
        yield
    finally:
        param_mapping.remove_non_pickleables = original
