"""The composition root: how a run is assembled, once, for every caller.

``oumi train`` (train.py), ``oumi-megatron eval`` (evaluate.py), the whole-run benchmarks (scripts/run_grpo.py) and
the test workers all build their trainer with ``build_trainer`` and evaluate with ``evaluate_model``; what differs
between them is only where the config, the layout and the rows come from. The order of the start is the design's:
one output folder for every node, the resume decided, the rollout mode's preflight, the disk checked, the model
converted once, then the engine, the tokenizer and the trainer.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oumi_megatron.engine.parallel.layout import ParallelLayout
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed


@dataclass
class AssembledRun:
    """A trainer ready to train, and where it starts (the checkpoint the start plan verified, or none)."""

    trainer: OumiMegatronGrpoTrainer
    resume_from: Path | None

    def train(self) -> OumiMegatronGrpoTrainer:
        resume = str(self.resume_from) if self.resume_from else None
        self.trainer.train(resume_from_checkpoint=resume, verified=True)
        return self.trainer


def build_tokenizer(model: Any) -> Any:
    """Oumi's tokenizer builder for Oumi's ``model:`` section; transformers' AutoTokenizer without Oumi."""
    from oumi_megatron.config.standalone import ModelSection

    if not isinstance(model, ModelSection):
        from oumi.builders import build_tokenizer as oumi_build_tokenizer

        return oumi_build_tokenizer(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.model_name, trust_remote_code=model.trust_remote_code,
                                         revision=model.model_revision)


def build_trainer(config: Any, layout: ParallelLayout, dataset: Any, *, eval_dataset: Any = None,
                  reward_functions: dict[str, Any] | None = None, shape: ModelShape | None = None,
                  converted_dir: str | Path | None = None) -> AssembledRun:
    """Collective: the trainer of ``config`` (a MegatronTrainingConfig, or config/standalone.py's without Oumi) on the
    resolved ``layout``, training on ``dataset``'s rows.

    ``eval_dataset``: held-out rows (one set, or sets by metric prefix). ``reward_functions`` (name -> callable) take
    precedence over Oumi's registry. ``shape``: the model's, for the disk preflight (None: not checked).
    ``converted_dir``: where the converted Megatron-Core checkpoint lives (default ``output_dir/megatron_checkpoint``;
    runs of one model may share it).
    """
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import init_distributed
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.environments.registry import check_environment
    from oumi_megatron.rollout.registry import rollout_mode
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer
    from oumi_megatron.trainer.run_dir import check_shared, check_space, plan_start
    from oumi_megatron.utils.ranks import global_rank

    init_distributed()  # the start decisions below are collective: made once, checked per rank
    check_shared(config.training.output_dir)  # one folder on every node, before anything is written there
    start = plan_start(config.training)  # the trainer logs the resume when it loads the checkpoint
    rollout_mode(config.megatron).preflight(config)  # e.g. a Ray cluster that holds the engines
    check_space(config, shape, start)  # output_dir's disk holds what the run will write
    tokenizer = build_tokenizer(config.model)
    check_environment(config.grpo, tokenizer)  # the chat template renders the environment's observations
    output_dir = Path(config.training.output_dir)
    dtype = config.model.torch_dtype
    trust = bool(config.model.trust_remote_code)
    # Convert once (Megatron-Bridge), reuse on later runs if it still matches the source model.
    checkpoint = ensure_converted(config.model.model_name, Path(converted_dir or output_dir / "megatron_checkpoint"),
                                  layout, config.megatron, dtype, trust_remote_code=trust)
    # the LR schedule advances per optimizer step: ppo_epochs x num_mini_batches per GRPO step
    updates_per_step = config.grpo.ppo_epochs * config.grpo.num_mini_batches
    settings = OptimSettings.from_training_params(config.training, updates_per_step=updates_per_step)
    bridge, engine = build_engine(checkpoint, layout, config.megatron, settings, dtype, trust_remote_code=trust)
    if global_rank() == 0:
        logger.info(f"Megatron-Core engine ready: {len(engine.model)} model chunk(s) per rank, dtype {dtype}.")
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, tokenizer, dataset,
                                      reward_functions=reward_functions, eval_dataset=eval_dataset)
    return AssembledRun(trainer, start.checkpoint)


def evaluate_model(config: Any, layout: ParallelLayout, eval_sets: Any, model_dir: str | Path | None = None, *,
                   reward_functions: dict[str, Any] | None = None) -> dict[str, float]:
    """Collective: greedy evaluation of an HF folder (default ``model.model_name``) on ``eval_sets`` with the config's
    rewards, generation limits and rollout mode, exactly as the evaluation during training (trainer/evaluation.py).
    The weights are read in memory by Megatron-Bridge; nothing is converted on disk."""
    from oumi_megatron.engine.builder import build_inference_engine
    from oumi_megatron.environments.registry import check_environment, environment_runner
    from oumi_megatron.grpo.rewards import RewardComputer
    from oumi_megatron.rollout.registry import RolloutContext, build_rollout_backend
    from oumi_megatron.trainer.evaluation import build_evaluators
    from oumi_megatron.trainer.scoring import ReplicaScorer

    if model_dir is not None:  # this folder's weights, for every backend (a vLLM engine starts from model_name)
        config = copy.copy(config)
        config.model = copy.copy(config.model)
        config.model.model_name = str(model_dir)
    dtype = config.model.torch_dtype
    tokenizer = build_tokenizer(config.model)
    check_environment(config.grpo, tokenizer)  # before the weights are read
    _, engine = build_inference_engine(config.model.model_name, layout, config.megatron, dtype,
                                       trust_remote_code=bool(config.model.trust_remote_code))
    backend = build_rollout_backend(RolloutContext(engine, config, tokenizer, dtype,
                                                   work_dir=Path(config.training.output_dir) / "eval_vllm"))
    rewards = ReplicaScorer(RewardComputer(config.grpo.reward_functions, config.grpo.on_reward_error, reward_functions))
    environment = environment_runner(config.grpo, rewards.group, rewards.ranks)
    metrics: dict[str, float] = {}
    try:
        for evaluator in build_evaluators(eval_sets, tokenizer, rewards, backend, config.grpo,
                                          config.training.per_device_eval_batch_size, engine.device, environment):
            metrics.update(evaluator.run())
    finally:
        backend.close()
    return metrics
