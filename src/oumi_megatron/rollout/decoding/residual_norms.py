"""Each residual add of the static decoder's forwards fused into the RMSNorm after it, on Megatron-Core's own layers.

A ``TransformerLayer`` adds the attention's output to the residual stream (``self_attn_bda``), normalizes the sum
(``pre_mlp_layernorm``), adds the MLP's output (``mlp_bda``), and the next layer normalizes that
(``input_layernorm``): two elementwise kernels and two norms a layer, each reading the whole stream. Megatron-Core
lets a norm return ``(output, residual)``, the residual the layer carries on with. While ``fused_residual_norms`` is
entered, each add is deferred (the bias-dropout-add hands back the branch's output and leaves the residual with its
layer's ``_Pending``) and the norm after it runs engine/kernels/norms.py ``add_rms_norm``: the sum, rounded as the add
would store it, and its norm in one kernel. A chunk's last layer adds as before (its output leaves the chunk: the
final norm, or the next pipeline stage).

Only for the static decoder's generation (decoder.py, episodes.py; never training or the schedule path), in eval
mode, on layers whose norms are torch's RMSNorm and whose residual stays in the model's dtype
(``fused_residual_norms_reason``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from oumi_megatron.engine.kernels.norms import add_rms_norm


class _Pending:
    """The residual a deferred add left for the norm after it (one per layer: the two adds of a layer alternate)."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None


class _DeferredAdd:
    """In place of a layer's bias-dropout-add (called as ``bda(training, fused)(output_with_bias, residual, p)``):
    the branch's output (with its bias) goes on, the residual waits in ``pending`` for the next norm."""

    def __init__(self, pending: _Pending) -> None:
        self.pending = pending

    def __call__(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        if training:
            raise RuntimeError("fused residual norms run in generation (eval mode) only")
        return self._defer

    def _defer(self, output_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
               prob: float) -> torch.Tensor:
        out, bias = output_with_bias
        if self.pending.residual is not None:
            raise RuntimeError("fused residual norms: an add deferred twice without a norm between (layer order)")
        self.pending.residual = residual
        return out if bias is None else out + bias


class _AddNorm(torch.nn.Module):
    """The norm after a deferred add: ``(RMSNorm(x + residual), x + residual)``, which Megatron-Core's layer unpacks as
    (the norm's output, the residual to carry)."""

    def __init__(self, norm: torch.nn.RMSNorm, pending: _Pending) -> None:
        super().__init__()
        self.norm = norm
        self.pending = pending

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self.pending.residual
        if residual is None:
            raise RuntimeError("fused residual norms: a norm with no deferred add before it (layer order)")
        self.pending.residual = None
        eps = self.norm.eps if self.norm.eps is not None else torch.finfo(hidden.dtype).eps
        return add_rms_norm(hidden, residual, self.norm.weight, eps)


def fused_residual_norms_reason(chunks: list[Any], config: Any) -> str | None:
    """Why the residual adds cannot be fused into the norms of these model chunks (None: they can)."""
    if getattr(config, "fp32_residual_connection", False):
        return "fp32_residual_connection"
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in chunks:
        for layer in chunk.decoder.layers:
            if type(layer) is not TransformerLayer:  # a subclass (MoETransformerLayer) runs its own MLP path
                return f"{type(layer).__name__} layers"
            if not all(type(n) is torch.nn.RMSNorm for n in (layer.input_layernorm, layer.pre_mlp_layernorm)):
                return "norms other than torch's RMSNorm"
            if not isinstance(layer.pre_cross_attn_layernorm, IdentityOp):
                return "cross-attention layers"
            if getattr(layer, "recompute_input_layernorm", False) or getattr(layer, "recompute_pre_mlp_layernorm", False):
                return "recomputed norms (recompute_modules: layernorm)"  # Megatron-Core checkpoints a norm's one output
    return None


@contextlib.contextmanager
def fused_residual_norms(chunks: list[Any]) -> Iterator[None]:
    """Every layer's adds deferred into the norm after them while the block runs (not a chunk's last add); restored
    after. The caller checked ``fused_residual_norms_reason``."""
    saved: list[tuple[Any, str, Any]] = []

    def swap(layer: Any, name: str, new: Any) -> None:
        saved.append((layer, name, getattr(layer, name)))
        setattr(layer, name, new)

    try:
        for chunk in chunks:
            layers = list(chunk.decoder.layers)
            for i, layer in enumerate(layers):
                pending = _Pending()  # this layer's attention add -> its pre-MLP norm
                swap(layer, "self_attn_bda", _DeferredAdd(pending))
                swap(layer, "pre_mlp_layernorm", _AddNorm(layer.pre_mlp_layernorm, pending))
                if i + 1 < len(layers):  # its MLP add -> the next layer's input norm
                    after = _Pending()
                    swap(layer, "mlp_bda", _DeferredAdd(after))
                    swap(layers[i + 1], "input_layernorm", _AddNorm(layers[i + 1].input_layernorm, after))
        yield
    finally:
        for layer, name, original in reversed(saved):
            setattr(layer, name, original)
