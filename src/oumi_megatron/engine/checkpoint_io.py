"""Saving and loading model chunks as Megatron-Core distributed checkpoints.

``dist_checkpointing`` stores every tensor under a global key with its shard offsets, so a checkpoint
saved under one TP/PP/VPP layout loads under any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from oumi_megatron.engine.model import unwrap


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def save_model(chunks: list[torch.nn.Module], directory: str | Path) -> None:
    """Collective: every rank writes its shards into ``directory`` (which must exist and be empty)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks), str(directory))


def load_model(chunks: list[torch.nn.Module], directory: str | Path) -> None:
    """Collective: fills ``chunks`` (any layout) from a checkpoint saved under any layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(directory))
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
