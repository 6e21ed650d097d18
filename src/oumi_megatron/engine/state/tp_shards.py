"""The policy's weights as each tensor-parallel rank's own shard, under HF names: what a vLLM engine with the same TP
loads on that rank (the colocated placement), with no gather over TP.

Megatron and vLLM split a dense model's tensors alike: column-parallel tensors (q / k / v by query group, gate / up,
their biases) and row-parallel ones (o_proj, down_proj) in TP contiguous blocks, the rest (norms) whole. So rank r's HF
shard is a view of its own Megatron tensor: the fused QKV cut per local query group, fc1 cut into gate and up. The
vocabulary is split differently (Megatron pads it to a multiple of 128 x TP, vLLM to 64, and each cuts its own ranges),
so each rank gets its engine's rows from the ranks that hold them: one all-to-all over TP, V x H / TP bytes received.
For PP > 1 each stage's engine needs every stage's layers: a stage's ranks broadcast their shards over their pipeline
group (rank r of each stage to rank r of the others), so a rank receives the other stages' part of its TP slice.

Bytes per rank: the model / TP (plus the replicated norms), where ``HFWeightExporter.__call__`` gives every rank the
whole model. Dense models only: ``unsupported`` names what this path cannot cut (experts, output gates, bridges that
post-process their tensors), and the caller then uses the gathered export.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

VocabRows = tuple[int, int]
"""``(start, end)``: the rows of the real vocabulary that this rank's engine holds."""


def _mapping_types() -> tuple[type, type, tuple[type, ...]]:
    from megatron.bridge.models.conversion import param_mapping as pm

    whole = (pm.AutoMapping, pm.ColumnParallelMapping, pm.RowParallelMapping, pm.ReplicatedMapping, pm.DirectMapping)
    return pm.QKVMapping, pm.GatedMLPMapping, whole


def _engine_ignores_post_processing(model_bridge: Any) -> bool:
    """Whether the bridge leaves its exported tensors as converted, for what a vLLM engine loads. LlamaBridge's
    ``maybe_modify_converted_hf_weight`` only re-adds the ``rotary_emb.inv_freq`` buffers that old HF checkpoints
    persisted, which vLLM's loader skips (``AutoWeightsLoader.ROTARY_EMBEDS_UNUSED_WEIGHTS``): Llama models' shards
    are the same without it."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    override = type(model_bridge).maybe_modify_converted_hf_weight
    return override in (MegatronModelBridge.maybe_modify_converted_hf_weight, LlamaBridge.maybe_modify_converted_hf_weight)


def unsupported(bridge: Any, tasks: list[Any]) -> str | None:
    """Why this stage's ``tasks`` cannot be cut locally (None: they can). Exact mapping types: a subclass may change the
    values it exports (e.g. zero-centred norms)."""
    from torch.distributed.tensor import DTensor

    model_bridge = bridge._model_bridge
    if not _engine_ignores_post_processing(model_bridge):
        return f"{type(model_bridge).__name__} post-processes its exported tensors"
    qkv, gated, whole = _mapping_types()
    for task in tasks:
        kind = type(task.mapping)
        if kind not in (qkv, gated, *whole) or getattr(task.mapping, "is_grouped_export", False):
            return f"{task.global_param_name} is converted by {kind.__name__}"
        if getattr(task, "export_hook", None) is not None or getattr(task, "weight_dtype", None) is not None:
            return f"{task.global_param_name} has an export hook or dtype"
        if kind is qkv and getattr(task.megatron_module.config, "attention_output_gate", False):
            return "attention output gates"
        if isinstance(task.param_weight, DTensor):
            return f"{task.global_param_name} is a DTensor (FSDP)"
    return None


def _is_vocab(task: Any) -> bool:
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    return isinstance(task.megatron_module, VocabParallelEmbedding) or task.global_param_name.endswith(
        "output_layer.weight")


def _vocab_rows(local: torch.Tensor, wanted: list[VocabRows], tp_rank: int, group: Any) -> torch.Tensor:
    """This rank's engine rows (``wanted[tp_rank]``) of a vocabulary-parallel tensor, from the ranks that hold them:
    Megatron's rank q holds rows [q x n, (q + 1) x n) of its padded vocabulary, n = ``local.shape[0]``."""
    n = local.shape[0]
    held = (tp_rank * n, (tp_rank + 1) * n)

    def overlap(a: VocabRows, b: VocabRows) -> VocabRows:
        lo = max(a[0], b[0])
        return lo, max(lo, min(a[1], b[1]))

    if all(overlap((q * n, (q + 1) * n), w) == w for q, w in enumerate(wanted)):
        # every rank already holds its engine's rows (TP 1, or ranges that agree): a view, nothing sent, no copy
        return local[wanted[tp_rank][0] - held[0]:wanted[tp_rank][1] - held[0]]
    sends = [overlap(held, w) for w in wanted]
    send = torch.cat([local[lo - held[0]:hi - held[0]] for lo, hi in sends]).contiguous()
    mine = wanted[tp_rank]
    recv_sizes = [hi - lo for lo, hi in (overlap((q * n, (q + 1) * n), mine) for q in range(len(wanted)))]
    out = local.new_empty((mine[1] - mine[0], *local.shape[1:]))
    dist.all_to_all_single(out, send, recv_sizes, [hi - lo for lo, hi in sends], group=group)
    return out


def _local_hf(task: Any, tp: int, wanted: list[VocabRows], tp_rank: int, group: Any) -> list[tuple[str, torch.Tensor]]:
    qkv, gated, _ = _mapping_types()
    weight, hf = task.param_weight, task.mapping.hf_param
    if type(task.mapping) is qkv:
        config = task.megatron_module.config
        groups, per = config.num_query_groups // tp, config.num_attention_heads // config.num_query_groups
        head = config.kv_channels or config.hidden_size // config.num_attention_heads
        rest = tuple(weight.shape[1:])
        x = weight.view(groups, per + 2, head, *rest)  # Megatron's order: each group's queries, then its key, value
        return [(hf["q"], x[:, :per].reshape(-1, *rest)), (hf["k"], x[:, per].reshape(-1, *rest)),
                (hf["v"], x[:, per + 1].reshape(-1, *rest))]
    if type(task.mapping) is gated:
        gate, up = weight.chunk(2, dim=0)  # each rank's fc1 is [its gate block; its up block]
        return [(hf["gate"], gate), (hf["up"], up)]
    if _is_vocab(task):
        return [(hf, _vocab_rows(weight, wanted, tp_rank, group))]
    return [(hf, weight)]  # TP-split the same way in both (its block), or replicated (whole)


def stage_tp_shards(tasks: list[Any], vocab: VocabRows) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, this rank's shard)`` of this stage's ``tasks``; collective over the TP group (the vocabulary's
    all-to-all) and over nothing else."""
    from megatron.core import parallel_state as ps

    tp, tp_rank, group = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                          ps.get_tensor_model_parallel_group())
    wanted: list[Any] = [None] * tp
    dist.all_gather_object(wanted, tuple(vocab), group=group)
    with torch.no_grad():
        for task in tasks:
            yield from _local_hf(task, tp, wanted, tp_rank, group)


def tp_shards(tasks: list[Any], vocab: VocabRows) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, this rank's shard)`` for the whole model: this stage's own, and the other stages' from the rank of
    the same TP rank there (collective over the TP and the pipeline groups). Stages take turns, lowest first."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        yield from stage_tp_shards(tasks, vocab)
        return
    group, me = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(group)
    device = next((t.param_weight.device for t in tasks), torch.device("cpu"))
    for stage in range(pp):
        if stage == me:
            pairs = list(stage_tp_shards(tasks, vocab))  # views of the parameters, but for the vocabulary's rows
            dist.broadcast_object_list([[(n, tuple(t.shape), t.dtype) for n, t in pairs]], src=ranks[stage],
                                       group=group)
            for name, tensor in pairs:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=ranks[stage], group=group)
                yield name, tensor
        else:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=ranks[stage], group=group)
            for name, shape, dtype in box[0]:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=ranks[stage], group=group)
                yield name, tensor
