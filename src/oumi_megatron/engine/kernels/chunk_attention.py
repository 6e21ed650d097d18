"""Causal attention of one query chunk against every key up to its end, on flash kernels (CP > 1 on CUDA).

Under context parallelism a rank's query chunk starts at position ``first`` and its query ``i`` sees keys
``0 .. first + i`` (engine/parallel/context_parallel.py). SDPA has no fused kernel that skips the masked half of that
rectangle: with a boolean or lower-right causal mask it computes all of it (measured ~300 TFLOP/s on an H100 against
~560 for flash on squares and unmasked rectangles; docs/benchmarks.md). So, as ring attention does, it runs as two
flash calls, the prefix keys ``[0, first)`` without a mask and the diagonal block ``[first, first + n)`` causal,
merged by their log-sum-exp. The backward runs flash's backward on each piece with the merged output and
log-sum-exp (the softmax of the whole row; each piece's own would be wrong) and sums the query gradients.
"""

from __future__ import annotations

from typing import Any

import torch

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward


def flash_chunk_attention_applies(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`prefix_causal_attention` can run: CUDA, half precision, no dropout, flash head sizes."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256)


class _PrefixCausalFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int,  # noqa: ANN401
                scale: float | None) -> torch.Tensor:
        pieces = ([(slice(0, first), False)] if first else []) + [(slice(first, k.shape[2]), True)]
        runs = []
        for keys, causal in pieces:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _flash_forward(
                q, k[:, :, keys], v[:, :, keys], 0.0, causal, False, scale=scale)
            runs.append((keys, causal, out, lse, cum_q, cum_k, max_q, max_k, seed, offset))
        if len(runs) == 1:
            out, lse = runs[0][2], runs[0][3]
        else:  # softmax over both pieces: weights exp(lse_piece - lse_row)
            (o1, l1), (o2, l2) = ((r[2], r[3]) for r in runs)
            lse = torch.logaddexp(l1, l2)
            out = (o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runs = [(keys, causal, cum_q, cum_k, max_q, max_k, seed, offset)
                    for keys, causal, _, _, cum_q, cum_k, max_q, max_k, seed, offset in runs]
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # noqa: ANN401
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for keys, causal, cum_q, cum_k, max_q, max_k, seed, offset in ctx.runs:
            gq, gk, gv = _flash_backward(grad_out, q, k[:, :, keys], v[:, :, keys], out, lse, cum_q, cum_k,
                                         max_q, max_k, 0.0, causal, seed, offset, scale=ctx.scale)
            dq += gq
            dk[:, :, keys], dv[:, :, keys] = gk, gv
        return dq.to(q.dtype), dk, dv, None, None


def prefix_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int,
                            scale: float | None = None) -> torch.Tensor:
    """Attention of ``query`` [b, h, n, d] (positions ``first .. first + n - 1``) over ``key``/``value``
    [b, h_kv, first + n, d] (positions ``0 .. first + n - 1``), query ``i`` seeing keys ``<= first + i``.
    Grouped-query attention (h a multiple of h_kv) runs natively in the flash kernel."""
    if key.shape[2] != first + query.shape[2]:
        raise ValueError(f"prefix_causal_attention: {key.shape[2]} keys for queries at {first} .. {first + query.shape[2] - 1}")
    return _PrefixCausalFlash.apply(query, key, value, first, scale)
