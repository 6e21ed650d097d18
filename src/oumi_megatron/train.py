"""Entry point for MEGATRON_GRPO training: ``oumi train`` routes here (see integration/oumi_patches.py).

Validation, the data and the output folder are checked first, before anything heavy (model conversion,
process groups, the engine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oumi.utils.logging import logger

from oumi_megatron.data import load_eval_sets, load_prompts, steps_for_epochs
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
    """Validate, check the data and the output folder, convert (once), build the engine, run GRPO.

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
    if config.training.max_steps <= 0:
        config.training.max_steps = steps_for_epochs(config.training.num_train_epochs, len(dataset),
                                                     layout.prompts_per_rollout)
        if rank == 0:
            logger.info(f"training.max_steps = {config.training.max_steps}: {config.training.num_train_epochs} "
                        f"epoch(s) of {len(dataset)} prompts at {layout.prompts_per_rollout} prompts per GRPO step.")

    from oumi_megatron.engine.parallel.distributed import init_distributed
    from oumi_megatron.trainer.run_dir import check_shared, check_space, plan_start

    init_distributed()  # the start decisions below are collective: made once, checked per rank
    check_shared(config.training.output_dir)  # one folder on every node, before anything is written there
    start = plan_start(config.training)  # the trainer logs the resume when it loads the checkpoint

    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.rollout.ray_fleet import preflight

    preflight(config.megatron, config.model.model_name)  # rollout_placement: ray: the cluster holds the engines
    check_space(config, report.model_shape, start)  # output_dir's disk holds what the run will write
    output_dir = Path(config.training.output_dir)
    dtype = config.model.torch_dtype
    # Convert once (Megatron-Bridge), reuse on later runs if it still matches the source model.
    checkpoint = ensure_converted(config.model.model_name, output_dir / "megatron_checkpoint", config.megatron, dtype,
                                  trust_remote_code=bool(config.model.trust_remote_code))
    # the LR schedule advances per optimizer step: ppo_epochs x num_mini_batches per GRPO step
    updates_per_step = config.grpo.ppo_epochs * config.grpo.num_mini_batches
    settings = OptimSettings.from_training_params(config.training, updates_per_step=updates_per_step)
    bridge, engine = build_engine(checkpoint, config.megatron, settings, dtype,
                                  trust_remote_code=bool(config.model.trust_remote_code), layout=layout)
    if rank == 0:
        logger.info(f"Megatron-Core engine ready: {len(engine.model)} model chunk(s) per rank, dtype {dtype}.")

    from oumi.builders import build_tokenizer

    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

    tokenizer = build_tokenizer(config.model)
    # the rollout backend: the trainer builds megatron.inference_backend's (rollout/registry.py)
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, tokenizer, dataset,
                                      eval_dataset=eval_dataset)
    trainer.train(resume_from_checkpoint=str(start.checkpoint) if start.checkpoint else None, verified=True)
    return trainer
