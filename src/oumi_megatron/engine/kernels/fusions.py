"""Megatron-Core's fusions on the local (non-TransformerEngine) layer spec, supplied from PyTorch and Triton.

With TransformerEngine or apex, Megatron-Core fuses the weight-gradient GEMM with the accumulation into
the fp32 ``main_grad``, RoPE and SwiGLU. Neither can be installed on our GPU machines. On one GPU the
step is bound by the host launching kernels (measured: the GPU idles a quarter of the step), so each
fusion here is there to cut launches as much as bytes:

- ``gradient_accumulation_fusion``: Megatron-Core's linear layers call apex's
  ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output, main_grad)``. We hand them
  :class:`TorchWgradAccumulation`, which does the same with one ``torch.addmm`` (bf16 inputs, fp32
  accumulation into ``main_grad`` in the GEMM's epilogue on CUDA). Without it every linear layer writes
  a bf16 weight gradient that Megatron's DDP hook then adds to ``main_grad``.
- ``apply_rope_fusion``: one Triton kernel each way for the query's and the key's rotation
  (engine/kernels/rope.py), through Megatron-Core's ``fused_apply_rotary_pos_emb`` hook.
- ``bias_activation_fusion``: one Triton kernel each way for SwiGLU (engine/kernels/swiglu.py), through the
  MLP's ``bias_swiglu_impl``.

Each is a ``megatron.transformer_config`` field with Megatron-Core's name: ``null`` (default) = on with
CUDA where the model allows it, off on the CPU (CPU runs are fp32 parity tests); ``true`` / ``false``
force it, so a regression can be bisected.
"""

from __future__ import annotations

from typing import Any

import torch

from oumi_megatron.engine.parallel.zero_bubble import WeightGradStore

FUSIONS = ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion")


class TorchWgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` interface in PyTorch: ``main_grad += grad_output^T @ input``,
    run at once or, inside a ZB-H1 backward pass, queued as deferred W work (engine/parallel/zero_bubble.py)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        WeightGradStore.put(total_input, grad_output, main_grad, accumulate_wgrad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        WeightGradStore.put(total_input, grad_output, main_grad, accumulate_wgrad)


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (fp32 accumulation of bf16 operands on CUDA, in the GEMM)."""
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if x.dtype == main_grad.dtype:
        main_grad.addmm_(g.t(), x)
    elif main_grad.is_cuda:  # bf16 x bf16 -> fp32 accumulate (cuBLAS), no bf16 weight gradient in memory
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:  # the mixed-dtype addmm is CUDA-only
        main_grad.add_((g.t() @ x).to(main_grad.dtype))


def install_torch_wgrad_accumulation() -> None:
    """Let Megatron-Core's linear layers run ``gradient_accumulation_fusion`` without apex (idempotent)."""
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False) or getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
        layers._grad_accum_fusion_available = True


def resolve_fusions(t: Any, cuda: bool, zero_bubble: bool = False) -> dict[str, bool]:
    """{fusion: on} for ``megatron.transformer_config`` ``t`` (null = on with CUDA; gradient accumulation
    fusion also on the CPU under the zb_h1 schedule, which defers the weight gradients it computes)."""
    resolved = {name: cuda if getattr(t, name, None) is None else bool(getattr(t, name)) for name in FUSIONS}
    if zero_bubble:  # an explicit false under zb_h1 is refused where the schedule is resolved (engine/parallel/schedules.py)
        resolved["gradient_accumulation_fusion"] = True
    return resolved


def unsupported_reason(name: str, config: Any) -> str | None:  # TransformerConfig / GPTModelProvider
    """Why fusion ``name`` cannot run this model, or None."""
    import torch.nn.functional as F

    if name == "bias_activation_fusion":
        if not getattr(config, "gated_linear_unit", False) or getattr(config, "activation_func", None) is not F.silu:
            return "the MLP is not SwiGLU"
        offset = getattr(config, "glu_linear_offset", 0.0)
        if getattr(config, "activation_func_clamp_value", None) is not None or offset:
            return "a clamped or offset SwiGLU"
        if getattr(config, "add_bias_linear", False):
            return "biased linear layers"
    if name == "apply_rope_fusion":
        if getattr(config, "position_embedding_type", "rope") != "rope":
            return f"position_embedding_type={config.position_embedding_type}"
        if getattr(config, "multi_latent_attention", False) or getattr(config, "rotary_interleaved", False):
            return "multi-latent attention or interleaved rotary"
    return None


def apply_fusions(provider: Any, t: Any, cuda: bool, zero_bubble: bool = False) -> str:
    """Sets the fusions on a GPTModelProvider (installing their kernels); returns a description for the log."""
    from oumi_megatron.engine.kernels.rope import install_fused_rope
    from oumi_megatron.engine.kernels.swiglu import install_fused_swiglu

    install = {"gradient_accumulation_fusion": install_torch_wgrad_accumulation,
               "apply_rope_fusion": install_fused_rope, "bias_activation_fusion": install_fused_swiglu}
    resolved = resolve_fusions(t, cuda, zero_bubble)
    for name, on in resolved.items():
        reason = unsupported_reason(name, provider) if on else None
        if reason is not None:
            if getattr(t, name, None):
                raise ValueError(f"megatron.transformer_config.{name}: not available for {reason}; set it to null or false")
            resolved[name] = on = False  # automatic: left off for this model
        if on:
            install[name]()
        setattr(provider, name, on)
    return ", ".join(f"{name}={'on' if on else 'off'}" for name, on in resolved.items())
