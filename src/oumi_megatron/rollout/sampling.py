"""Token sampling from logits: temperature, nucleus (top-p), greedy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    eos_token_id: int | None = None
    pad_token_id: int = 0
    greedy: bool = False
    """Take the most likely token (for tests and evaluation); GRPO samples."""


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    # on the logits' device, with a generator of that device (the same seed draws the same on every rank)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
