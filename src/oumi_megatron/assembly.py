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
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer, RolloutParts

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


def _hub_tokenizer(model: Any) -> Any:
    """``build_tokenizer``; a Hub model that cannot be fetched (offline, gated, no such name) is one line saying what it
    needs, not transformers' traceback (the tokenizer is the run's first read of the model)."""
    try:
        return build_tokenizer(model)
    except OSError as e:
        if Path(str(model.model_name)).expanduser().exists():
            raise  # a local folder's own problem: transformers names the file
        from oumi_megatron.errors import UserInputError
        from oumi_megatron.model_shape import download_problem

        raise UserInputError(download_problem(str(model.model_name), e)) from e


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
    from oumi_megatron.config.lora import lora_settings
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import init_distributed
    from oumi_megatron.engine.parallel.network import network_preflight
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.environments.registry import check_environment
    from oumi_megatron.plugins import load_plugins
    from oumi_megatron.rollout.registry import rollout_mode
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer
    from oumi_megatron.trainer.run_dir import check_shared, check_space, plan_start
    from oumi_megatron.utils.ranks import global_rank

    init_distributed()  # the start decisions below are collective: made once, checked per rank
    load_plugins(config.grpo.plugins)  # their losses, estimators, reward functions, environments (validation imported them)
    check_shared(config.training.output_dir)  # one folder on every node, before anything is written there
    network = network_preflight()  # what the collectives cross nodes over, and how fast: seconds, before conversion
    start = plan_start(config.training)  # the trainer logs the resume when it loads the checkpoint
    rollout_mode(config.megatron).preflight(config)  # e.g. a Ray cluster that holds the engines
    check_space(config, shape, start)  # output_dir's disk holds what the run will write
    tokenizer = _hub_tokenizer(config.model)
    check_environment(config.grpo, tokenizer)  # the chat template renders the environment's observations
    start_sandbox(config.grpo, reward_functions)  # model-written code's isolation, or the fix: before any heavy work
    output_dir = Path(config.training.output_dir)
    dtype = config.model.torch_dtype
    trust = bool(config.model.trust_remote_code)
    # Convert once (Megatron-Bridge), reuse on later runs if it still matches the source model.
    checkpoint = ensure_converted(config.model.model_name, Path(converted_dir or output_dir / "megatron_checkpoint"),
                                  layout, config.megatron, dtype, trust_remote_code=trust)
    # the LR schedule advances per optimizer step: ppo_epochs x num_mini_batches per GRPO step
    updates_per_step = config.grpo.ppo_epochs * config.grpo.num_mini_batches
    settings = OptimSettings.from_training_params(config.training, updates_per_step=updates_per_step)
    lora, problems = lora_settings(config)  # training.use_peft: LoRA on the frozen base (validation named any problem)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    bridge, engine = build_engine(checkpoint, layout, config.megatron, settings, dtype, trust_remote_code=trust, lora=lora)
    if global_rank() == 0:
        adapters = "" if lora is None else (f", LoRA r={lora.rank} alpha={lora.alpha:g} on {list(lora.hf_targets)} "
                                            f"({sum(p.numel() for c in engine.model for p in c.parameters() if p.requires_grad):,} "
                                            "trainable parameters on this rank)")
        logger.info(f"Megatron-Core engine ready: {len(engine.model)} model chunk(s) per rank, dtype {dtype}{adapters}.")
    rollout = build_rollout(config, engine, tokenizer, reward_functions=reward_functions, eval_sets=eval_dataset,
                            work_dir=output_dir, asynchronous=bool(config.grpo.max_staleness))
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, dataset, rollout)
    trainer.start_metrics.update(network.metrics())
    return AssembledRun(trainer, start.checkpoint)


def start_sandbox(grpo: Any, reward_functions: dict[str, Any] | None = None) -> None:
    """The process's sandbox (utils/sandbox.py) with ``grpo.sandbox``, when the environment or a reward runs code the
    model wrote: started now, its isolation logged; ``UserInputError`` with the fixes when this machine lacks it."""
    from oumi_megatron.environments.registry import ENVIRONMENTS
    from oumi_megatron.errors import UserInputError
    from oumi_megatron.grpo.rewards import RewardComputer
    from oumi_megatron.utils.sandbox import SandboxUnavailable, start_shared

    environment = grpo.environment is not None and getattr(ENVIRONMENTS.get(grpo.environment), "uses_sandbox", False)
    if not (environment or RewardComputer(grpo.reward_functions, grpo.on_reward_error, reward_functions).uses_sandbox):
        return
    try:
        start_shared(grpo.sandbox.settings(grpo.environment_workers))
    except SandboxUnavailable as e:
        raise UserInputError(str(e)) from e


def build_rollout(config: Any, engine: Any, tokenizer: Any, *, reward_functions: dict[str, Any] | None = None,
                  eval_sets: Any = None, work_dir: Path, eval_samples: int = 1, asynchronous: bool = False) -> RolloutParts:
    """Collective: the run's rollout parts, in the order their process groups are made: the backend of the rollout mode
    (``megatron.inference_backend`` x ``rollout_placement``), the replica's reward scorer (``grpo.reward_functions``;
    ``reward_functions``, name -> callable, take precedence over Oumi's registry), the environment's runner on the
    scorer's group (and, ``asynchronous``: for asynchronous GRPO's episode thread), the driver over them, the training
    sampling, and an evaluator per eval set (``eval_sets``: one set of rows, or sets by metric prefix; None: none;
    ``eval_samples`` completions per prompt, 1: greedy)."""
    from oumi_megatron.environments.driver import EpisodeTools, RolloutDriver
    from oumi_megatron.environments.registry import environment_runner
    from oumi_megatron.grpo.rewards import RewardComputer
    from oumi_megatron.rollout.base import RunsEpisodeJobs
    from oumi_megatron.rollout.registry import RolloutContext, build_rollout_backend
    from oumi_megatron.rollout.sampling import sampling_for
    from oumi_megatron.trainer.evaluation import build_evaluators
    from oumi_megatron.trainer.grpo_trainer import RolloutParts
    from oumi_megatron.trainer.scoring import ReplicaScorer

    g = config.grpo
    backend = build_rollout_backend(RolloutContext(engine, config, tokenizer, config.model.torch_dtype, work_dir=work_dir))
    # each sample scored once, by its replica's first rank (trainer/scoring.py; collective: after the backend's groups)
    scorer = ReplicaScorer(RewardComputer(g.reward_functions, g.on_reward_error, reward_functions))
    # grpo.environment: multi-turn episodes, the environment called once per replica (the scorer's group)
    tools = EpisodeTools(tokenizer, environment_runner(g, scorer.group, scorer.ranks))
    # asynchronous episodes run on the engine owner's thread, with a tokenizer and an environment of their own (the
    # owner alone calls it: no group)
    # episode jobs or the stream, on the engine owner; a fleet's episodes, synchronous ones too, on its rank 0
    jobs = ((asynchronous and (g.environment or g.partial_rollouts or g.streaming_groups))
            or (g.environment is not None and isinstance(backend, RunsEpisodeJobs)))
    async_tools = EpisodeTools(copy.deepcopy(tokenizer), environment_runner(g)) if jobs else None
    driver = RolloutDriver(backend, g, tools, async_tools)
    evaluators = [] if eval_sets is None else build_evaluators(
        eval_sets, tokenizer, scorer, driver, g, config.training.per_device_eval_batch_size, engine.device, eval_samples)
    return RolloutParts(driver, scorer, sampling_for(g, tokenizer), evaluators)


def evaluate_model(config: Any, layout: ParallelLayout, eval_sets: Any, model_dir: str | Path | None = None, *,
                   reward_functions: dict[str, Any] | None = None, samples: int = 1) -> dict[str, float]:
    """Collective: greedy evaluation of an HF folder (default ``model.model_name``) on ``eval_sets`` with the config's
    rewards, generation limits and rollout mode, exactly as the evaluation during training (trainer/evaluation.py);
    ``samples`` > 1: that many completions per prompt at ``grpo.temperature`` (pass@k). The weights are read in memory
    by Megatron-Bridge; nothing is converted on disk."""
    from oumi_megatron.engine.builder import build_inference_engine
    from oumi_megatron.engine.peft import ADAPTER_CONFIG
    from oumi_megatron.environments.registry import check_environment
    from oumi_megatron.errors import UserInputError
    from oumi_megatron.plugins import load_plugins

    if model_dir is not None and (Path(model_dir) / ADAPTER_CONFIG).is_file() and not (Path(model_dir) / "config.json").is_file():
        raise UserInputError(f"{model_dir} is a LoRA adapter (PEFT's {ADAPTER_CONFIG}), not a model. Evaluate a merged "
                             "model: oumi-megatron export --checkpoint RUN/checkpoints/step_N --out DIR --peft-save-mode "
                             "merged, then --model DIR/hf_model.")
    if model_dir is not None:  # this folder's weights, for every backend (a vLLM engine starts from model_name)
        config = copy.copy(config)
        config.model = copy.copy(config.model)
        config.model.model_name = str(model_dir)
    dtype = config.model.torch_dtype
    load_plugins(config.grpo.plugins)  # their reward functions and environments
    tokenizer = build_tokenizer(config.model)
    check_environment(config.grpo, tokenizer)  # before the weights are read
    start_sandbox(config.grpo, reward_functions)
    _, engine = build_inference_engine(config.model.model_name, layout, config.megatron, dtype,
                                       trust_remote_code=bool(config.model.trust_remote_code))
    rollout = build_rollout(config, engine, tokenizer, reward_functions=reward_functions, eval_sets=eval_sets,
                            work_dir=Path(config.training.output_dir) / "eval_vllm", eval_samples=samples)
    metrics: dict[str, float] = {}
    try:
        for evaluator in rollout.evaluators:
            metrics.update(evaluator.run())
    finally:
        rollout.driver.close()
    return metrics
