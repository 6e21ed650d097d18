"""A static KV cache written by the policy's own attention layers, with the decode position on the device.

Megatron-Core's ``StaticInferenceContext`` keeps the write position as a Python int, slices its cache by it
and re-applies RoPE to every cached key each step: every token is a new shape and a host decision, so a
decode step cannot be replayed as a CUDA graph. Here each layer's ``core_attention`` is wrapped, for the
duration of one generation, by :class:`CachedCoreAttention`: the layer's own projections, q/k norms and RoPE
run as in training (Megatron-Core's ``SelfAttention`` with no inference context), then the wrapper writes the
already-rotated key and the value into a preallocated cache at ``cursor.slot`` (a device tensor) and calls the
layer's real core attention (SDPA or Megatron's local one) over the cache. Nothing in a decode step depends
on a host value, so the whole step can be captured once and replayed.

Layout: [rows, kv heads of this TP rank, slots, head dim] per layer, which the core attention receives as
[slots, rows, heads, dim] views (no copy); slots are ``prompt width + max_new_tokens`` (a batch of episodes: one per
decode step of all its turns, episodes.py). The cache lives for one generation (or batch of episodes) and is freed with it,
unless the decoder keeps it with its CUDA graph (decoder.py, ``rollout_cuda_graphs_kept``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CacheCursor:
    """Where the running forward writes and reads the cache; one object shared by every layer."""

    slot: torch.Tensor
    """long [1] on the model's device: the cache slot of the token being decoded."""
    prefill_repeat: int = 0
    """Prefill (> 0): the prompt rows fill slots [0, width) and each row's keys/values go into this many adjacent
    cache rows (the completions of a GRPO group share their prompt's prefill)."""
    kv_len: int | None = None
    """Decode, eager: attend over the first ``kv_len`` slots. None: over every slot (CUDA graphs: a fixed shape;
    the mask hides the slots not written yet)."""


class CachedCoreAttention(torch.nn.Module):
    """A layer's core attention over the static cache (the interface of Megatron's ``DotProductAttention``)."""

    def __init__(self, inner: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, cursor: CacheCursor) -> None:
        super().__init__()
        self.inner = inner
        self.keys = keys
        self.values = values
        self.cursor = cursor

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        c = self.cursor
        if c.prefill_repeat:  # [width, prompts, heads, dim]: the prompts attend among themselves
            width = key.shape[0]
            for cache, new in ((self.keys, key), (self.values, value)):
                cache[:, :, :width] = new.permute(1, 2, 0, 3).repeat_interleave(c.prefill_repeat, dim=0)
            return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        self.keys.index_copy_(2, c.slot, key.permute(1, 2, 0, 3))
        self.values.index_copy_(2, c.slot, value.permute(1, 2, 0, 3))
        keys, values = self.keys, self.values
        if c.kv_len is not None:
            keys, values = keys[:, :, :c.kv_len], values[:, :, :c.kv_len]
        return self.inner(query, keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3), attention_mask,
                          attn_mask_type=attn_mask_type, attention_bias=attention_bias)


class StaticKVCache:
    """Keys and values of every attention layer of this rank for ``rows`` sequences of up to ``slots`` tokens."""

    def __init__(self, attentions: list[Any], rows: int, slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.attentions = attentions
        self.cursor = CacheCursor(slot=torch.zeros(1, dtype=torch.long, device=device))
        # zeros, not empty: a slot not written yet is multiplied by a zero attention weight, which must not meet a NaN
        self.layers = [
            (torch.zeros(rows, a.num_query_groups_per_partition, slots, a.hidden_size_per_attention_head,
                         dtype=dtype, device=device),
             torch.zeros(rows, a.num_query_groups_per_partition, slots, a.hidden_size_per_attention_head,
                         dtype=dtype, device=device))
            for a in attentions
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    @contextlib.contextmanager
    def attached(self) -> Iterator[CacheCursor]:
        """Every layer's core attention reads and writes this cache while the block runs; restored after."""
        originals = [a.core_attention for a in self.attentions]
        for a, (keys, values) in zip(self.attentions, self.layers):
            a.core_attention = CachedCoreAttention(a.core_attention, keys, values, self.cursor)
        try:
            yield self.cursor
        finally:
            for a, inner in zip(self.attentions, originals):
                a.core_attention = inner

