"""Saving and loading model chunks as Megatron-Core distributed checkpoints.

``dist_checkpointing`` stores every tensor under a global key with its shard offsets, so a checkpoint
saved under one TP/PP/VPP layout loads under any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from oumi_megatron.engine.wrappers import unwrap


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _dp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save_strategy(fully_parallel: bool) -> Any:
    """Megatron-Core's default save strategy; with ``fully_parallel``, DP replicas split the writing."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    return FullyParallelSaveStrategyWrapper(strategy, _dp_group()) if fully_parallel else strategy


def load_strategy(directory: str | Path, fully_parallel: bool) -> Any:
    """Megatron-Core's default load strategy; with ``fully_parallel``, DP replicas split the reading."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(str(directory))
    return FullyParallelLoadStrategyWrapper(strategy, _dp_group()) if fully_parallel else strategy


def save_model(chunks: list[torch.nn.Module], directory: str | Path, fully_parallel: bool = False) -> None:
    """Collective: every rank writes its shards into ``directory`` (which must exist and be empty)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks), str(directory), sharded_strategy=save_strategy(fully_parallel))


def load_model(chunks: list[torch.nn.Module], directory: str | Path, fully_parallel: bool = False) -> None:
    """Collective: fills ``chunks`` (any layout) from a checkpoint saved under any layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(
        model_sharded_state_dict(chunks), str(directory), sharded_strategy=load_strategy(directory, fully_parallel)
    )
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
