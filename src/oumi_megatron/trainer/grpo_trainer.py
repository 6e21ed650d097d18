"""``OumiMegatronGrpoTrainer``: prompts -> rollouts -> rewards -> advantages -> Megatron-Core update.

One GRPO step (``grpo_step``), in phases a reader can find by name:
1. collect, score/filter (``RolloutCollector.collect``, trainer/collection.py): the next prompts, their
   ``num_generations`` completions from the rollout backend, scored; DAPO's dynamic sampling; rewards gathered
   over data parallelism so group advantages see whole groups;
2. advantages by ``grpo.advantage_estimator``;
3. old/ref logprobs (``_old_and_reference_logprobs``): without gradients, before any update (with one PPO epoch
   the first mini-batch skips this pass: it is trained on by the policy that generated it, so its old logprobs
   are the training forward's, as in TRL);
4. update (``_update``): ``ppo_epochs`` x ``num_mini_batches`` optimizer steps with ``grpo.policy_loss``;
5. metrics (trainer/step_metrics.py) to metrics.jsonl / TensorBoard / W&B; checkpoints every
   ``training.save_steps``; at the end the HF export to output_dir/hf_model and PNG plots.

Every rank runs the same loop. Each data-parallel rank generates, scores and trains on its own share of the
completions (ranks of one model replica generate together).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.engine.engine import StepResult
from oumi_megatron.engine.state.checkpointing import AsyncCheckpointWriter, load_checkpoint, newest_valid_checkpoint, save_checkpoint
from oumi_megatron.engine.state.hf_weights import HFWeightExporter, export_folders, save_policy
from oumi_megatron.environments.driver import RolloutDriver
from oumi_megatron.grpo.algorithm import logprob_mismatch
from oumi_megatron.grpo.loss import make_grpo_loss_fn
from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS
from oumi_megatron.grpo.rewards import RewardFunctionError
from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.rollout.registry import as_asynchronous
from oumi_megatron.rollout.sample import Sample
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.trainer.async_rollouts import AsyncRollouts, StreamingRollouts
from oumi_megatron.trainer.batches import (
    MicrobatchLayout,
    first_fit_decreasing,
    mark_stale,
    mini_batches,
    packed_layout,
    padded_layout,
)
from oumi_megatron.trainer.collection import RolloutCollector
from oumi_megatron.trainer.dp import dp_size_and_rank, max_dp
from oumi_megatron.trainer.evaluation import Evaluator, eval_schedule
from oumi_megatron.trainer.metrics import MetricsLogger, plot_curves
from oumi_megatron.trainer.reference import reference_policy
from oumi_megatron.trainer.rollout_batch import StepBatch
from oumi_megatron.trainer.rollout_dump import RolloutDump
from oumi_megatron.trainer.scoring import ReplicaScorer
from oumi_megatron.trainer.step_metrics import (
    link_metrics,
    performance_metrics,
    skipped_step_metrics,
    step_metrics,
    wandb_settings,
)
from oumi_megatron.trainer.step_profile import rollout_host_seconds
from oumi_megatron.utils.faults import kill_point
from oumi_megatron.utils.ranks import global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.engine.engine import MegatronEngine
    from oumi_megatron.engine.parallel.layout import ParallelLayout

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed
MAX_ALL_SKIPPED_STEPS = 3
"""GRPO steps in a row in which every reward was skipped before the run stops with an error."""

try:  # Oumi's trainer interface (absent on engine-only machines)
    from oumi.core.trainers.base_trainer import BaseTrainer
except ImportError:  # pragma: no cover
    BaseTrainer = object


@dataclass
class RolloutParts:
    """What the trainer generates and scores with, built once per run by assembly.py: the rollout driver (its backend
    inside), the replica's reward scorer, the training sampling and the evaluators (the same driver, greedy)."""

    driver: RolloutDriver
    scorer: ReplicaScorer
    sampling: SamplingParams
    evaluators: list[Evaluator] = field(default_factory=list)


class OumiMegatronGrpoTrainer(BaseTrainer):
    def __init__(self, config: MegatronTrainingConfig, engine: MegatronEngine, bridge: Any, checkpoint_dir: Path,
                 layout: ParallelLayout, dataset: Any, rollout: RolloutParts) -> None:
        """``rollout``: the driver, scorer, sampling and evaluators (assembly.py ``build_rollout``); the evaluators run on
        the schedule of ``training.eval_strategy`` / ``eval_steps``."""
        self.config, self.engine, self.layout, self.dataset = config, engine, layout, dataset
        self.hf_artifacts = Path(checkpoint_dir) / "hf"
        self.grpo = g = config.grpo
        self.advantage_estimator = ADVANTAGE_ESTIMATORS.get(g.advantage_estimator)  # plugins: loaded by assembly.py
        self.output_dir = Path(config.training.output_dir)
        self.driver, self.backend, self.sampling = rollout.driver, rollout.driver.backend, rollout.sampling
        # the one export: rollout engines, hf_model
        self.weights = HFWeightExporter(bridge, engine.model, self.hf_artifacts, config.megatron.hf_max_shard_size,
                                        peft=engine.peft, base_model=str(config.model.model_name))
        dump = RolloutDump(self.output_dir / "rollouts", g.rollout_dump_steps, rollout.scorer.is_scorer) if g.rollout_dump_steps else None
        self.collector = RolloutCollector(dataset, rollout.driver.tokenizer, rollout.driver, rollout.scorer, g,
                                          self.sampling, layout.prompts_per_rollout, config.training.seed, engine.device,
                                          dump)
        self.reference = reference_policy(engine) if g.beta > 0 else None
        self.loss_fn = make_grpo_loss_fn(g)
        self.step = 0
        self.last_step = config.training.max_steps
        self.weights_synced_at = 0  # the engines start from the same HF weights as the policy
        # the asynchronous loop, decided once: whole steps in flight, or groups streamed (trainer/async_rollouts.py)
        self.async_rollouts = None if not g.max_staleness else (StreamingRollouts if g.streaming_groups else AsyncRollouts)(
            self.collector, as_asynchronous(self.backend, config.megatron), g.max_staleness, engine.device)
        self.last_metrics: dict[str, Any] = {}
        self.start_metrics: dict[str, float] = {}
        """What the run measured before its first step (assembly.py: the network preflight), logged with that step."""
        self.all_skipped_steps = 0
        self.evaluators = rollout.evaluators
        use_async = config.megatron.checkpoint_config.use_async_checkpoint
        self.async_writer = AsyncCheckpointWriter() if use_async else None

    # -- one GRPO step: collect -> score/filter -> old/ref logprobs -> update -> metrics ------------------------------
    def grpo_step(self) -> dict[str, Any]:
        """One GRPO step. Each DP rank generates, scores and trains on its own share of the completions;
        rewards are gathered so advantages see whole groups."""
        metrics = self._async_grpo_step() if self.async_rollouts is not None else self._sync_grpo_step()
        metrics.update(link_metrics(self.backend.engine_metrics(), metrics))
        return metrics

    def _sync_grpo_step(self) -> dict[str, Any]:
        """One step of the synchronous loop: wake the engines, sync the weights, generate, sleep, train."""
        t_wake = self.backend.wake()  # colocated engines take back their GPU memory for this generation phase
        t_sync, sync = self._sync_rollout_weights()
        t0 = time.perf_counter()
        batch = self.collector.collect(self.step)
        t_rollout = time.perf_counter() - t0
        slept = self.backend.sleep()  # ... and hand it to training
        if slept.weights_dropped:
            self.weights_synced_at = -1  # the engines hold no weights until the next sync
        timings = {"time/rollout_s": t_rollout, "time/sync_s": t_sync, "time/wake_s": t_wake,
                   "time/sleep_s": slept.seconds, **batch.profile,
                   "time/rollout_host_s": rollout_host_seconds(t_rollout, batch.profile)}
        return self._train_on(batch, timings, sync)

    def _async_grpo_step(self) -> dict[str, Any]:
        """One step of asynchronous GRPO (trainer/async_rollouts.py): this step's batch from the generations in
        flight, the update, then the new policy queued for the engines."""
        assert self.async_rollouts is not None
        started = time.perf_counter()
        if self.weights_synced_at != self.step:  # a resumed run: the engines get its policy before generating
            self.async_rollouts.push(self.weights, self.step)
            self.async_rollouts.backend.wait_pushed()
            self.weights_synced_at = self.step
            t_sync = time.perf_counter() - started
        else:
            t_sync = 0.0
        got = self.async_rollouts.next_batch(self.step, self.last_step)
        # time/rollout_s: the engine's generation (it overlapped the previous step); time/rollout_wait_s: what the
        # trainer waited for it
        timings = {"time/rollout_s": got.batch.generation_s, "time/rollout_wait_s": got.wait_s, "time/sync_s": t_sync,
                   "time/wake_s": 0.0, "time/sleep_s": 0.0, **got.batch.profile}
        metrics = self._train_on(got.batch, timings, None)
        t_push = time.perf_counter()
        metrics.update(self.async_rollouts.push(self.weights, self.step))
        self.weights_synced_at = self.step
        step_s = time.perf_counter() - started
        # the engine's busy time in a step: one generation and one weight load (the push that finished in it)
        engine_s = got.batch.generation_s + metrics.get("weight_sync/transfer_s", 0.0)
        metrics.update(got.metrics)
        metrics.update({"time/push_s": time.perf_counter() - t_push,
                        "async/trainer_idle_fraction": got.wait_s / max(step_s, 1e-9),
                        "async/engine_idle_fraction": max(0.0, 1.0 - engine_s / max(step_s, 1e-9))})
        return metrics

    def _train_on(self, batch: StepBatch, timings: dict[str, float], sync: WeightSyncStats | None) -> dict[str, Any]:
        """Advantages, old/ref logprobs, the update and the step's metrics, for a collected batch."""
        t0 = time.perf_counter()
        # advantages need whole groups: they are computed from the whole batch's scores, then each sample takes its own
        counted = batch.scores.valid & ~batch.filler  # skipped rewards and filler groups are outside every statistic
        advantages = self.advantage_estimator(batch.scores.total, counted, self.grpo)
        trainable = counted & (batch.scores.finished | (not self.grpo.mask_truncated_completions))
        if not self._anything_to_train(batch, trainable):
            self.step += 1  # the prompts are used up; nothing to train on, so no optimizer step
            self.last_metrics = skipped_step_metrics(batch, self.grpo, timings, self.engine.schedule)
            return self.last_metrics
        batch.set_advantages(advantages, trainable)
        layouts = self._microbatch_layouts(batch.samples)
        t1 = time.perf_counter()
        timings["time/batch_build_s"] = t1 - t0
        logprob_stats = self._old_and_reference_logprobs(layouts)
        t2 = time.perf_counter()
        results = self._update(layouts)
        timings.update({"time/logprob_s": t2 - t1, "time/train_s": time.perf_counter() - t2})
        self.step += 1
        self.last_metrics = step_metrics(batch, advantages, trainable, layouts, logprob_stats, results, timings, sync,
                                         self.grpo, self.engine.device)
        return self.last_metrics

    def _sync_rollout_weights(self) -> tuple[float, WeightSyncStats | None]:
        """Make the rollout engines generate with the current policy (after every update, and after a
        resume). A failed sync raises: training never continues on stale weights unless
        megatron.enable_weight_sync is false (warned at start)."""
        if self.weights_synced_at == self.step or not self.config.megatron.enable_weight_sync:
            return 0.0, None
        start = time.perf_counter()
        stats = self.backend.sync_weights(self.weights)
        self.weights_synced_at = self.step
        if stats is not None and global_rank() == 0:
            logger.info(f"weight sync ({stats.method}): {stats.tensors} tensors, {stats.bytes / 1e6:.1f} MB in "
                        f"{stats.seconds:.3f} s = {stats.gbps:.2f} GB/s")
        return time.perf_counter() - start, stats

    def _anything_to_train(self, batch: StepBatch, trainable: torch.Tensor) -> bool:
        """False (with a warning) when no sample of the batch is trained on: every reward skipped
        (``on_reward_error: skip``; MAX_ALL_SKIPPED_STEPS such steps in a row mean the reward function fails on
        everything, which stops the run), no group with reward variance after dynamic sampling's rounds, or every
        completion truncated under ``mask_truncated_completions``."""
        if bool(batch.scores.valid.any()):
            self.all_skipped_steps = 0
            if bool(trainable.any()):
                return True
            why = (f"no group had reward variance in {batch.rounds} round(s) of dynamic sampling"
                   if bool(batch.filler.all()) else
                   "every completion was cut at max_completion_length (grpo.mask_truncated_completions)")
        else:
            self.all_skipped_steps += 1
            errors = "; ".join(batch.reward_errors) or "(the failures were on other data-parallel ranks)"
            if self.all_skipped_steps >= MAX_ALL_SKIPPED_STEPS:
                raise RewardFunctionError(
                    f"every sample's reward was skipped (grpo.on_reward_error: skip) in {self.all_skipped_steps} GRPO "
                    f"steps in a row, so nothing is being trained. Fix the reward function(s): {errors}")
            why = f"every sample's reward was skipped ({errors})"
        if global_rank() == 0:
            logger.warning(f"GRPO step {self.step + 1} trains on nothing: {why}. No optimizer step.")
        return False

    def _microbatch_layouts(self, samples: list[Sample]) -> list[MicrobatchLayout]:
        """This rank's share of every mini-batch (one optimizer step each), as microbatches."""
        dp, _ = dp_size_and_rank()
        parts = mini_batches(samples, per_mini=self.layout.global_batch_size // dp, count=self.grpo.num_mini_batches)
        layouts = [self._layout(part) for part in parts]
        if self.async_rollouts is not None:  # which tokens an older policy sampled: the mismatch by staleness
            for part, layout in zip(parts, layouts, strict=True):
                mark_stale(layout, part, self.step)
        return layouts

    def _layout(self, samples: list[Sample]) -> MicrobatchLayout:
        mbs, pad = self.layout.micro_batch_size, self.sampling.pad_token_id
        if not self.config.megatron.enable_sequence_packing:
            return padded_layout(samples, mbs, pad)
        # every DP rank runs the same number of microbatches (empty ones are all padding)
        lengths = [s.length for s in samples]
        local = -(-len(first_fit_decreasing(lengths, max(lengths))) // mbs)
        return packed_layout(samples, mbs, pad, min_microbatches=int(max_dp(local, self.engine.device)))

    def _first_update_on_policy(self) -> bool:
        """Whether the step's first mini-batch takes its old logprobs from its own training forward: it is seen
        once (one PPO epoch) by the policy that generated it. Training CUDA graphs hold the transformer layers only
        (engine/kernels/cuda_graphs.py); the output layer, the logprobs and the entropy run eagerly after them."""
        return self.grpo.ppo_epochs == 1

    def _old_and_reference_logprobs(self, layouts: list[MicrobatchLayout]) -> dict[str, float]:
        """Before any update of this step, without gradients: each microbatch gets ``old_logprobs`` (and
        ``ref_logprobs`` when beta > 0), except the first mini-batch's under ``_first_update_on_policy`` (the loss
        takes them from the training forward). Returns sums for the metrics: entropy, and the rollout engine's
        logprobs against the trainer's on the same tokens."""
        g = self.grpo
        out = {"entropy_sum": 0.0, "abs_diff_sum": 0.0, "exp_abs_diff_sum": 0.0, "tokens": 0.0, "abs_diff_max": 0.0}
        skip_first = self._first_update_on_policy()
        for i, layout in enumerate(layouts):
            if self.reference is not None:
                with self.reference.active():
                    ref = self.engine.compute_logprobs(layout.microbatches, g.temperature)
                for mb, lp in zip(layout.microbatches, ref):
                    mb["ref_logprobs"] = lp
            if i == 0 and skip_first:
                continue
            old, entropy = self.engine.compute_logprobs_and_entropy(layout.microbatches, g.temperature)
            for mb, lp, ent in zip(layout.microbatches, old, entropy):
                mb["old_logprobs"] = lp
                out["entropy_sum"] += float((ent * mb["completion_mask"]).sum())
                if "rollout_logprobs" in mb:
                    m = logprob_mismatch(mb["rollout_logprobs"], lp, mb["completion_mask"], mb.get("stale_mask"))
                    for k in ("abs_diff_sum", "exp_abs_diff_sum", "tokens", "stale_abs_diff_sum", "stale_tokens"):
                        if k in m:
                            out[k] = out.get(k, 0.0) + float(m[k])
                    out["abs_diff_max"] = max(out["abs_diff_max"], float(m["abs_diff_max"]))
        return out

    def _update(self, layouts: list[MicrobatchLayout]) -> list[StepResult]:
        """``ppo_epochs`` passes over the mini-batches, one optimizer step each (the first with the entropy output
        when it is on policy: the old-logprob pass it skipped would have reported it)."""
        on_policy = self._first_update_on_policy()
        kill_point("train")  # inside the step, its batch collected (the resume stress test)
        return [self.engine.train_step(layout.microbatches, self.loss_fn, self.grpo.temperature,
                                       with_entropy=on_policy and epoch == 0 and i == 0)
                for epoch in range(self.grpo.ppo_epochs) for i, layout in enumerate(layouts)]

    # -- BaseTrainer --------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None, *, verified: bool = False) -> None:
        """``verified``: ``resume_from_checkpoint``'s files were checked already (train.py's start plan)."""
        resume = self._resume(resume_from_checkpoint, verified)
        max_steps = self.config.training.max_steps
        if self.step >= max_steps:
            self._finish_without_training(resume, max_steps)
            return
        # the metrics of the steps after the resumed one (an interrupted run's) are dropped, so each step is logged once
        metrics_log = MetricsLogger(self.output_dir, enabled=global_rank() == 0, tensorboard=self.config.training.enable_tensorboard,
                                    start_step=self.step, wandb_run=wandb_settings(self.config))
        self._train_steps(max_steps, metrics_log)
        self.save_state()
        if self.async_writer is not None:
            self.async_writer.close()
        metrics_log.close()
        self.driver.close()  # the stream of episodes (if any), then the engines
        if self.config.training.save_final_model:
            self.save_model(self.config, final=True)
        if global_rank() == 0:
            plot_curves(self.output_dir)

    def _train_steps(self, max_steps: int, metrics_log: MetricsLogger) -> None:
        """GRPO steps up to ``max_steps``, with the evaluations, checkpoints and metrics of each, and a progress bar."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        t = self.config.training
        progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("reward {task.fields[reward]:.3f}"),
            TimeElapsedColumn(), disable=global_rank() != 0,
        )
        steps_per_epoch = -(-len(self.dataset) // self.layout.prompts_per_rollout)
        evals = eval_schedule(t, max_steps, steps_per_epoch) if self.evaluators else set()
        if 0 in evals and self.step == 0:  # the starting point of a fresh run (a resumed run logged it)
            metrics_log.log(0, self.evaluate())
        with progress:
            task = progress.add_task("grpo", total=max_steps, completed=self.step, reward=float("nan"))
            while self.step < max_steps:
                started = time.perf_counter()
                metrics = self.grpo_step()
                if t.include_performance_metrics:
                    metrics.update(performance_metrics(metrics, time.perf_counter() - started,
                                                       self.layout.completions_per_rollout, self.grpo.ppo_epochs))
                if self.step in evals:
                    metrics.update(self.evaluate())
                if self.async_writer is not None:
                    self.async_writer.poll()
                metrics.update(self.start_metrics)
                self.start_metrics = {}
                metrics_log.log(self.step, metrics)
                progress.update(task, completed=self.step, reward=metrics["reward/mean"])
                if t.save_steps and self.step % t.save_steps == 0 and self.step < max_steps:
                    self.save_state()
                kill_point("between_steps")  # the resume stress test

    def evaluate(self) -> dict[str, float]:
        """Greedy generation on every eval set with the current policy (collective); ``eval/`` (and each further
        set's prefix) metrics."""
        assert self.evaluators
        self.backend.wake()  # left awake: the next step's generation phase starts from here
        self._sync_rollout_weights()
        metrics: dict[str, float] = {}
        for evaluator in self.evaluators:
            mine = evaluator.run()
            if global_rank() == 0:
                logger.info(f"eval at step {self.step}: {evaluator.summary(mine)}")
            metrics.update(mine)
        self.last_metrics.update(metrics)
        return metrics

    def _resume(self, resume_from_checkpoint: str | None, verified: bool = False) -> Path | None:
        """Load the checkpoint to continue from, if any: ``resume_from_checkpoint``, else the newest valid one under
        output_dir/checkpoints when ``training.try_resume_from_last_checkpoint``. Returns its path."""
        if resume_from_checkpoint:
            resume: Path | None = Path(resume_from_checkpoint)
        elif self.config.training.try_resume_from_last_checkpoint:
            resume, verified = newest_valid_checkpoint(self.output_dir / "checkpoints"), True
        else:
            resume = None
        if resume is not None:
            state = load_checkpoint(self.engine, resume, verified=verified)
            self.step, self.collector.data_position = state["step"], state["data_position"]
            self.collector.skip_positions = set(state.get("skip_positions", []))
            self.weights_synced_at = -1  # the rollout engines still hold the initial weights
            if global_rank() == 0:
                logger.info(f"Resumed from {resume}: continuing at GRPO step {self.step + 1} "
                            f"(data position {self.collector.data_position}).")
        return resume

    def _finish_without_training(self, resume: Path | None, max_steps: int) -> None:
        """Resumed at (or past) training.max_steps: nothing to train; keep the run's files as they are, and
        export the model only if the run never did."""
        if global_rank() == 0:
            logger.warning(f"Nothing to train: {resume} is at GRPO step {self.step} and training.max_steps is {max_steps}. "
                           "Raise training.max_steps to train further.")
        if self.async_writer is not None:
            self.async_writer.close()
        self.driver.close()
        exported = all((self.output_dir / f).exists() for f in export_folders(self._save_mode()))
        if self.config.training.save_final_model and not exported:
            self.save_model(self.config, final=True)

    def save_state(self) -> None:
        save_checkpoint(
            self.engine,
            self.output_dir / "checkpoints",
            self.step,
            {"data_position": self.collector.data_position} if self.async_rollouts is None else self.async_rollouts.resume_state(),
            self.hf_artifacts,
            keep_last=self.config.megatron.checkpoint_config.keep_last_n_checkpoints,
            async_writer=self.async_writer,
        )
        kill_point("checkpoint")  # a background write in flight (the resume stress test)

    def _save_mode(self) -> str | None:
        return self.engine.lora.save_mode if self.engine.lora is not None else None

    def save_model(self, config: MegatronTrainingConfig, final: bool = True) -> None:
        """output_dir/hf_model; under LoRA, hf_adapter/ and/or hf_model/ as ``peft.peft_save_mode`` says."""
        save_policy(self.weights, self.output_dir, self._save_mode())

    def get_last_eval_metrics(self) -> dict[str, Any]:
        return dict(self.last_metrics)
