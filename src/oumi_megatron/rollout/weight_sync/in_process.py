"""In-process buckets for colocated engines: the trainer's tensors go into an engine that lives in the trainer's own
process, without a copy to another process or a write to disk.

- vLLM (``rollout_placement: colocated``, rollout/vllm_backend.py): each rank loads its own TP shard of the whole model
  into its engine, tensor by tensor as the exporter yields them (engine/state/tp_shards.py: no gather over TP; for
  PP > 1 the other stages' shards by broadcast), or, for models that path cannot cut, the full tensors, of which vLLM
  keeps its shard. ``VllmInProcess`` decides which and hands the tensors to the engine host (rollout/vllm_engine.py
  ``VllmEngineHost.load_in_process``), which runs ``load_in_engine`` in its workers (in this process: uni /
  external_launcher).
- SGLang (``rollout_placement: colocated``, rollout/sglang_backend.py): the rank's HF tensors into its engine in buckets
  of ``weight_sync_bucket_mb`` (``update_weights_from_tensor``), in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.weight_sync.base import WeightSyncError
from oumi_megatron.rollout.weight_sync.stream import TimedPairs

if TYPE_CHECKING:
    from oumi_megatron.rollout.base import PolicyWeights

logger = logging.getLogger("oumi")


# -- vLLM: the engine's side (its workers, in this process) ----------------------------------------------------------
def rank_shards(llm: Any) -> tuple[str | None, tuple[int, int], int]:
    """Whether this rank's engine can load its own TP shards (``load_in_engine(..., shards=True)``), as ``(why not or
    None, the rows of the real vocabulary it holds, its TP rank)``."""

    def ask(worker: Any) -> tuple[str | None, tuple[int, int], int]:
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        model = worker.model_runner.model
        vocab = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)), None)
        why = "no vocabulary-parallel embedding" if vocab is None else None
        if worker.model_runner.model_config.quantization is not None:
            why = "a quantized engine"
        rows = (0, 0) if vocab is None else (vocab.shard_indices.org_vocab_start_index,
                                             vocab.shard_indices.org_vocab_end_index)
        return why, rows, get_tensor_model_parallel_rank()

    return llm.collective_rpc(ask)[0]


def load_in_engine(llm: Any, pairs: Iterable[tuple[str, torch.Tensor]], shards: bool, layerwise: bool) -> None:
    """The trainer's tensors, in this process. The executor runs in this process (uni / external_launcher), so
    ``pairs`` is consumed lazily: at most one exported tensor exists beside the engine's weights. ``shards``: each TP
    rank passes its own shards (engine/state/tp_shards.py), and vLLM's loaders take them as they are
    (``_loaders_take_own_shards``); else full tensors, of which vLLM keeps its shard.

    On GPU an unquantized model computes with its weights as loaded, so the tensors go straight into the parameters
    (one copy each, as verl's and TRL's colocated syncs do). vLLM's layerwise-reload session (each layer
    re-materialized, loaded, processed and copied back) is kept where loading is followed by processing
    (``layerwise``: vllm_stream.py ``processes_after_loading``): on CPU, which repacks linear weights (a bare
    ``load_weights`` fails there), and for quantized engines."""

    def load(worker: Any, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = worker.model_runner.model
        with _loaders_take_own_shards(model) if shards else contextlib.nullcontext():
            if layerwise:
                initialize_layerwise_reload(model)
            model.load_weights(pairs)
            if layerwise:
                finalize_layerwise_reload(model, worker.model_runner.model_config)

    llm.collective_rpc(load, args=(pairs,))
    llm.reset_prefix_cache()


@contextlib.contextmanager
def _loaders_take_own_shards(model: Any) -> Iterator[None]:
    """vLLM's loaders take a full tensor and cut their rank's block from it: ``tp_rank`` x the block's size (linear
    layers), the rows ``shard_indices`` names (vocabulary-parallel ones). Given the block itself, for the load only,
    each linear layer's rank is 0 (its cut is the whole block) and each vocabulary layer's range is all the rows given.
    The rank lives on the layer (its own loaders) and on each of its parameters (vLLM's parameter classes, which CPU
    engines use), including the copies that vLLM's layerwise reload re-creates them from (its restore metadata). A
    linear layer's ``tp_rank`` also decides which rank adds a row-parallel bias: all is restored before any forward."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    saved: list[tuple[Any, str, Any]] = []
    for m in model.modules():
        if isinstance(m, LinearBase):
            info = LAYERWISE_INFO.get(m)
            metas = list(info.restore_metadata[0].values()) if info is not None else []
            for holder in [m, *m.parameters(recurse=False), *metas]:
                if hasattr(holder, "tp_rank"):
                    saved.append((holder, "tp_rank", holder.tp_rank))
                    holder.tp_rank = 0
        elif isinstance(m, VocabParallelEmbedding):
            indices = m.shard_indices
            rows = indices.org_vocab_end_index - indices.org_vocab_start_index
            saved += [(m, "org_vocab_size", m.org_vocab_size), (m, "shard_indices", indices)]
            m.org_vocab_size = rows
            m.shard_indices = dataclasses.replace(indices, org_vocab_start_index=0, org_vocab_end_index=rows)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


# -- the trainer's side -----------------------------------------------------------------------------------------------
class VllmInProcess:
    """Colocated vLLM engines: every rank loads its own TP shard of the whole model into its engine (``weights.tp_shards``:
    no gather over TP, the other stages' shards over PP), tensor by tensor as they come (same process, same GPU: no
    buckets). Where the model or the engine cannot take shards (``shard_vocab``), every rank loads the full tensors.
    ``host``: the rank's engine host (rollout/vllm_engine.py ``VllmEngineHost``)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.shard_decision: tuple[bool, tuple[int, int]] | None = None  # see shard_vocab

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        vocab = self.shard_vocab(weights)
        pairs = TimedPairs(weights() if vocab is None else weights.tp_shards(vocab))
        self.host.load_in_process(pairs, shards=vocab is not None)
        return WeightSyncStats("in_memory" if vocab is None else "in_memory_shards", pairs.tensors, pairs.bytes, 0.0,
                               export_seconds=pairs.seconds)

    def shard_vocab(self, weights: PolicyWeights) -> tuple[int, int] | None:
        """Decided at the first sync, the same on every rank: this rank's engine's vocabulary rows when every engine
        loads TP shards, else None (full tensors), with the reason logged once."""
        if self.shard_decision is None:
            why, vocab, engine_rank = self.host.rank_shards()
            from megatron.core import parallel_state as ps

            if why is None and engine_rank != ps.get_tensor_model_parallel_rank():
                why = f"the engine's TP rank {engine_rank} is not Megatron's {ps.get_tensor_model_parallel_rank()}"
            whys: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(whys, why)
            why = next((w for w in whys if w is not None), None) or weights.tp_shards_unsupported()
            if why is not None and dist.get_rank() == 0:
                logger.warning("colocated weight sync: every rank loads the whole model (no TP shards: %s)", why)
            self.shard_decision = (why is None, vocab)
        return self.shard_decision[1] if self.shard_decision[0] else None


class SglangInProcess:
    """Colocated SGLang engines: the rank's HF tensors into its engine in buckets, in memory (Megatron TP 1: a rank
    holds the whole model). ``engine``: the rank's ``sglang.Engine``."""

    def __init__(self, engine: Any, bucket_bytes: int) -> None:
        self.engine, self.bucket_bytes = engine, bucket_bytes

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        pairs = TimedPairs(weights())
        bucket: list[tuple[str, torch.Tensor]] = []
        size, limit = 0, self.bucket_bytes
        for name, tensor in pairs:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                self._update(bucket, flush=False)
                bucket, size = [], 0
        self._update(bucket, flush=False)
        self.engine.flush_cache()  # prefixes cached under the old weights must not be reused
        return WeightSyncStats("in_memory", pairs.tensors, pairs.bytes, 0.0, export_seconds=pairs.seconds)

    def _update(self, bucket: list[tuple[str, torch.Tensor]], flush: bool) -> None:
        ok, message = self.engine.update_weights_from_tensor(bucket, flush_cache=flush) if bucket else (True, "")
        if not ok:
            raise WeightSyncError(f"SGLang refused the weights: {message}")
