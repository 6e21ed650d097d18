"""Entry point for MEGATRON_GRPO training: ``oumi train`` routes here (see integration/oumi_patches.py).

Validation runs first, before anything heavy (model conversion, process groups, datasets).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oumi.utils.logging import logger

from oumi_megatron.validation import validate_config


def _as_megatron_config(config: Any) -> Any:
    """A stock TrainingConfig that says MEGATRON_GRPO (built in Python) gets default megatron/grpo sections."""
    from oumi_megatron.config.training_config import MegatronTrainingConfig

    if isinstance(config, MegatronTrainingConfig):
        return config
    fields = {name: value for name, value in config}
    logger.warning("Config has no megatron:/grpo: sections; using their defaults.")
    return MegatronTrainingConfig(**fields)


def train_megatron_grpo(config: Any, verbose: bool = False) -> None:
    config = _as_megatron_config(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    report = validate_config(config, world_size=world_size)
    for warning in report.warnings:
        logger.warning(warning)
    report.raise_if_invalid()
    assert report.layout is not None
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.info("MEGATRON_GRPO layout:\n%s", report.layout.describe())

    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.conversion import ensure_converted
    from oumi_megatron.engine.optimizer import OptimSettings

    output_dir = Path(config.training.output_dir)
    dtype = config.model.torch_dtype
    # Convert once (Megatron-Bridge), reuse on later runs if it still matches the source model.
    checkpoint = ensure_converted(config.model.model_name, output_dir / "megatron_checkpoint", config.megatron, dtype)
    _, engine = build_engine(checkpoint, config.megatron, OptimSettings.from_training_params(config.training), dtype)
    if rank == 0:
        logger.info(f"Megatron-Core engine ready: {len(engine.model)} model chunk(s) per rank, dtype {dtype}.")
    raise NotImplementedError(
        "MEGATRON_GRPO: the config is valid and the Megatron-Core engine is built "
        f"(converted checkpoint: {checkpoint}), but the GRPO rollout/update loop is not implemented "
        "in this version of oumi-megatron yet."
    )
