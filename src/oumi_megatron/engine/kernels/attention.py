"""Core attention for Megatron-Core's local (non-TransformerEngine) layer spec, through PyTorch SDPA.

Megatron-Core's local ``DotProductAttention`` materializes the [b, heads, s, s] score matrix (baddbmm,
masked softmax, bmm), after ``repeat_interleave`` of the K/V heads for GQA. Without TransformerEngine
(which cannot be installed on our GPU machines) that is the attention every layer runs.
``SdpaCoreAttention`` is a drop-in for it (same constructor, same [s, b, heads, head_dim] inputs and
[s, b, hidden] output) that calls ``torch.nn.functional.scaled_dot_product_attention``: on H100/H200
with torch 2.11 a fused kernel (cuDNN or flash), causal without a mask tensor, GQA native
(``enable_gqa``), no score matrix in memory.

Mask semantics are Megatron's (``FusedScaleMaskSoftmax``): a given boolean mask (True = may not attend)
is used as it is, e.g. the left-padding masks of generation and the block-diagonal masks of packed rows;
no mask with the causal type and more than one query is the square causal mask; no mask with a single
query (KV-cached decode) attends to every cached key.

Packed rows (``enable_sequence_packing``) can skip the mask: with ``packed_attention`` varlen (the CUDA
default in bf16/fp16) the engine hands the layers a ``PackedSeqParams`` in Megatron's ``sbhd`` format
(cumulative sequence lengths over the flattened [b x T] tokens; Megatron-Core's own ``thd`` branches
stay off) and ``SdpaCoreAttention`` calls torch's variable-length flash kernel
(``torch.nn.attention.varlen``): each sequence attends causally within itself, no [T x T] mask exists.

``attention_backend`` (``megatron.transformer_config``) picks the module: ``auto`` is SDPA on CUDA and
Megatron-Core's own ``DotProductAttention`` on the CPU (so CPU runs are bit-for-bit today's), ``sdpa``
and ``local`` force one. Configurations SDPA does not cover (sliding window, softmax offsets,
query-key layer scaling) fall back to ``local`` and the engine log says so.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from oumi_megatron.config.megatron_params import ATTENTION_BACKENDS, PACKED_ATTENTIONS
from oumi_megatron.config.problems import choices
from oumi_megatron.engine.wrappers import unwrap

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

# torch's own SDPA kernel set, named for every call: vLLM's CUDA platform module turns cuDNN SDPA off process-wide when
# it is imported (vllm/platforms/cuda.py, 0.26), and Megatron-Bridge imports vLLM through ModelOpt's vLLM plugin
# wherever vLLM is installed. Masked GQA calls (generation's prefill and decode steps) would then lose their fused
# kernel: flash takes no mask and memory-efficient no GQA, so the math kernel repeats K/V and upcasts to fp32.
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with torch's default kernels, whatever another library
    set process-wide (see ``_SDPA_BACKENDS``)."""
    with sdpa_kernel(_SDPA_BACKENDS):
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def sdpa_unsupported_reason(config: Any) -> str | None:  # TransformerConfig
    """Why SDPA cannot replace Megatron's local attention for this model, or None."""
    if getattr(config, "window_size", None) is not None:
        return "sliding-window attention"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={config.softmax_type}"
    if getattr(config, "apply_query_key_layer_scaling", False):
        return "apply_query_key_layer_scaling"
    return None


def resolve_attention_backend(requested: str, config: Any, cuda: bool) -> tuple[str, str]:
    """(backend that runs: 'sdpa' or 'local', why) for ``transformer_config.attention_backend``."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    cp = getattr(config, "context_parallel_size", 1) > 1
    if requested == "local" and cp:
        raise ValueError("megatron.transformer_config.attention_backend: local cannot run context parallelism "
                         "(Megatron-Core's DotProductAttention asserts CP = 1). Set attention_backend: auto or sdpa.")
    if requested == "local":
        return "local", "attention_backend: local"
    reason = sdpa_unsupported_reason(config)
    if reason is not None and cp:
        raise ValueError(f"context parallelism runs on the SDPA core attention, which does not cover {reason}. "
                         "Set megatron.context_parallel_size: 1.")
    if requested == "auto" and not cuda and not cp:
        return "local", "auto on CPU: Megatron-Core's DotProductAttention"
    if reason is not None:
        return "local", f"SDPA does not cover {reason}"
    if cp:
        return "sdpa", "torch SDPA with context parallelism (K/V all-gathered over the CP group)"
    return "sdpa", "torch SDPA" + (" (cuDNN/flash on CUDA)" if cuda else " (CPU kernel)")


class SdpaCoreAttention(torch.nn.Module):
    """``DotProductAttention``'s interface on ``scaled_dot_product_attention``."""

    def __init__(
        self,
        config: Any,  # TransformerConfig
        layer_number: int,
        attn_mask_type: Any,  # AttnMaskType
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        reason = sdpa_unsupported_reason(config)
        if reason is not None:  # the spec builder checks first; a direct use must not change the maths
            raise ValueError(f"SdpaCoreAttention does not support {reason}")
        self.config = config
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,  # [sq, b, heads, d]
        key: torch.Tensor,  # [sk, b, groups, d]
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,  # bool [b or 1, 1, sq, sk], True = masked out (or a float additive bias)
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            return self._varlen(query, key, value, packed_seq_params)
        if self.cp_size > 1:
            return self._context_parallel(query, key, value, attention_mask)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, sk = query.shape[0], key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]: views; SDPA's kernels take strided inputs with a unit last stride
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        if causal and sq != sk:
            raise ValueError("SdpaCoreAttention: a causal mask needs as many queries as keys")
        # SDPA: True = takes part; a float mask is an additive bias, used as it is (rollout/decoding/ builds one per
        # decode step instead of every layer converting the same boolean mask)
        mask = None if attention_mask is None else attention_mask if attention_mask.is_floating_point() else ~attention_mask
        dropout = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else nullcontext():
            out = sdpa(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=self.groups != self.heads,
            )
        # [b, h, sq, d] -> [sq, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], self.heads * out.shape[-1])

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> torch.Tensor:
        """CP > 1 (engine/parallel/context_parallel.py): this rank holds two chunks of the sequence; K/V are gathered
        over the CP group and each query chunk attends causally to the keys up to its own end (packed rows:
        ``attention_mask`` holds this rank's query rows against every key)."""
        from megatron.core import tensor_parallel

        from oumi_megatron.engine.kernels.chunk_attention import flash_chunk_attention_applies, prefix_causal_attention
        from oumi_megatron.engine.parallel.context_parallel import chunk_attention_bounds, gather_keys_values

        assert self.cp_group is not None  # cp_size > 1: built with a CP group
        sq, b = query.shape[:2]
        key, value = gather_keys_values(key, value, self.cp_group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        flash = attention_mask is None and flash_chunk_attention_applies(q, dropout)
        outs = []
        for rows, keys, first in chunk_attention_bounds(sq, self.cp_size, self.cp_group.rank()):
            n = rows.stop - rows.start
            if flash:  # two flash calls (prefix, causal diagonal): a masked SDPA computes the whole rectangle
                outs.append(prefix_causal_attention(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], first, self.softmax_scale))
                continue
            if attention_mask is None:  # query at position first + i sees keys 0 .. first + i (True = takes part)
                allowed = torch.arange(keys, device=q.device)[None, :] <= (first + torch.arange(n, device=q.device))[:, None]
            else:  # packed rows: [b, 1, local queries, all keys], causal within each sequence already
                allowed = ~attention_mask[:, :, rows, :keys]
            with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else nullcontext():
                outs.append(sdpa(
                    q[:, :, rows], k[:, :, :keys], v[:, :, :keys], attn_mask=allowed, dropout_p=dropout,
                    scale=self.softmax_scale, enable_gqa=self.groups != self.heads))
        out = torch.cat(outs, dim=2)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * out.shape[-1])

    def _varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: Any) -> torch.Tensor:
        """Packed rows: [s, b, heads, d] -> b x s tokens, causal within each sequence of ``packed.cu_seqlens_q``."""
        from torch.nn.attention.varlen import varlen_attn

        if packed.qkv_format != "sbhd" or self.dropout_p > 0:
            raise ValueError("SdpaCoreAttention: packed rows need PackedSeqParams(qkv_format='sbhd') and no attention dropout")
        sq, b = query.shape[:2]
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.shape[2], t.shape[3]) for t in (query, key, value))
        # window (-1, 0): causal; a tensor without return_aux (torch's signature has no overloads for its two returns)
        out = cast(torch.Tensor, varlen_attn(q, k, v, packed.cu_seqlens_q, packed.cu_seqlens_kv, packed.max_seqlen_q,
                                             packed.max_seqlen_kv, scale=self.softmax_scale, window_size=(-1, 0)))
        return out.view(b, sq, self.heads * out.shape[-1]).transpose(0, 1).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return {}  # no parameters (vanilla softmax only)


def check_attention(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.transformer_config``'s core attention and packed rows' attention."""
    t = config.megatron.transformer_config
    if t.attention_backend not in ATTENTION_BACKENDS:
        found.add("megatron.transformer_config.attention_backend",
                  f"unknown value {t.attention_backend!r}. Choose from {choices(ATTENTION_BACKENDS)}.")
    if t.packed_attention not in PACKED_ATTENTIONS:
        found.add("megatron.transformer_config.packed_attention",
                  f"unknown value {t.packed_attention!r}. Choose from {choices(PACKED_ATTENTIONS)}.")


def local_layer_spec_with_attention(provider: Any, backend: str) -> Any:
    """Megatron-Bridge's local layer spec for ``provider``, its core attention replaced by SDPA when
    ``backend == 'sdpa'``."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    spec = local_layer_spec(provider)
    if backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


def resolve_packed_attention(requested: str, core_attention: str, dtype: torch.dtype, cuda: bool,
                             cp: bool = False) -> tuple[str, str]:
    """('varlen' or 'mask', why) for ``transformer_config.packed_attention``."""
    if requested not in PACKED_ATTENTIONS:
        raise ValueError(f"megatron.transformer_config.packed_attention must be one of {PACKED_ATTENTIONS}, got {requested!r}")
    if requested == "mask":
        return "mask", "packed_attention: mask"
    missing = ("context parallelism (the varlen kernel does not take its chunks)" if cp else
               "the core attention is " + core_attention if core_attention != "SdpaCoreAttention" else
               "no GPU" if not cuda else
               f"{dtype} (the flash kernel takes bf16/fp16)" if dtype not in (torch.bfloat16, torch.float16) else None)
    if missing is None:
        return "varlen", "torch.nn.attention.varlen (flash), no mask"
    if requested == "varlen":
        raise ValueError(f"megatron.transformer_config.packed_attention: varlen cannot run here: {missing}. "
                         "Set packed_attention: auto or mask.")
    return "mask", f"block-diagonal mask ({missing})"


def cumulative_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32 [n + 1]) of packed rows ``segment_ids`` [b, T] flattened to b x T tokens: a new
    sequence starts at each row start and wherever the segment id changes (a row's padding, id < 0, is
    one more sequence whose outputs nobody reads). Computed on the host, before the batch travels."""
    b, length = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([b * length])]).to(torch.int32)


def core_attention_name(chunk: torch.nn.Module) -> str:
    """Class name of the core attention a model chunk runs (its first layer's), for logs, benchmarks and tests."""
    return type(unwrap(chunk).decoder.layers[0].self_attention.core_attention).__name__
