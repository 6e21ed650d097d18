"""The policy's model chunks run as one model for generation: embedding -> layers -> output layer, across the
pipeline ranks, on the weights the optimizer updates (nothing copied).

This is ``GPTModel.forward`` without its schedule and inference context, so that a decode step has fixed
shapes and no host decisions: the caller gives the rotary angles of the positions it runs (a row of a
precomputed table, picked on the device) and the attention mask, and each layer is Megatron-Core's own
``TransformerLayer`` (norms, projections, RoPE, MLP or MoE, residuals), its core attention reading the static
cache (static_cache.py). Under pipeline parallelism the hidden states travel stage to stage (and around the
ring for virtual stages) by point-to-point messages; the last stage returns the last position's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.wrappers import unwrap
from oumi_megatron.rollout.decoding.residual_norms import fused_residual_norms, fused_residual_norms_reason

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine
    from oumi_megatron.rollout.decoding.static_cache import CacheCursor, StaticKVCache


def unsupported_reason(model: Any) -> str | None:  # a GPTModel chunk
    """Why the static-cache decoder cannot run this model (then the backend uses Megatron-Core's schedule path)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    config = model.config
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention"
    if getattr(config, "use_mup", False):
        return "MuP logit scaling"
    if getattr(config, "no_rope_freq", None):
        return "layers without RoPE (no_rope_freq)"
    if model.position_embedding_type not in ("rope", "learned_absolute", "none"):
        return f"position_embedding_type={model.position_embedding_type}"
    if getattr(model, "mtp_process", False):
        return "multi-token prediction layers"
    for layer in model.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        if not isinstance(attention, SelfAttention) or not hasattr(attention, "core_attention"):
            return f"a layer without Megatron-Core's SelfAttention ({type(attention).__name__})"
        if getattr(attention.config, "attention_output_gate", False):
            return "gated attention output"
        if not isinstance(getattr(layer, "cross_attention", IdentityOp()), IdentityOp):
            return "cross-attention"
    return None


@dataclass(frozen=True)
class DecodeKernels:
    """Which of the decode step's Triton kernels run (``megatron.rollout_decode_kernels``; decoder.py decides)."""

    sampling: bool
    """engine/kernels/token_sampling.py picks the tokens (top-p below 1: torch's ops still)."""
    attention: bool
    """engine/kernels/decode_attention.py attends over the slots each row has reached (static_cache.py)."""
    why: str
    residual_norms: bool = False
    """rollout/decoding/residual_norms.py: each residual add fused into the RMSNorm after it (every forward of the
    generation: prefill, decode steps, appends)."""
    rope: bool = False
    """The step's RoPE inside the decode kernels (the layers get no rotary angles): the cache-write kernel rotates the
    key and the query (or, with ``attention``, the attention kernel the query), where the layers would rotate with
    engine/kernels/rope.py's arithmetic (``apply_rope_fusion``)."""

    def describe(self) -> str:
        kernels = [name for name, on in (("sampling", self.sampling), ("attention", self.attention),
                                         ("rope", self.rope), ("residual norms", self.residual_norms)) if on]
        return f"decode kernels: {' + '.join(kernels) or 'none'} ({self.why})"


class PolicyStages:
    """This rank's chunks of the policy, run front to back for generation."""

    kernels = DecodeKernels(False, False, "not resolved")
    """The decode step's own kernels; the decoder resolves them once (decoder.py ``resolve_decode_kernels``)."""

    def __init__(self, engine: MegatronEngine) -> None:
        from megatron.core import parallel_state as ps

        self.chunks = [unwrap(c) for c in engine.model]
        self.config = self.chunks[0].config
        self.device = engine.device
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.learned_positions = self.chunks[0].position_embedding_type == "learned_absolute"
        """The embedding adds learned absolute position embeddings (it reads position ids; RoPE models do not)."""
        self.attentions = [layer.self_attention for c in self.chunks for layer in c.decoder.layers]
        self.tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        if self.pp > 1:
            self.pp_group = ps.get_pipeline_model_parallel_group()
            self.next_rank = ps.get_pipeline_model_parallel_next_rank()
            self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
            self.last_rank = ps.get_pipeline_model_parallel_last_rank()

    @property
    def takes_additive_masks(self) -> bool:
        """Every core attention is the SDPA one, which takes a float additive mask as it is."""
        from oumi_megatron.engine.kernels.attention import SdpaCoreAttention

        return all(isinstance(a.core_attention, SdpaCoreAttention) for a in self.attentions)

    def rope_in_decode_kernels_reason(self) -> str | None:
        """Why the decode kernels cannot rotate the query and key themselves (None: they can, with the arithmetic of
        engine/kernels/rope.py, which every layer here rotates with)."""
        from megatron.core.models.common.embeddings import rope_utils

        from oumi_megatron.engine.kernels.rope import fused_rope

        c = self.config
        if getattr(self.chunks[0], "rotary_pos_emb", None) is None:
            return "no rotary embedding"
        if not c.apply_rope_fusion or rope_utils.fused_apply_rotary_pos_emb is not fused_rope:
            return "apply_rope_fusion off"
        if c.rotary_interleaved or getattr(c, "fused_single_qkv_rope", False) or getattr(c, "mrope_section", None):
            return "interleaved, fused-QKV or multimodal rotary"
        if any(getattr(a, "_yarn_concentration_factor", 1.0) != 1.0 for a in self.attentions):
            return "YaRN's attention scaling"
        return None

    def fused_residual_norms_reason(self) -> str | None:
        """Why the residual adds cannot be fused into the norms after them here (None: they can)."""
        return fused_residual_norms_reason(self.chunks, self.config)

    @contextlib.contextmanager
    def generating(self, cache: StaticKVCache) -> Iterator[CacheCursor]:
        """The layers as a generation's forwards run them: attending through ``cache`` and, where the decode kernels
        fuse them (``kernels.residual_norms``), each residual add in the norm after it; restored after."""
        fused = fused_residual_norms(self.chunks) if self.kernels.residual_norms else contextlib.nullcontext()
        with cache.attached(kernel_qkv=self.kernels.rope) as cursor, fused:
            yield cursor

    def unsupported_reason(self) -> str | None:
        return next((r for r in (unsupported_reason(c) for c in self.chunks) if r), None)

    @property
    def is_moe(self) -> bool:
        return bool(getattr(self.config, "num_moe_experts", None))

    def rotary_table(self, slots: int) -> torch.Tensor | None:
        """[slots, 1, 1, dim] fp32 rotary angles of positions 0 .. slots - 1 (the whole table: under CP too)."""
        rotary = getattr(self.chunks[0], "rotary_pos_emb", None)
        return None if rotary is None else rotary.get_emb(slots).to(self.device)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None, mask: torch.Tensor | None,
                rotary: torch.Tensor | None, last: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [rows, vocab] (the model's dtype; the whole vocabulary, every TP rank) at the last of ``ids``' positions
        (``last``: long [rows], each row's own position) on the last pipeline stage; None on the others. ``mask``: True
        where attention is not allowed (None: a decode step on the decode attention kernel, which reads the validity)."""
        rows, width = ids.shape
        hidden: torch.Tensor | None = None
        for chunk in self.chunks:
            if chunk.pre_process:
                hidden = chunk.embedding(input_ids=ids, position_ids=position_ids)
            else:
                hidden = torch.empty(width, rows, self.config.hidden_size, dtype=self.config.pipeline_dtype,
                                     device=self.device)
                dist.recv(hidden, src=self.prev_rank, group=self.pp_group)
            assert hidden is not None
            for layer in chunk.decoder.layers:
                # nn.Module.__call__, not MegatronModule.__call__: with training CUDA graphs (cuda_graph_impl: local)
                # the latter would replay the layer's fixed-shape training graph
                hidden, _ = torch.nn.Module.__call__(layer, hidden, attention_mask=mask, rotary_pos_emb=rotary)
            if chunk.post_process:
                if last is None:
                    return self._logits(chunk, hidden[-1:])
                return self._logits(chunk, hidden.gather(0, last.view(1, rows, 1).expand(1, rows, hidden.shape[-1])))
            dist.send(hidden.contiguous(), dst=self.next_rank, group=self.pp_group)
        return None

    def _logits(self, chunk: Any, hidden: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        if chunk.decoder.final_layernorm is not None:
            hidden = chunk.decoder.final_layernorm(hidden)
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        logits, _ = chunk.output_layer(hidden, weight=weight)
        if self.tp_group is not None:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())
        return logits[0]

    def share_from_last_stage(self, *tensors: torch.Tensor) -> None:
        """The last stage's values of ``tensors`` (in place) on every rank of the pipeline."""
        if self.pp > 1:
            for t in tensors:
                dist.broadcast(t, src=self.last_rank, group=self.pp_group)
