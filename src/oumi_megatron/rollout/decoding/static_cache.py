"""A static KV cache written by the policy's own attention layers, with the decode position on the device.

Megatron-Core's ``StaticInferenceContext`` keeps the write position as a Python int, slices its cache by it
and re-applies RoPE to every cached key each step: every token is a new shape and a host decision, so a
decode step cannot be replayed as a CUDA graph. Here each layer's ``core_attention`` is wrapped, for the
duration of one generation, by :class:`CachedCoreAttention`: the layer's own projections, q/k norms and RoPE
run as in training (Megatron-Core's ``SelfAttention`` with no inference context), then the wrapper writes the
already-rotated key and the value into a preallocated cache at the slots the cursor names (device tensors) and
calls the layer's real core attention (SDPA or Megatron's local one) over the cache. Where the decode kernels run
(``megatron.rollout_decode_kernels``, engine/kernels/decode_attention.py), a decode step's RoPE moves out of the
layer into one kernel that rotates the query and writes the rotated key and the value (the cursor's ``rotary``), and
with ``true`` its attention too, reading each row's slots up to the one it writes (the cursor's ``valid`` marks
which it attends to) rather than every slot of the cache. With the query and key rotated there, ``KernelQKV`` hands
that kernel the fused QKV projection's own layout and leaves its bias to it (no query copy, no bias add). Nothing
in a decode step depends on a host value, so the whole step can be captured once and replayed.

Where a forward writes (``CacheCursor``):
- **one shared slot** (``slot``): single-turn decoding, every row's token at the same column;
- **a slot per row** (``row_slots``): multi-turn episodes, each row at its own next free slot (episodes.py);
- **a chunk per row of a group** (``chunk``): an episode's observation appended in one forward: the group's rows
  each write their chunk's tokens at their own slots, and attend over their own cache rows only.

Layout: [rows, kv heads of this TP rank, slots, head dim] per layer, which the core attention receives as
[slots, rows, heads, dim] views (no copy); slots are ``prompt width + max_new_tokens`` (a batch of episodes:
``episode_slots``, episodes.py). The cache lives for one generation (or batch of episodes) and is freed with it,
unless the decoder keeps it with its CUDA graph (decoder.py, ``rollout_cuda_graphs_kept``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oumi_megatron.engine.kernels.attention import SdpaCoreAttention
from oumi_megatron.engine.kernels.decode_attention import (
    QKVBias,
    decode_attention,
    rotate_and_write_decode_kv,
    write_decode_kv,
)


@dataclass
class ChunkWrite:
    """Where an append forward over ``rows`` (G cache rows, [C, G] tokens) writes: token j of group row i at cache row
    ``rows[i]``, slot ``slots[i, j]``."""

    rows: torch.Tensor
    """long [G]: the group's cache rows (its attention reads these rows only)."""
    flat_rows: torch.Tensor
    """long [G * C]: ``rows`` repeated per token, row-major like ``slots.flatten()``."""
    flat_slots: torch.Tensor
    """long [G * C]: ``slots`` [G, C] flattened."""


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
    row_slots: torch.Tensor | None = None
    """long [rows]: each row's own write slot for this decode step (multi-turn episodes); None: ``slot`` for all."""
    chunk: ChunkWrite | None = None
    """An append forward's writes: a group of rows, each with a chunk of tokens (None outside one)."""
    valid: torch.Tensor | None = None
    """bool [rows, slots]: the slots each row attends to (the generation's buffer, kept current in place). Set where
    the decoder resolved the decode attention kernel on (``megatron.rollout_decode_kernels``): decode steps attend
    through engine/kernels/decode_attention.py, which reads each row's slots up to the one it writes and no further,
    and their layers get no mask."""
    rotary: torch.Tensor | None = None
    """[1, 1 or rows, 1, rot] fp32: the decode step's rotary angles where the decode kernels rotate the query and key
    themselves (the layers then get none): the cache-write kernel rotates both, or with ``valid`` the cache-write and
    attention kernels; None: the layers rotated them."""


def rotating(c: CacheCursor) -> bool:
    """A decode step whose query and key the cache-write kernel rotates (rotate_and_write_decode_kv)."""
    return not c.prefill_repeat and c.chunk is None and c.valid is None and c.rotary is not None


def kernel_qkv_reason(attention: Any) -> str | None:
    """Why ``KernelQKV`` cannot stand in for this layer's ``get_query_key_value_tensors`` (None: it can)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    linear = attention.linear_qkv
    if type(linear) is not ColumnParallelLinear:  # an adapter's wrapper or another linear: its own forward
        return f"a {type(linear).__name__} QKV projection"
    if linear.skip_bias_add:
        return "a QKV projection that hands its bias on"
    if any(n is not None and not isinstance(n, IdentityOp) for n in (attention.q_layernorm, attention.k_layernorm)):
        return "q/k norms"
    if attention.config.num_query_groups < attention.world_size:
        return "fewer query groups than TP ranks"
    if getattr(attention.config, "attention_output_gate", False):
        return "gated attention output"
    if attention.config.test_mode:  # Megatron-Core's own method runs its realtime checks there
        return "test_mode"
    return None


class KernelQKV:
    """A layer's ``get_query_key_value_tensors`` for the decode steps whose cache write rotates (``rotating``): the
    fused QKV projection without its bias, split into views of it (the query [sq, b, groups, heads a group, dim]: no
    copy), and the bias left to the cache-write kernel, which adds it as torch's add would store the sum before it
    rotates. Megatron-Core's own method adds the bias in a kernel and copies the query out of the fused layout in
    another: two of a decode step's small kernels a layer. Every other forward (prefill, appends) takes the layer's
    own method."""

    def __init__(self, attention: Any, cursor: CacheCursor) -> None:
        self.attention = attention
        self.cursor = cursor
        self.own = attention.get_query_key_value_tensors
        self.groups = attention.num_query_groups_per_partition
        self.dim = attention.hidden_size_per_attention_head
        self.per_group = attention.num_attention_heads_per_partition // self.groups
        self.sizes = [self.per_group * self.dim, self.dim, self.dim]
        bias = attention.linear_qkv.bias
        self.bias: QKVBias | None = None
        if bias is not None:  # views of the parameter the optimizer updates in place
            q, k, v = bias.view(self.groups, -1).split(self.sizes, dim=-1)
            self.bias = (q.unflatten(-1, (self.per_group, self.dim)), k, v)

    def __call__(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                 output_gate: bool = False, split_qkv: bool = True) -> Any:
        if not rotating(self.cursor) or key_value_states is not None or output_gate or not split_qkv:
            return self.own(hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        linear = self.attention.linear_qkv
        linear.skip_bias_add = True  # Megatron-Core's own forward (TP, SP), returning the bias instead of adding it
        try:
            mixed, _ = linear(hidden_states)
        finally:
            linear.skip_bias_add = False
        query, key, value = mixed.unflatten(-1, (self.groups, -1)).split(self.sizes, dim=-1)
        return query.unflatten(-1, (self.per_group, self.dim)), key, value


class CachedCoreAttention(torch.nn.Module):
    """A layer's core attention over the static cache (the interface of Megatron's ``DotProductAttention``)."""

    def __init__(self, inner: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, cursor: CacheCursor,
                 qkv: KernelQKV | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.keys = keys
        self.values = values
        self.cursor = cursor
        self.qkv = qkv
        """The layer's projection where ``KernelQKV`` runs it: a decode step's query then arrives in the fused
        [1, rows, groups, heads a group, dim] layout, without the bias, which the cache-write kernel adds."""

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
        keys, values = self.keys, self.values
        last = c.row_slots if c.row_slots is not None else c.slot
        if c.chunk is None and c.valid is not None:  # a decode step on the decode kernels: write, then attend
            assert isinstance(self.inner, SdpaCoreAttention)  # the decoder resolves the kernel over SDPA layers only
            write_decode_kv(key, value, self.keys, self.values, last, c.rotary)
            return decode_attention(query, self.keys, self.values, c.valid, last, self.inner.softmax_scale, c.rotary)
        if rotating(c):  # a decode step whose query and key the cache write rotates
            assert c.rotary is not None
            bias = self.qkv.bias if self.qkv is not None and query.dim() == 5 else None  # KernelQKV left it out
            query = rotate_and_write_decode_kv(query, key, value, self.keys, self.values, last, c.rotary, bias)
        elif c.chunk is not None:  # [C, G, groups, dim]: the group's chunks, then attention over the group's rows
            for cache, new in ((self.keys, key), (self.values, value)):
                # [rows, slots, groups, dim] view: (row, slot) pairs index it, each taking a [groups, dim] vector
                cache.transpose(1, 2).index_put_((c.chunk.flat_rows, c.chunk.flat_slots), new.transpose(0, 1).flatten(0, 1))
            keys, values = self.keys.index_select(0, c.chunk.rows), self.values.index_select(0, c.chunk.rows)
        elif c.row_slots is not None:  # [1, rows, groups, dim]: row r at its own slot
            at = c.row_slots.view(-1, 1, 1, 1).expand(-1, key.shape[2], 1, key.shape[3])
            self.keys.scatter_(2, at, key.permute(1, 2, 0, 3))
            self.values.scatter_(2, at, value.permute(1, 2, 0, 3))
        else:
            self.keys.index_copy_(2, c.slot, key.permute(1, 2, 0, 3))
            self.values.index_copy_(2, c.slot, value.permute(1, 2, 0, 3))
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
    def attached(self, kernel_qkv: bool = False) -> Iterator[CacheCursor]:
        """Every layer's core attention reads and writes this cache while the block runs; restored after.
        ``kernel_qkv`` (the decode kernels rotate: ``DecodeKernels.rope``): ``KernelQKV`` projects the decode steps'
        query, key and value on the layers where it can (``kernel_qkv_reason``)."""
        originals = [a.core_attention for a in self.attentions]
        projected = []
        for a, (keys, values) in zip(self.attentions, self.layers):
            qkv = KernelQKV(a, self.cursor) if kernel_qkv and kernel_qkv_reason(a) is None else None
            if qkv is not None:
                a.get_query_key_value_tensors = qkv  # an instance attribute over the class's method
                projected.append(a)
            a.core_attention = CachedCoreAttention(a.core_attention, keys, values, self.cursor, qkv)
        try:
            yield self.cursor
        finally:
            for a, inner in zip(self.attentions, originals):
                a.core_attention = inner
            for a in projected:
                del a.get_query_key_value_tensors

