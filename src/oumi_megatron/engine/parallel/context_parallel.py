"""Context parallelism without TransformerEngine: the sequence split over CP ranks, K/V all-gathered.

Megatron-Core's context parallelism lives in TransformerEngine's attention (ring attention), which cannot
be installed here, and its local ``DotProductAttention`` asserts CP = 1. This module is the rest of what
CP needs, in the all-gather form Llama 3 trained with:

- **Layout.** A sequence of ``S`` tokens is cut into ``2 x CP`` chunks; CP rank ``r`` holds chunks ``r`` and
  ``2 x CP - 1 - r`` (Megatron's load-balanced order: under a causal mask early chunks attend to few keys,
  late ones to many, and each rank gets one of each). Megatron-Core's rotary embedding already slices
  its table this way (``get_pos_emb_on_this_cp_rank``), so positions stay right.
- **Attention** (``SdpaCoreAttention`` with CP > 1): each rank all-gathers K and V over the CP group
  (``gather_keys_values``: backward reduce-scatters their gradients, since every rank's queries used
  them), and each of its two query chunks attends causally to the keys up to its own end
  (``chunk_attention_bounds``).
- **Loss.** The last stage's token logprobs are all-gathered back to the full sequence
  (``gather_sequence``: backward keeps this rank's slice, since every CP rank computes the same loss on the same
  full tensor), so GRPO losses, masks, advantages and metrics see exactly what CP = 1 sees. The token
  (or sequence) count Megatron-Core divides the gradients by is reported once per CP group.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig


def check_context_parallel(config: MegatronTrainingConfig, found: Findings) -> None:
    """What context parallelism runs on: the SDPA core attention with K/V all-gathered (this module); training and
    logprob passes split sequences (padded or packed rows), generation runs whole ones (what that means for a rollout
    mode, the mode says: rollout/registry.py)."""
    m = config.megatron
    if isinstance(m.context_parallel_size, int) and m.context_parallel_size > 1 \
            and m.transformer_config.attention_backend == "local":
        found.add("megatron.transformer_config.attention_backend",
                  f"local cannot run context_parallel_size {m.context_parallel_size} (Megatron-Core's DotProductAttention "
                  "asserts CP = 1). Set attention_backend: auto or sdpa.")


def cp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(check_initialized=False)


def local_positions(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """Positions of the full sequence that CP rank ``rank`` holds, in its local order (chunks r, 2CP-1-r)."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism needs the sequence length ({seq_len}) to be a multiple of 2 x CP = {2 * size}")
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * size - 1 - rank)])


@lru_cache(maxsize=64)
def _gather_order(full_len: int, size: int, device: torch.device) -> torch.Tensor:
    """Row i of an all-gather of every rank's local part is position ``order[i]`` (built once per shape: the
    attention gathers K and V in every layer of every microbatch)."""
    return torch.cat([local_positions(full_len, size, r) for r in range(size)]).to(device)


def split_sequence(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """This CP rank's part of ``tensor`` along its sequence dimension ``dim``."""
    return tensor.index_select(dim, local_positions(tensor.shape[dim], size, rank).to(tensor.device))


def chunk_attention_bounds(local_len: int, size: int, rank: int) -> list[tuple[slice, int, int]]:
    """For each of this rank's two query chunks: (its slice of the local queries, the number of keys it
    sees (the full sequence up to its end), its first position). Query at position p sees keys <= p."""
    chunk = local_len // 2
    return [(slice(i * chunk, (i + 1) * chunk), (c + 1) * chunk, c * chunk)
            for i, c in enumerate((rank, 2 * size - 1 - rank))]


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 over the CP group, back in sequence order; backward as ``reduce``
    says: "sum" reduce-scatters (each rank used the whole tensor differently), "slice" keeps this rank's
    part (each rank used the whole tensor the same way)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, reduce: str) -> torch.Tensor:  # noqa: ANN401
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.reduce, ctx.rank, ctx.size = group, reduce, rank, size
        tensor = tensor.contiguous()
        gathered = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(gathered, tensor, group=group)
        ctx.order = _gather_order(gathered.shape[0], size, tensor.device)
        out = torch.empty_like(gathered)
        out.index_copy_(0, ctx.order, gathered)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN401
        in_gather_order = grad.index_select(0, ctx.order).contiguous()
        if ctx.reduce == "slice":
            n = in_gather_order.shape[0] // ctx.size
            return in_gather_order[ctx.rank * n:(ctx.rank + 1) * n].clone(), None, None
        out = torch.empty((in_gather_order.shape[0] // ctx.size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, in_gather_order, group=ctx.group)
        return out, None, None


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [s_local, b, groups, d] -> the full sequence [S, b, groups, d] on every CP rank."""
    return _Gather.apply(key, group, "sum"), _Gather.apply(value, group, "sum")


def gather_sequence(tensor: torch.Tensor, dim: int, group: Any, differentiable: bool = True) -> torch.Tensor:
    """This rank's part of a per-token tensor (e.g. logprobs [b, s_local]) -> the full sequence along ``dim``."""
    moved = tensor.movedim(dim, 0)
    if differentiable:
        full = _Gather.apply(moved, group, "slice")
    else:
        with torch.no_grad():
            full = _Gather.apply(moved.detach(), group, "slice")
    return full.movedim(0, dim)
