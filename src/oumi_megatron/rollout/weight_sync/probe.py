"""Did a weight sync reach the engine? The probe behind ``weight_sync/probe_max_diff``: the engine's logprobs of a fixed
token sequence against the trainer's own, right after the sync. A sync that delivered nothing (the most reported LoRA
sync bug in the peers' trackers: the rollout sampled the initial policy for months) shows as a gap of the size of what
training changed; a sync that worked, as rounding.

Two forms: the engine's logprobs of the fixed sequence itself (vLLM's adapter loads: ``largest_gap``; an asynchronous
SGLang push: sglang_group.py), or tokens the engine decodes after a fixed prompt, their logprobs against the trainer's of the same
tokens (SGLang after a sync: ``decoded_gap``; the prompt comes from the engine's prefix cache, so a stale cache shows
too)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

PROBE_TOKENS = 16


def probe_sequence(vocab_size: int, length: int = 2 * PROBE_TOKENS) -> list[int]:
    """The fixed sequence: the same at every probe, within the byte range any tokenizer has."""
    return [(7 * i + 3) % max(min(vocab_size, 250), 2) for i in range(length)]


def policy_logprobs(engine: Any, sequence: list[int]) -> torch.Tensor:
    """Collective over the training ranks: the trainer's logprob of each token of ``sequence`` after the first
    (``engine``: the MegatronEngine; position t of its logprobs holds log p(token t + 1))."""
    return engine.compute_logprobs([{"input_ids": torch.tensor([sequence])}])[0][0, :-1].float().cpu()


def largest_over_ranks(value: float, device: torch.device) -> float:
    """Collective: the largest ``value`` of any rank (every replica's engine is probed). ``device``: the trainer
    engine's (NCCL reduces device tensors alone)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        worst = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst.item())
    return value


def largest_gap(theirs: list[float], reference: list[float]) -> float:
    """The largest |engine - trainer| logprob over the sequence (the engine's side, where it takes the probe)."""
    return max(abs(a - b) for a, b in zip(theirs, reference, strict=True))


def decoded_gap(engine: Any, prompt: list[int], ids: list[int], theirs: list[float]) -> float:
    """Collective over the training ranks: the largest |engine - trainer| logprob of the tokens ``ids`` the engine
    decoded after ``prompt`` (``theirs``: the engine's logprobs of them), the largest over every replica's engine.
    ``engine``: the trainer's MegatronEngine."""
    sequence = torch.tensor([prompt + ids])
    ours = engine.compute_logprobs([{"input_ids": sequence}])[0][0].float().cpu()
    mine = ours[len(prompt) - 1:len(prompt) - 1 + len(ids)]  # position t holds log p(token t + 1)
    return largest_over_ranks((mine - torch.tensor(theirs)).abs().max().item(), engine.device)
