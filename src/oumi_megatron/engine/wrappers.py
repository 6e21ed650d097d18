"""The model inside Megatron's wrappers: a leaf module, so every engine module can import it (model.py builds the
wrapped chunks and imports the modules that need this)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    inner: Any = chunk  # each wrapper's ``module``: torch types a Module's attributes as Tensor | Module
    while hasattr(inner, "module"):
        inner = inner.module
    return inner
