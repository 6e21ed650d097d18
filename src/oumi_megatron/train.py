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


def train_megatron_grpo(config: Any, verbose: bool = False) -> Any:
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
    # the LR schedule advances per optimizer step: ppo_epochs x num_mini_batches per GRPO step
    updates_per_step = config.grpo.ppo_epochs * config.grpo.num_mini_batches
    settings = OptimSettings.from_training_params(config.training, updates_per_step=updates_per_step)
    bridge, engine = build_engine(checkpoint, config.megatron, settings, dtype)
    if rank == 0:
        logger.info(f"Megatron-Core engine ready: {len(engine.model)} model chunk(s) per rank, dtype {dtype}.")

    from oumi.builders import build_tokenizer

    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

    backend = None
    if config.megatron.inference_backend == "vllm":
        from oumi_megatron.rollout.vllm_backend import VllmRolloutBackend

        backend = VllmRolloutBackend(engine, bridge, config.model.model_name, dtype, config.megatron, config.grpo,
                                     seed=config.training.seed, work_dir=output_dir, hf_artifacts=checkpoint / "hf")
    trainer = OumiMegatronGrpoTrainer(
        config, engine, bridge, checkpoint, report.layout, build_tokenizer(config.model), load_prompts(config),
        backend=backend,
    )
    trainer.train(resume_from_checkpoint=config.training.resume_from_checkpoint)
    return trainer


class _Concat:
    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.sizes = [len(p) for p in parts]

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i: int) -> Any:
        for part, size in zip(self.parts, self.sizes):
            if i < size:
                return part[i]
            i -= size
        raise IndexError(i)


def load_prompts(config: Any) -> Any:
    """The training datasets of ``data.train`` from Oumi's dataset registry (local jsonl/parquet via dataset_path)."""
    from oumi.core.registry import REGISTRY

    import oumi_megatron.demo_task  # noqa: F401 - registers the demo dataset

    parts = []
    for d in config.data.train.datasets:
        cls = REGISTRY.get_dataset(d.dataset_name, subset=d.subset)
        if cls is None:
            raise ValueError(
                f"data.train.datasets: {d.dataset_name!r} is not a registered Oumi dataset. GRPO datasets "
                "(e.g. openai/gsm8k, d1shs0ap/countdown, oumi-megatron/char-class) are."
            )
        parts.append(cls(dataset_name=d.dataset_name, dataset_path=d.dataset_path, subset=d.subset,
                         split=d.split, **(d.dataset_kwargs or {})))
    return _Concat(parts)
