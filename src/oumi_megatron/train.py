"""Entry point for MEGATRON_GRPO training: ``oumi train`` routes here (see integration/oumi_patches.py).

Validation and the data are checked first, before anything heavy; the run is then assembled by the composition root
(assembly.py ``build_trainer``: output folder, start plan, preflights, conversion, engine, trainer), as every
benchmark and worker assembles it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from oumi.utils.logging import logger

from oumi_megatron.data import load_eval_sets, load_prompts, steps_for_epochs
from oumi_megatron.grpo.rewards import reward_argument_problems
from oumi_megatron.utils.options import option_value
from oumi_megatron.validation import validate_config

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig


def _as_megatron_config(config: Any) -> MegatronTrainingConfig:
    """A stock TrainingConfig that says MEGATRON_GRPO (built in Python) gets default megatron/grpo sections."""
    from oumi_megatron.config.training_config import MegatronTrainingConfig

    if isinstance(config, MegatronTrainingConfig):
        return config
    fields = {name: value for name, value in config}
    logger.warning("Config has no megatron:/grpo: sections; using their defaults.")
    return MegatronTrainingConfig(**fields)


def train_megatron_grpo(config: Any, verbose: bool = False) -> Any:
    """Validate, check the data, assemble the run (assembly.py), run GRPO.

    Everything that can be wrong with the user's input is checked before the model is converted.
    """
    config = _as_megatron_config(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    report = validate_config(config, world_size=world_size)
    if rank == 0:
        for note in report.notes:
            logger.info(f"Config: {note}")
        for warning in report.warnings:
            logger.warning(warning)
    layout = report.require_layout()
    if rank == 0:
        logger.info("MEGATRON_GRPO layout:\n%s", layout.describe())

    # The data before the model: a bad file is reported now, not after minutes of conversion.
    dataset = load_prompts(config, log=logger if rank == 0 else None)
    evaluating = option_value(config.training.eval_strategy, "no") != "no"
    eval_dataset = load_eval_sets(config, log=logger if rank == 0 else None) if evaluating else None
    # the reward functions' keyword arguments against the rows (a missing column fails the first step, after conversion)
    heads = dataset.heads() + [h for part in (eval_dataset or {}).values() for h in part.heads()]
    report.problems.extend(reward_argument_problems(config, heads))
    report.raise_if_invalid()
    if config.training.max_steps <= 0:
        config.training.max_steps = steps_for_epochs(config.training.num_train_epochs, len(dataset),
                                                     layout.prompts_per_rollout)
        if rank == 0:
            logger.info(f"training.max_steps = {config.training.max_steps}: {config.training.num_train_epochs} "
                        f"epoch(s) of {len(dataset)} prompts at {layout.prompts_per_rollout} prompts per GRPO step.")

    from oumi_megatron.assembly import build_trainer

    # the composition root (assembly.py): output folder, start plan, preflights, conversion, engine, trainer
    run = build_trainer(config, layout, dataset, eval_dataset=eval_dataset, shape=report.model_shape)
    return run.train()
