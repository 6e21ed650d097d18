"""Left-padded prompt batches: the layout both generation paths prefill (a row's prompt ends at the last column,
so every row's next token goes to the same cache slot)."""

from __future__ import annotations

import torch


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] left-padded with ``pad_id`` (L: the longest prompt, or ``width``), and where the real tokens are
    (pad may be a real token too)."""
    length = max(len(p) for p in prompts) if width is None else width
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), length), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
        real[i, length - len(p):] = True
    return ids, real


def positions_and_mask(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (0 at each row's first real token) and a [B, 1, L, L] mask (True = may not attend) combining
    causality with the left padding."""
    positions = (real.long().cumsum(dim=-1) - 1).clamp(min=0)
    length = real.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=real.device).tril()
    allowed = causal[None] & real[:, None, :]
    # a padding row attends to itself only (its output is never used), so softmax has no empty row
    allowed |= torch.eye(length, dtype=torch.bool, device=real.device)[None] & ~real[:, :, None]
    return positions, ~allowed[:, None]


def left_padded_batch(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L], position ids and the [B, 1, L, L] mask of ``positions_and_mask``."""
    ids, real = left_pad(prompts, pad_id)
    return ids, *positions_and_mask(real)
