"""Fused rotary position embedding (one Triton kernel each way) for Megatron-Core's local layer spec.

Megatron-Core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) is about ten tensor ops per call
(cos, sin, casts, slicing, chunk/neg/cat for rotate-half, two multiplies, an add, a cat), called for the
query and the key of every layer, and as many again in backward. On one GPU the training step is
bound by the host launching kernels, so those ops cost far more than their arithmetic.

Megatron-Core calls ``rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`` when
``apply_rope_fusion`` is on (normally Transformer Engine's). :func:`fused_rope` has that signature: it
computes ``t * cos(freqs) + rotate_half(t) * sin(freqs)`` in fp32 registers in one pass over ``t``, and its
backward is the rotation by the opposite angle. Cases it does not cover (interleaved rotary, per-sample
the CPU) go to Megatron-Core's own unfused function, so the maths never changes silently. Frequencies per sample
(``[s, b, 1, rot]``: multi-turn episodes decode each row at its own position, rollout/decoding/episodes.py) are
covered: each (position, sample) program reads its own row of them.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Triton ships with PyTorch's CUDA wheels (and the CPU venv here); absent elsewhere
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


if triton is not None:

    # Sizes and strides are not specialized on: rollouts call this with many batch sizes and sequence
    # lengths, and each specialization is a compilation of its own (seconds each).
    @triton.jit(do_not_specialize=["heads", "batch", "t_s", "t_b", "t_h", "o_s", "o_b", "o_h", "f_s", "f_b"])
    def _rope_kernel(
        t_ptr, f_ptr, o_ptr,
        heads, batch,
        t_s, t_b, t_h,  # strides of t (the last dim is contiguous)
        o_s, o_b, o_h,
        f_s, f_b,  # strides of freqs (f_b: 0 where every sample shares them)
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
    ):
        # one program per (position, sample, block of heads); the rotated dims are [0, 2 * HALF)
        row = tl.program_id(0)
        s = row // batch
        b = row % batch
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        f1 = tl.load(f_ptr + s * f_s + b * f_b + d, mask=dmask, other=0.0).to(tl.float32)
        f2 = tl.load(f_ptr + s * f_s + b * f_b + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        cos1, sin1, cos2, sin2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
        mask = (h[:, None] < heads) & dmask[None, :]
        src = t_ptr + s * t_s + b * t_b + h[:, None] * t_h + d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transpose of the rotation: rotate_half^T(g * sin) + g * cos
            y1 = x1 * cos1[None, :] + x2 * sin2[None, :]
            y2 = x2 * cos2[None, :] - x1 * sin1[None, :]
        else:  # t * cos + rotate_half(t) * sin, rotate_half(x1, x2) = (-x2, x1)
            y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
            y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        dst = o_ptr + s * o_s + b * o_b + h[:, None] * o_h + d[None, :]
        tl.store(dst, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(o_ptr.dtype.element_ty), mask=mask)


def _rotate(t: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    """[s, b, h, d] rotated by freqs [s, 1 or b, 1, rot] (rot <= d, even); dims past rot are copied."""
    seq, batch, heads, dim = t.shape
    rot = freqs.shape[-1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if rot < dim:
        out[..., rot:] = t[..., rot:]
    f = freqs.reshape(freqs.shape[0], freqs.shape[1], rot)
    if f.stride(-1) != 1:
        f = f.contiguous()
    f_b = f.stride(1) if f.shape[1] > 1 else 0
    half = rot // 2
    block_h = min(16, triton.next_power_of_2(heads))
    grid = (seq * batch, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        t, f, out, heads, batch,
        t.stride(0), t.stride(1), t.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        f.stride(0), f_b,
        HALF=half, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(half), BACKWARD=backward,
    )
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        return _rotate(t, freqs, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (freqs,) = ctx.saved_tensors
        return _rotate(grad, freqs, backward=True), None


def fused_rope_covers(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> bool:
    """Whether :func:`fused_rope` computes this call itself (else Megatron-Core's unfused function does)."""
    return (
        not interleaved
        and t.dim() == 4
        and triton_runs_on(t)
        and freqs.dim() == 4
        and freqs.shape[0] == t.shape[0]
        and freqs.shape[1] in (1, t.shape[1])
        and freqs.shape[2] == 1
        and freqs.shape[-1] % 2 == 0
        and freqs.shape[-1] <= t.shape[-1]
        and not freqs.requires_grad
    )


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether this module's (and engine/kernels/swiglu.py's) Triton kernels can take ``t``: a CUDA tensor, or any
    tensor under Triton's CPU interpreter (``TRITON_INTERPRET=1``, which the CPU tests use)."""
    return triton_runs_on_device(t.device)


def triton_runs_on_device(device: torch.device) -> bool:
    """:func:`triton_runs_on` for tensors on ``device``."""
    import os

    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``rope_utils.fused_apply_rotary_pos_emb``'s contract: t [s, b, h, d], freqs [s, 1, 1, rot] (fp32), or
    [s, b, 1, rot] (a position per sample)."""
    if not fused_rope_covers(t, freqs, interleaved):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return _FusedRope.apply(t, freqs)


def install_fused_rope() -> None:
    """Megatron-Core's fused-RoPE hook -> :func:`fused_rope` (idempotent; ``apply_rope_fusion`` turns it on)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils.fused_apply_rotary_pos_emb = fused_rope
