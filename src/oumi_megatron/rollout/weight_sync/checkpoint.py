"""Checkpoint files (``weight_sync_method: checkpoint``, vLLM engines of either placement): the trainer writes the
policy as an HF safetensors folder (atomically, each pipeline stage's ranks their own shards) and the engines reload
it. Slower than a stream (the disk both ways), but it needs no link between trainer and engine. ``CheckpointFiles`` is
the trainer's side, ``reload_in_engine`` the engine's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi_megatron.rollout.base import WeightSyncStats

if TYPE_CHECKING:
    from oumi_megatron.rollout.base import PolicyWeights


class CheckpointFiles:
    """``folder``: where the weights are written (the run's work folder); ``reload(folder)``: the engines read it (a
    no-op on ranks that talk to no engine); ``is_owner``: whether this rank counts the folder's bytes."""

    def __init__(self, folder: Path, is_owner: bool, reload: Callable[[Path], None]) -> None:
        self.folder, self.is_owner, self.reload = folder, is_owner, reload

    def sync(self, weights: PolicyWeights) -> WeightSyncStats:
        weights.save(self.folder)  # collective, atomic, ends in a barrier
        size = sum(f.stat().st_size for f in self.folder.glob("*.safetensors")) if self.is_owner else 0
        self.reload(self.folder)
        return WeightSyncStats("checkpoint", 0, size, 0.0)


def reload_in_engine(llm: Any, folder: str) -> None:
    """The engine's side: every worker of ``llm`` (a ``vllm.LLM``) reads the HF safetensors ``folder``; the prefix cache
    is reset (prompts cached under the old weights would be reused)."""
    llm.collective_rpc("reload_weights", kwargs=dict(weights_path=folder, is_checkpoint_format=True))
    llm.reset_prefix_cache()
