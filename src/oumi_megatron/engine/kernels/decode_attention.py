"""A decode step's keys and values into the static KV cache, and its attention over the slots each row has written
(Triton).

``write_decode_kv`` / ``rotate_and_write_decode_kv`` (``megatron.rollout_decode_kernels: auto`` and ``true``): one
kernel a layer writes the step's key and value at each row's slot, rotating the key (and the query, returned for the
layer's own attention) with the step's RoPE as engine/kernels/rope.py does, where the layer takes two RoPE kernels
and two index copies.

``decode_attention`` (``true`` only): a decode step is captured once as a CUDA graph, so its shapes are fixed and SDPA
attends over every slot of the cache under a mask. Here programs per (row, key/value head, ``SPLIT_SLOTS`` slots) read
the row's slots up to the one it writes this step (``last``, a device tensor: the graph replays with the cursor's
current value), skip the slots ``valid`` marks unused (left padding, a finished row's slots), and keep the softmax
online in fp32 (flash attention's recurrence); the group's query heads share each block of keys and values (GQA
without repeating them), and a second kernel combines the splits' partial softmaxes (flash decoding). Scores and
softmax in fp32 as SDPA's fused kernels: bf16 queries and keys multiply exactly into fp32 sums, and the probabilities
meet the values in the values' dtype, as SDPA's flash kernels do (fp32 caches: IEEE fp32 throughout). cuDNN's SDPA
streams the whole cache at ~75% of the HBM bandwidth and this kernel the slots in use at up to ~50%
(scripts/bench_decode_attention.py), so it wins only where rows reach a small part of a long cache.
"""

from __future__ import annotations

import torch

from oumi_megatron.engine.kernels.rope import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotated(x, partner, f, first, rotated):
        """``x`` rotated as engine/kernels/rope.py rotates it: x * cos(f) -/+ partner * sin(f) on the rotated dims
        (``first``: the first half's, where rotate_half negates the partner), x itself past them."""
        c = tl.cos(f)
        s = tl.sin(f)
        return tl.where(rotated, tl.where(first, x * c - partner * s, x * c + partner * s), x)

    @triton.jit
    def _load_biased(x_at, b_at, idx, mask, HAS_BIAS: tl.constexpr):
        """``x_at[idx]``, with the projection's bias ``b_at[idx]`` added and rounded as torch's ``output + bias`` stores
        the sum (a fused QKV projection run without its bias, rotate_and_write_decode_kv)."""
        x = tl.load(x_at + idx, mask=mask, other=0.0)
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(b_at + idx, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        return x

    @triton.jit(do_not_specialize=["heads_per_group", "slots", "last_stride", "head_dim", "q_row", "q_head", "f_row"])
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, last_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, f_ptr, scale,
                                 heads_per_group, slots, last_stride, head_dim, q_row, q_head, f_row,
                                 GROUPS: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, QB: tl.constexpr,
                                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, NARROW: tl.constexpr,
                                 HALF: tl.constexpr):
        row = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        h = tl.arange(0, QB)
        d = tl.arange(0, BLOCK_D)
        heads = GROUPS * heads_per_group
        h_in = h < heads_per_group
        d_in = d < head_dim
        # this group's query heads are group * heads_per_group + h (q strided: a view of the layer's QKV projection)
        q_at = row * q_row + (group * heads_per_group + h) * q_head
        q_mask = h_in[:, None] & d_in[None, :]
        q = tl.load(q_ptr + q_at[:, None] + d[None, :], mask=q_mask, other=0.0)
        if HALF > 0:  # the step's RoPE here, rounded to the query's dtype as the layer's rotation would store it
            rotated = d < 2 * HALF
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            q_p = tl.load(q_ptr + q_at[:, None] + partner[None, :], mask=q_mask & rotated[None, :], other=0.0)
            f = tl.load(f_ptr + row * f_row + d, mask=rotated, other=0.0).to(tl.float32)
            q = _rotated(q.to(tl.float32), q_p.to(tl.float32), f[None, :], (d < HALF)[None, :], rotated[None, :])
            q = q.to(q_ptr.dtype.element_ty)
        q = q.to(k_ptr.dtype.element_ty) if NARROW else q.to(tl.float32)
        # caches: [rows, groups, slots, dim] contiguous; this program: the slots [split * CHUNK, +CHUNK) up to the last
        base = (row * GROUPS + group) * slots * head_dim
        end = tl.minimum(tl.load(last_ptr + row * last_stride) + 1, split * CHUNK + CHUNK)
        m = tl.full((QB,), float("-inf"), tl.float32)
        total = tl.zeros((QB,), tl.float32)
        acc = tl.zeros((QB, BLOCK_D), tl.float32)
        for start in range(split * CHUNK, end, BLOCK_S):
            s = start + tl.arange(0, BLOCK_S)
            s_in = s < end
            used = tl.load(valid_ptr + row * slots + s, mask=s_in, other=0) != 0
            at = base + s[:, None] * head_dim + d[None, :]
            k = tl.load(k_ptr + at, mask=s_in[:, None] & d_in[None, :], other=0.0)
            v = tl.load(v_ptr + at, mask=s_in[:, None] & d_in[None, :], other=0.0)
            if not NARROW:
                k, v = k.to(tl.float32), v.to(tl.float32)
            # [QB, BLOCK_S]: products in fp32 (exact for bf16/fp16 operands; fp32 caches in IEEE fp32)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(used[None, :], scores, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # no slot of the block used yet: no exp(-inf + inf)
            alpha = tl.exp(m - safe_m)
            p = tl.exp(scores - safe_m[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if NARROW:  # the probabilities in the values' dtype, as SDPA's flash kernels take them
                acc = acc * alpha[:, None] + tl.dot(p.to(v_ptr.dtype.element_ty), v)
            elif IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m = new_m
        out_rows = row * heads + group * heads_per_group + h
        if SPLITS == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + out_rows[:, None] * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:  # this split's running max, sum and unnormalized output, for _combine_splits_kernel
            part = out_rows * SPLITS + split
            tl.store(m_ptr + part, m, mask=h_in)
            tl.store(l_ptr + part, total, mask=h_in)
            tl.store(acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=q_mask)

    @triton.jit(do_not_specialize=["head_dim"])
    def _combine_splits_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, head_dim, SPLITS: tl.constexpr,
                               SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per (row, query head): the splits' partial softmaxes rescaled to their common max and summed
        i = tl.program_id(0)
        sp = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, BLOCK_D)
        sp_in = sp < SPLITS
        d_in = d < head_dim
        m = tl.load(m_ptr + i * SPLITS + sp, mask=sp_in, other=float("-inf"))
        total = tl.load(l_ptr + i * SPLITS + sp, mask=sp_in, other=0.0)
        top = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))
        norm = tl.sum(total * w, axis=0)
        acc = tl.load(acc_ptr + (i * SPLITS + sp)[:, None] * head_dim + d[None, :], mask=sp_in[:, None] & d_in[None, :],
                      other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(norm > 0, norm, 1.0)
        tl.store(out_ptr + i * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d_in)

    @triton.jit(do_not_specialize=["slot_stride", "k_row", "k_group", "v_row", "v_group", "slots", "head_dim", "f_row",
                                   "q_row", "q_group", "q_head", "q_per_group", "heads", "b_group", "b_head"])
    def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, f_ptr, q_ptr, q_out_ptr, bq_ptr, bk_ptr,
                            bv_ptr, slot_stride, k_row, k_group, v_row, v_group, slots, head_dim, f_row, q_row, q_group,
                            q_head, q_per_group, heads, b_group, b_head, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
                            HALF: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(0)
        which = tl.program_id(1)  # a key/value head, or past GROUPS a query head to rotate (rotate_query)
        d = tl.arange(0, BLOCK_D)
        inside = d < head_dim
        rotated = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        if which >= GROUPS:  # the query head rotated as the layer would, into [rows, heads, dim] for SDPA
            head = which - GROUPS
            group = head // q_per_group  # the query's layout: [rows, groups, heads a group, dim] (flat: one group)
            in_group = head - group * q_per_group
            q_at = q_ptr + row * q_row + group * q_group + in_group * q_head
            bq_at = bq_ptr + group * b_group + in_group * b_head
            q = _load_biased(q_at, bq_at, d, inside, HAS_BIAS).to(tl.float32)
            q_p = _load_biased(q_at, bq_at, partner, rotated, HAS_BIAS).to(tl.float32)
            f = tl.load(f_ptr + row * f_row + d, mask=rotated, other=0.0).to(tl.float32)
            q = _rotated(q, q_p, f, d < HALF, rotated)
            tl.store(q_out_ptr + (row * heads + head) * head_dim + d, q.to(q_out_ptr.dtype.element_ty), mask=inside)
        else:
            group = which
            slot = tl.load(slot_ptr + row * slot_stride)
            at = ((row * GROUPS + group) * slots + slot) * head_dim + d
            k_at = k_ptr + row * k_row + group * k_group
            k = _load_biased(k_at, bk_ptr + group * b_group, d, inside, HAS_BIAS)
            if HALF > 0:  # the step's RoPE on the key, in fp32 as engine/kernels/rope.py, stored in the cache's dtype
                k_p = _load_biased(k_at, bk_ptr + group * b_group, partner, rotated, HAS_BIAS).to(tl.float32)
                f = tl.load(f_ptr + row * f_row + d, mask=rotated, other=0.0).to(tl.float32)
                k = _rotated(k.to(tl.float32), k_p, f, d < HALF, rotated)
            v = _load_biased(v_ptr + row * v_row + group * v_group, bv_ptr + group * b_group, d, inside, HAS_BIAS)
            tl.store(k_cache_ptr + at, k.to(k_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(v_cache_ptr + at, v, mask=inside)


# Tuned on an H100 (scripts/bench_decode_attention.py sweeps them: 64-slot blocks over 2 warps and 512-slot splits were
# the fastest across 32-256 rows and 192-1024 slots; 4 warps over 64-slot blocks took 2-3x longer; stages made no
# difference).
BLOCK_S = 64
"""Cache slots a program reads per iteration."""
SPLIT_SLOTS = 512
"""Cache slots per program: a longer cache is split over programs (flash decoding), whose partial softmaxes a second
kernel combines."""
NUM_WARPS = 2
NUM_STAGES = 2
MAX_HEAD_DIM = 256
"""The largest head dim whose block of keys and values a program holds."""
NARROW_PRODUCTS = True
"""bf16/fp16 caches: both products in the cache's dtype (fp32 sums, the probabilities rounded to the values' dtype, as
SDPA's flash kernels; 5-15% faster than TF32); False: TF32 (the operands widened to fp32). fp32 caches multiply in IEEE
fp32 either way."""


def _interpreting() -> bool:
    """Under Triton's CPU interpreter, whose tl.dot of bf16 operands is wrong (triton 3.6: a 16 x 16 product off by
    ~1e10), the products run in fp32 instead (the same values: bf16 products are exact in fp32); the GPU test runs the
    bf16 dots."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _freqs(freqs: torch.Tensor | None, rows: int, dim: int, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the rotary angles [rows or 1, rot] fp32, their row stride (0: shared), rot // 2), or a placeholder and 0: no
    rotation. ``freqs``: [1, 1 or rows, 1, rot], as Megatron-Core's layers take them for one decode step."""
    if freqs is None:
        return like, 0, 0
    rot = freqs.shape[-1]
    if freqs.shape[0] != 1 or freqs.shape[1] not in (1, rows) or rot % 2 or rot > dim:
        raise ValueError(f"decode kernels: rotary angles [1, 1 or {rows}, 1, rot <= {dim}, even], got {tuple(freqs.shape)}")
    f = freqs.reshape(freqs.shape[1], rot).float()
    if f.stride(-1) != 1:
        f = f.contiguous()
    return f, f.stride(0) if f.shape[0] > 1 else 0, rot // 2


QKVBias = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A fused QKV projection's bias as views of its [groups, (heads a group + 2) * dim] layout: the query's
[groups, heads a group, dim], the key's and the value's [groups, dim] (rollout/decoding/static_cache.py)."""


def write_decode_kv(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    slot: torch.Tensor, freqs: torch.Tensor | None = None) -> None:
    """A decode step's ``key``/``value`` [1, rows, groups, dim] into the caches [rows, groups, slots, dim] at each row's
    ``slot`` (long [rows], or [1] for every row): one kernel for both, where index_copy_ or scatter_ take one each.
    ``freqs`` (the step's rotary angles, see ``_freqs``): the key rotated on its way in, as the layer would."""
    _write(key, value, keys, values, slot, freqs, None, None)


def rotate_and_write_decode_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, slot: torch.Tensor, freqs: torch.Tensor,
                               bias: QKVBias | None = None) -> torch.Tensor:
    """``write_decode_kv`` with the key rotated by ``freqs``, and in the same kernel the step's ``query`` rotated as the
    layer would: returned as a new [1, rows, heads, dim] tensor for the layer's own attention over the cache. One
    kernel where the layer takes two RoPE kernels and two copies. ``query``: [1, rows, heads, dim], or the fused QKV
    projection's own [1, rows, groups, heads a group, dim] view (strided is fine: no copy). ``bias``: the projection's,
    where it ran without it: added to the query, key and value first, rounded as torch's add would store them."""
    out = _write(key, value, keys, values, slot, freqs, query, bias)
    assert out is not None
    return out


def _write(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor,
           freqs: torch.Tensor | None, query: torch.Tensor | None, bias: QKVBias | None) -> torch.Tensor | None:
    _, rows, groups, dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    f, f_row, half = _freqs(freqs, rows, dim, key)
    q, q_out, heads, per_group, q_group = key[0], None, 0, 1, 0  # no query: key[0] stands in, no program reads it
    if query is not None:
        if half == 0:
            raise ValueError("rotate_and_write_decode_kv: the query is rotated by the step's rotary angles (freqs)")
        q = query[0] if query.stride(-1) == 1 else query[0].contiguous()
        if q.dim() == 4:  # [rows, groups, heads a group, dim]
            per_group, q_group, heads = q.shape[2], q.stride(1), q.shape[1] * q.shape[2]
            q = q.select(1, 0)  # [rows, heads a group, dim]: row and head strides; the group's comes apart
        else:
            heads = per_group = q.shape[1]
        q_out = torch.empty(1, rows, heads, dim, dtype=q.dtype, device=q.device)
    bq, bk, bv = bias if bias is not None else (key, key, key)  # no bias: placeholders no program reads
    if bias is not None and (query is None or bq.shape != (groups, per_group, dim) or bk.shape != (groups, dim)
                             or bv.shape != (groups, dim) or len({b.stride(0) for b in bias}) != 1
                             or any(b.stride(-1) != 1 for b in bias)):
        raise ValueError(f"rotate_and_write_decode_kv: a bias of views [{groups}, {per_group}, {dim}], [{groups}, {dim}] "
                         f"x2 sharing a group stride, got {[tuple(b.shape) for b in bias]}")
    _cache_write_kernel[(rows, groups + heads)](
        key, value, keys, values, slot, f, q, key if q_out is None else q_out, bq, bk, bv,
        slot.stride(0) if slot.numel() > 1 else 0, key.stride(1), key.stride(2), value.stride(1), value.stride(2),
        keys.shape[2], dim, f_row, q.stride(0), q_group, q.stride(1), per_group, heads, bk.stride(0),
        bq.stride(1) if bias is not None else 0, GROUPS=groups, BLOCK_D=triton.next_power_of_2(dim), HALF=half,
        HAS_BIAS=bias is not None)
    return q_out


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     last: torch.Tensor, scale: float, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per row: ``query`` [1, rows, heads, dim] over ``keys``/``values`` [rows, groups, slots, dim]
    (the static cache), row r attending to its slots s <= ``last[r]`` (``last``: long [rows], or [1] for every row)
    where ``valid[r, s]``; [1, rows, heads * dim]. ``freqs``: the query rotated first, as the layer would."""
    _, rows, heads, dim = query.shape
    groups, slots = keys.shape[1], keys.shape[2]
    if query.shape[0] != 1 or rows != keys.shape[0] or dim > MAX_HEAD_DIM or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"decode_attention: one query a row over contiguous caches of head dim <= {MAX_HEAD_DIM}, got "
                         f"query {tuple(query.shape)}, keys {tuple(keys.shape)}")
    q = query[0] if query.stride(-1) == 1 else query[0].contiguous()
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    f, f_row, half = _freqs(freqs, rows, dim, q)
    per_group = heads // groups
    splits = triton.cdiv(slots, SPLIT_SLOTS)
    block_d = max(16, triton.next_power_of_2(dim))
    # the splits' partials (fp32): running max and sum per (row, head, split), and the unnormalized outputs
    acc = torch.empty(rows * heads * splits, dim, dtype=torch.float32, device=query.device) if splits > 1 else out
    stats = torch.empty(2, rows * heads * splits, dtype=torch.float32, device=query.device) if splits > 1 else out
    _decode_attention_kernel[(rows, groups, splits)](
        q, keys, values, valid.view(torch.uint8), last, out, acc, stats[0], stats[1], f, scale, per_group, slots,
        last.stride(0) if last.numel() > 1 else 0, dim, q.stride(0), q.stride(1), f_row,
        GROUPS=groups, SPLITS=splits, CHUNK=SPLIT_SLOTS, QB=max(16, triton.next_power_of_2(per_group)),
        BLOCK_S=BLOCK_S, BLOCK_D=block_d, IEEE=keys.dtype == torch.float32,
        NARROW=NARROW_PRODUCTS and keys.dtype != torch.float32 and not _interpreting(), HALF=half, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if splits > 1:
        _combine_splits_kernel[(rows * heads,)](acc, stats[0], stats[1], out, dim, SPLITS=splits,
                                                SPLITS_P2=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d)
    return out.view(1, rows, heads * dim)
