"""The model inside Megatron's wrappers: a leaf module, so every engine module can import it (model.py builds the
wrapped chunks and imports the modules that need this)."""

from __future__ import annotations

import torch


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
