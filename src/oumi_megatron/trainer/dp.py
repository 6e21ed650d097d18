"""Collectives over the data-parallel group, as the GRPO loop uses them.

Each DP rank generates, scores and trains on its own share of a step's completions; these gather or reduce
what the whole batch needs (rewards for group advantages, token counts for the metrics). With DP 1 every
call returns its input, with nothing communicated. Tensors travel on ``device`` (NCCL needs the GPU) and come
back as float64 on the CPU.
"""

from __future__ import annotations

import pickle
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
    return max_dp_values([value], device)[0]


def max_dp_values(values: list[float], device: torch.device) -> list[float]:
    """Each of ``values``' largest over the DP ranks (one collective)."""
    dp, _, group = data_parallel()
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def exchange_objects_dp(outgoing: list[list[Any]], device: torch.device) -> tuple[list[list[Any]], int]:
    """All-to-all of objects over the DP group: ``outgoing[k]`` goes to DP rank k; returns what each DP rank sent this
    one (in rank order) and the bytes this rank received. Each rank receives only what is addressed to it (pickled,
    one ``all_to_all_single`` of the sizes and one of the bytes), not every rank's whole share."""
    dp, _, group = data_parallel()
    if dp == 1:
        return [outgoing[0]], 0
    blobs = [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL) for part in outgoing]
    sizes_out = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    sizes_in = torch.empty_like(sizes_out)
    dist.all_to_all_single(sizes_in, sizes_out, group=group)
    sent = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)  # a pickle is never empty
    received = torch.empty(int(sizes_in.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, sent.to(device), output_split_sizes=sizes_in.tolist(),
                           input_split_sizes=sizes_out.tolist(), group=group)
    raw, out, at = received.cpu().numpy().tobytes(), [], 0
    for n in sizes_in.tolist():
        out.append(pickle.loads(raw[at:at + n]))  # noqa: S301 - our own ranks' rollouts
        at += n
    return out, len(raw)
