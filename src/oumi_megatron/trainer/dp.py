"""Collectives over the data-parallel group, as the GRPO loop uses them.

Each DP rank generates, scores and trains on its own share of a step's completions; these gather or reduce
what the whole batch needs (rewards for group advantages, token counts for the metrics). With DP 1 every
call returns its input, with nothing communicated. Tensors travel on ``device`` (NCCL needs the GPU) and come
back as float64 on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import data_parallel


def dp_size_and_rank() -> tuple[int, int]:
    """(DP size, this rank's DP index); (1, 0) before model parallelism."""
    size, rank, _ = data_parallel()
    return size, rank


def gather_dp(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every DP rank's ``local`` [n, ...] concatenated in rank order (float64, on the CPU)."""
    dp, _, group = data_parallel()
    if dp == 1:
        return local.double()
    t = local.double().to(device)
    parts = [torch.empty_like(t) for _ in range(dp)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts).cpu()


def sum_dp(values: list[float], device: torch.device) -> list[float]:
    """Each of ``values`` summed over the DP ranks."""
    dp, _, group = data_parallel()
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dp > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def max_dp(value: float, device: torch.device) -> float:
    """The largest ``value`` over the DP ranks."""
    dp, _, group = data_parallel()
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def gather_objects_dp(local: list[Any]) -> list[list[Any]]:
    """Every DP rank's ``local`` (picklable), in rank order."""
    dp, _, group = data_parallel()
    if dp == 1:
        return [local]
    parts: list[Any] = [None] * dp
    dist.all_gather_object(parts, local, group=group)
    return parts
