"""The policy's model as the embedded backend generates with it: the engine's own chunks, in another mode.

- ``generation_mode``: eval mode, no autograd, no sequence parallelism, whole sequences on every context-parallel rank
  (``whole_sequences``): the static-cache decoder (decoder.py, episodes.py) runs its steps inside it.
- ``last_token_logits`` with ``new_kv_cache``: Megatron-Core's forward-only pipeline schedule over left-padded rows,
  with its ``StaticInferenceContext`` (the ``schedule`` path) or without (``recompute``): the reference the static path
  is tested against, and the fallback for models it does not cover (rollout/megatron_backend.py).
- ``forward_peers_done``: under expert parallelism a generation loop stops only when its expert peers are done too.

The engine (engine/engine.py) runs the schedule and owns the model's flags; this module is what generation asks of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.engine import forward_only
from oumi_megatron.engine.parallel.sequence_parallel import sequence_parallel_off
from oumi_megatron.engine.wrappers import unwrap

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine


@contextlib.contextmanager
def generation_mode(engine: MegatronEngine) -> Iterator[None]:
    """The model as token-by-token generation runs it: eval mode, no autograd, no sequence parallelism, whole sequences
    on every CP rank (``whole_sequences``)."""
    for chunk in engine.model:
        chunk.eval()
    with torch.no_grad(), sequence_parallel_off(engine.model, engine.config), whole_sequences(engine):
        yield


@contextlib.contextmanager
def whole_sequences(engine: MegatronEngine) -> Iterator[None]:
    """Generation under CP: each CP rank runs whole sequences (a KV cache holds whole sequences), so the attention skips
    its K/V gather, the rotary table is not sliced per CP rank, and pipeline messages carry whole sequences (the engine
    scales the length Megatron-Core divides by CP: ``cp_whole_sequences``). The CP ranks of a DP replica generate the
    same tokens (same seeds), redundantly."""
    cp = engine.config.context_parallel_size
    if cp == 1:
        yield
        return
    from oumi_megatron.engine.kernels.attention import SdpaCoreAttention

    attention = [m for chunk in engine.model for m in chunk.modules() if isinstance(m, SdpaCoreAttention)]
    rotary = [r for r in (getattr(unwrap(chunk), "rotary_pos_emb", None) for chunk in engine.model) if r is not None]
    groups = [r.cp_group for r in rotary]

    def clear_rotary_cache() -> None:  # RotaryEmbedding.forward is lru_cached on its arguments, not on cp_group
        for r in rotary:
            getattr(type(r).forward, "cache_clear", lambda: None)()

    for m in attention:
        m.cp_size = 1
    for r in rotary:
        r.cp_group = None
    clear_rotary_cache()
    engine.config.context_parallel_size = 1
    engine.cp_whole_sequences = cp
    try:
        yield
    finally:
        engine.config.context_parallel_size = cp
        engine.cp_whole_sequences = 1
        for m in attention:
            m.cp_size = cp
        for r, g in zip(rotary, groups):
            r.cp_group = g
        clear_rotary_cache()


# -- Megatron-Core's schedule path ------------------------------------------------------------------------------------
def _generation_microbatches(rows: int) -> tuple[int, int]:
    """(microbatches, padded rows) for a generation forward: with PP > 1 one microbatch per stage, so stages overlap
    (and the interleaved schedule, which needs at least PP, runs)."""
    from megatron.core import parallel_state as ps

    m = ps.get_pipeline_model_parallel_world_size()
    return m, -(-rows // m) * m


def new_kv_cache(rows: int, max_sequence_length: int) -> Any:
    """A Megatron-Core static KV cache for ``rows`` sequences of up to ``max_sequence_length`` tokens (each rank caches
    keys/values of its own layers and TP heads)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(max_batch_size=_generation_microbatches(rows)[1], max_sequence_length=max_sequence_length)


@forward_only
def last_token_logits(engine: MegatronEngine, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor, kv_cache: Any = None) -> torch.Tensor:
    """Full-vocabulary logits (fp32) at the last position of each row, on every rank.

    ``attention_mask`` is True where attention is not allowed: [b, 1, s, s] (causal + padding), which lets left-padded
    prompts be batched, or with a ``kv_cache`` (``new_kv_cache``) holding the earlier tokens [b, 1, s, cached + s]. With
    a cache the call appends these ``s`` tokens to it.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    for chunk in engine.model:
        chunk.eval()
    rows = input_ids.shape[0]
    m, padded = _generation_microbatches(rows)
    tensors = [input_ids, position_ids, attention_mask]
    if padded > rows:  # repeat the last row to fill the microbatches; its outputs are dropped
        tensors = [torch.cat([t, t[-1:].expand(padded - rows, *t.shape[1:])]) for t in tensors]
    size = padded // m
    batches = [{"input_ids": tensors[0][i : i + size], "position_ids": tensors[1][i : i + size],
                "attention_mask": tensors[2][i : i + size]} for i in range(0, padded, size)]
    with whole_sequences(engine):
        captured = engine.last_position_logits(batches, kv_cache)
    if kv_cache is not None:
        kv_cache.increment_sequence_len_offset(input_ids.shape[1])
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    if last_stage:  # the last stage's (vocab-parallel) logits, gathered over TP
        last = torch.cat([captured[i] for i in range(m)])
        last = tensor_parallel.gather_from_tensor_model_parallel_region(last.contiguous())
    vocab = engine.from_last_stage(torch.tensor([last.shape[-1] if last_stage else 0], device=engine.device))
    if not last_stage:
        last = torch.empty(padded, int(vocab.item()), dtype=torch.float32, device=engine.device)
    return engine.from_last_stage(last)[:rows]


# -- expert parallelism -----------------------------------------------------------------------------------------------
def expert_peers() -> int:
    """Ranks whose forward passes pair with this rank's: expert parallelism exchanges tokens between EP ranks (other
    data-parallel replicas) by all-to-all in every MoE layer, so they must run the same number of forwards, whatever
    their own batches need (1 without EP)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size()


def forward_peers_done(engine: MegatronEngine, done: bool) -> bool:
    """Whether ``done`` holds on this rank and on all its expert peers (a collective over them; no communication without
    EP). Generation loops stop on it, so that no peer waits in an all-to-all."""
    if expert_peers() == 1:
        return done
    from megatron.core import parallel_state as ps

    flag = torch.tensor([0 if done else 1], dtype=torch.long, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    return int(flag.item()) == 0
