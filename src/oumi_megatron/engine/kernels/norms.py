"""Norms for Megatron-Core's local (non-TransformerEngine) spec that also run under sequence parallelism.

Megatron-Core's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. Under sequence parallelism
the layer norms (and the final norm) see this rank's slice of the sequence, so their weights get a partial
gradient on each tensor-parallel rank: Megatron-Core sums the gradients of parameters marked
``sequence_parallel = True`` over the TP group in ``finalize_model_grads``. ``SequenceParallelTorchNorm``
is torch's norm with that mark. The q/k norms of Qwen3-style attention run after the column-parallel QKV
projection (the whole sequence, this rank's heads): ``TorchNorm`` leaves them unmarked, and Megatron-Core
sums their gradients over TP by name, with or without sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch

from oumi_megatron.engine.kernels.rope import triton

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


def _torch_norm(config: Any, hidden_size: int, eps: float) -> torch.nn.Module:
    for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, flag, False):
            raise ValueError(f"{flag} is not supported by torch's norms (Megatron-Core's local spec)")
    if config.normalization not in _NORMS:
        raise ValueError(f"normalization {config.normalization!r}: the local spec supports {sorted(_NORMS)}")
    return _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)


class TorchNorm:
    """torch's LayerNorm / RMSNorm for ``config.normalization``, built like Megatron-Core's norms (no mark).

    A class whose ``__new__`` returns torch's norm, not an instance: Megatron-Core's specs build classes (a plain
    function in a spec is returned as it is, not called)."""

    # misc: mypy wants __new__ to return an instance of the class; returning torch's norm is the point
    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        return _torch_norm(config, hidden_size, eps)


class SequenceParallelTorchNorm:
    """torch's norm whose parameters Megatron-Core treats as sequence-parallel (gradients summed over TP); a factory
    like ``TorchNorm``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norm = _torch_norm(config, hidden_size, eps)
        for p in norm.parameters():
            # Megatron-Core's mark, read by its gradient all-reduce; torch's Parameter does not declare it
            p.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def sequence_parallel_block_spec(layer_spec: Any, config: Any, vp_stage: int | None = None) -> Any:
    """The block spec of a local-spec model under sequence parallelism: the layer's norms replaced by
    ``SequenceParallelTorchNorm`` (q/k norms by ``TorchNorm``) and the final norm too (a block spec names it;
    a layer spec would get Megatron-Core's ``WrappedTorchNorm``), with this stage's number of layers."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = layer_spec.submodules
    layer.input_layernorm = SequenceParallelTorchNorm
    layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name, None) is not None and getattr(getattr(attention, name), "__name__", "") == "WrappedTorchNorm":
            setattr(attention, name, TorchNorm)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


# -- a residual add fused into the next RMSNorm (the static decoder's forwards, rollout/decoding/residual_norms.py) -----

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["cols", "eps"])
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr):
        # one program per row: sum = x + residual rounded to the stream's dtype (as torch's add stores it), then
        # RMSNorm of that rounded sum in fp32, as torch's rms_norm: sum * rsqrt(mean(sum^2) + eps) * weight
        row = tl.program_id(0)
        squares = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            m = c < cols
            x = tl.load(x_ptr + row * cols + c, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + row * cols + c, mask=m, other=0.0).to(tl.float32)
            s = (x + r).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * cols + c, s, mask=m)
            s = s.to(tl.float32)
            squares += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / cols + eps)
        for start in range(0, cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            m = c < cols
            s = tl.load(sum_ptr + row * cols + c, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * cols + c, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


ADD_NORM_BLOCK = 2048
"""Columns a program of ``add_rms_norm`` reads at once (a wider hidden size: two passes over its row, the second from
L2)."""


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) with ``weight``, x + residual) in one kernel, where torch takes an add and a norm: the
    sum rounded to ``residual``'s dtype first, as the add would store it (Triton: a CUDA device or the interpreter)."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")
    x, residual = x.contiguous(), residual.contiguous()
    cols = x.shape[-1]
    total = torch.empty_like(residual)
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(x.numel() // cols,)](x, residual, weight, total, out, cols, eps,
                                               BLOCK=min(ADD_NORM_BLOCK, triton.next_power_of_2(cols)))
    return out, total
