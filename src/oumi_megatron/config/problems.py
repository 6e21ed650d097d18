"""``Problem``: one thing wrong with a config, named by its field, with the fix in the message."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted config path (``megatron.tensor_model_parallel_size``) or CLI flag (``--world-size``)."""
    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
