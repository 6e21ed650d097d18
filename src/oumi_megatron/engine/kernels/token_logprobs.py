"""Per-token logprobs and entropy from full (vocab-parallel) logits: the path for microbatches whose fp32 logits are
small (chunked_logprobs.py computes them from the last hidden states otherwise)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def shift_targets(input_ids: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """Next-token targets: ``target[:, t] = input_ids[:, t + 1]``; the last column is ``pad_id``."""
    targets = torch.full_like(input_ids, pad_id)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) at ``targets``; logits may be split over the TP group (vocab-parallel).

    Note: Megatron's vocab-parallel cross entropy overwrites its input in place (fp32 logits included).
    """
    from megatron.core import tensor_parallel

    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) at every position; logits may be split over the TP group."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    z = logits.float() / temperature
    z_max = z.max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    e = (z - z_max).exp()
    sums = torch.cat([e.sum(dim=-1, keepdim=True), (e * z).sum(dim=-1, keepdim=True)], dim=-1)
    if tp > 1:
        dist.all_reduce(sums, group=group)
    # H = log sum exp(z) - E_p[z]
    return (sums[..., 0].log() + z_max[..., 0] - sums[..., 1] / sums[..., 0])


