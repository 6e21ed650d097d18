"""Fused SwiGLU (one Triton kernel each way) for Megatron-Core's MLP on the local layer spec.

With ``bias_activation_fusion`` Megatron-Core's MLP calls ``bias_swiglu_impl``, whose kernels come from
torch.compile. On one GPU the training step is bound by the host launching kernels, and a compiled
function's call (guards, the AOT-autograd wrapper) costs more host time than the eager ops it replaces
(measured: the step got slower). :func:`fused_swiglu` has ``bias_swiglu_impl``'s signature and runs one
Triton kernel forward (``silu(a) * b`` in fp32 registers) and one backward, saving only the input,
as Megatron-Core's does. A bias, fp8 input storage, activation offloading and the CPU go to
Megatron-Core's own function.
"""

from __future__ import annotations

from typing import Any

import torch

from oumi_megatron.engine.kernels.rope import triton, triton_runs_on

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["cols", "x_row", "y_row"])  # one compilation per dtype (see rope.py)
    def _swiglu_fwd_kernel(x_ptr, y_ptr, cols, x_row, y_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < cols
        a = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_row + cols + c, mask=m, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
        tl.store(y_ptr + row * y_row + c, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["cols", "g_row", "x_row", "dx_row"])
    def _swiglu_bwd_kernel(g_ptr, x_ptr, dx_ptr, cols, g_row, x_row, dx_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < cols
        g = tl.load(g_ptr + row * g_row + c, mask=m, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_row + cols + c, mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = g * b * sig * (1.0 + a * (1.0 - sig))
        db = g * a * sig
        tl.store(dx_ptr + row * dx_row + c, da.to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dx_ptr + row * dx_row + cols + c, db.to(dx_ptr.dtype.element_ty), mask=m)


_BLOCK = 1024


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # x: [rows, 2f], contiguous
        rows, cols = x.shape[0], x.shape[1] // 2
        y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        _swiglu_fwd_kernel[(rows, triton.cdiv(cols, _BLOCK))](x, y, cols, x.stride(0), y.stride(0), BLOCK=_BLOCK)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        rows, cols = x.shape[0], x.shape[1] // 2
        dx = torch.empty_like(x)
        _swiglu_bwd_kernel[(rows, triton.cdiv(cols, _BLOCK))](
            g, x, dx, cols, g.stride(0), x.stride(0), dx.stride(0), BLOCK=_BLOCK
        )
        return dx


def fused_swiglu(x: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                 cpu_offload_input: bool = False) -> torch.Tensor:
    """``megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl``'s contract: x [..., 2f] -> [..., f]."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    if bias is not None or fp8_input_store or cpu_offload_input or not triton_runs_on(x):
        return bias_swiglu_impl(x, bias, fp8_input_store, cpu_offload_input)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.stride(-1) != 1 or flat.stride(0) != shape[-1]:
        flat = flat.contiguous()
    return _FusedSwiGLU.apply(flat).view(*shape[:-1], shape[-1] // 2)


def install_fused_swiglu() -> None:
    """Megatron-Core's MLP calls :func:`fused_swiglu` under ``bias_activation_fusion`` (idempotent).

    Megatron-Core binds ``bias_swiglu_impl`` into ``megatron.core.transformer.mlp`` at import; that one name
    is rebound (MoE experts keep Megatron-Core's own)."""
    from megatron.core.transformer import mlp

    mlp.bias_swiglu_impl = fused_swiglu
