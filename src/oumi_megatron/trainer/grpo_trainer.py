"""``OumiMegatronGrpoTrainer``: prompts -> rollouts -> rewards -> advantages -> Megatron-Core update.

One GRPO step (``grpo_step``), in phases a reader can find by name:
1. collect (``_generate_round``): the next ``prompts_per_rollout`` prompts (a seeded permutation of the
   dataset; the position is checkpointed), rendered with the tokenizer's chat template, left-truncated;
   ``num_generations`` completions each from the rollout backend (the embedded Megatron backend samples
   from the policy's own weights, so there is nothing to sync); scored by the weighted reward functions
   (plus DAPO's overlong punishment);
2. score/filter (``_collect_and_score``): under DAPO's dynamic sampling, groups whose rewards are all equal
   are dropped and further rounds of prompts refill the batch; advantages by ``grpo.advantage_estimator``;
3. old/ref logprobs (``_old_and_reference_logprobs``): without gradients, before any update;
4. update (``_update``): ``ppo_epochs`` x ``num_mini_batches`` optimizer steps with ``grpo.policy_loss``;
5. metrics (``_step_metrics``) to metrics.jsonl / TensorBoard; checkpoints every ``training.save_steps``;
   at the end the HF export to output_dir/hf_model and PNG plots.

Every rank runs the same loop. Each data-parallel rank generates, scores and trains on its own share
of the completions (ranks of one model replica generate together); rewards are gathered over DP so
group advantages see whole groups.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.state.checkpointing import (
    AsyncCheckpointWriter,
    load_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
)
from oumi_megatron.data import prompt_token_ids
from oumi_megatron.engine.parallel.distributed import data_parallel
from oumi_megatron.engine.state.hf_weights import HFWeightExporter
from oumi_megatron.engine.engine import StepResult
from oumi_megatron.grpo.algorithm import groups_with_signal, logprob_mismatch, overlong_penalty
from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS, lookup
from oumi_megatron.grpo.loss import make_grpo_loss_fn
from oumi_megatron.grpo.rewards import RewardComputer, RewardFunctionError, RewardResult
from oumi_megatron.rollout.base import Rollout, RolloutBackend, WeightSyncStats
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.trainer.batches import MicrobatchLayout, SequenceBatch, first_fit_decreasing, packed_layout, padded_layout
from oumi_megatron.trainer.evaluation import build_evaluators, eval_schedule
from oumi_megatron.trainer.metrics import MetricsLogger, plot_curves
from oumi_megatron.trainer.rollout_batch import Scores, StepBatch, choose_groups
from oumi_megatron.plugins import load_plugins
from oumi_megatron.utils.ranks import global_rank

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed
MAX_ALL_SKIPPED_STEPS = 3
"""GRPO steps in a row in which every reward was skipped before the run stops with an error."""

try:  # Oumi's trainer interface (absent on engine-only machines)
    from oumi.core.trainers.base_trainer import BaseTrainer
except ImportError:  # pragma: no cover
    BaseTrainer = object  # type: ignore[misc,assignment]


@dataclass
class _Round:
    """One round of generation: its prompts' rows (every rank), this rank's rollouts, the round's scores."""

    rows: list[dict[str, Any]]
    rollouts: list[Rollout]
    scores: Scores
    truncated: int
    errors: list[str]
    sample: dict[str, Any] | None


class ReferenceWeights:
    """The initial policy for the KL term, kept on the CPU (no second model on the GPU)."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.params = [p for c in chunks for p in c.parameters()]
        self.initial = [p.detach().to("cpu", copy=True) for p in self.params]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        current = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, ref in zip(self.params, self.initial):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, current):
                    p.copy_(cur)


class OumiMegatronGrpoTrainer(BaseTrainer):
    def __init__(
        self,
        config: Any,
        engine: Any,
        bridge: Any,
        checkpoint_dir: Path,
        layout: Any,
        tokenizer: Any,
        dataset: Any,
        reward_functions: dict[str, Any] | None = None,
        backend: RolloutBackend | None = None,
        eval_dataset: Any = None,
    ) -> None:
        """``reward_functions`` (name -> callable) take precedence over Oumi's registry for those names.
        ``backend``: the rollout engine (default: ``megatron.inference_backend``'s, rollout/registry.py).
        ``eval_dataset``: held-out prompts (``data.validation``), evaluated greedily on the schedule of
        ``training.eval_strategy`` / ``eval_steps``: one set (``eval/`` metrics), or sets by metric prefix
        (``{"eval": rows, "eval_unseen": rows}``, data.load_eval_sets)."""
        self.config = config
        self.engine = engine
        self.hf_artifacts = Path(checkpoint_dir) / "hf"
        self.layout = layout
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.grpo = config.grpo
        load_plugins(self.grpo.plugins)  # their losses, estimators, reward functions (validation imported them too)
        self.advantage_estimator = lookup(ADVANTAGE_ESTIMATORS, "grpo.advantage_estimator", self.grpo.advantage_estimator)
        self.output_dir = Path(config.training.output_dir)
        self.rewards = RewardComputer(self.grpo.reward_functions, self.grpo.on_reward_error, reward_functions)
        if backend is None:
            from oumi_megatron.rollout.registry import RolloutContext, build_rollout_backend

            backend = build_rollout_backend(RolloutContext(engine, config, tokenizer, config.model.torch_dtype,
                                                           work_dir=self.output_dir))
        self.backend = backend
        self.weights = HFWeightExporter(bridge, engine.model, self.hf_artifacts)  # the one export: rollout engines, hf_model
        self.sampling = SamplingParams(
            temperature=self.grpo.temperature,
            top_p=self.grpo.top_p,
            max_new_tokens=self.grpo.max_completion_length,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        self.reference = ReferenceWeights(engine.model) if self.grpo.beta > 0 else None
        self.loss_fn = make_grpo_loss_fn(self.grpo)
        self.step = 0
        self.weights_synced_at = 0  # the engines start from the same HF weights as the policy
        self.data_position = 0
        self.order = list(range(len(dataset)))
        random.Random(config.training.seed).shuffle(self.order)
        self.last_metrics: dict[str, Any] = {}
        self.all_skipped_steps = 0
        self.warned_truncation = False
        self.evaluators = [] if eval_dataset is None else build_evaluators(
            eval_dataset, tokenizer, self.rewards, self.backend, self.grpo, config.training.per_device_eval_batch_size,
            engine.device)
        use_async = config.megatron.checkpoint_config.use_async_checkpoint
        self.async_writer = AsyncCheckpointWriter() if use_async else None

    # -- data ---------------------------------------------------------------------------------------
    def _next_rows(self, n: int) -> list[dict[str, Any]]:
        rows = []
        for _ in range(n):
            rows.append(self.dataset[self.order[self.data_position % len(self.order)]])
            self.data_position += 1
        return rows

    def _note_truncation(self, lengths: list[int], cut: int) -> None:
        """Cutting a prompt's start can drop the question; say so (once) instead of training on it silently."""
        if cut and not self.warned_truncation and global_rank() == 0:
            self.warned_truncation = True
            logger.warning(f"{cut} of {len(lengths)} prompts this step are longer than grpo.max_prompt_length "
                           f"({self.grpo.max_prompt_length} tokens; longest {max(lengths)}) and lose their beginning. "
                           "Raise grpo.max_prompt_length (metric prompt/truncated_fraction counts them every step).")

    # -- data-parallel helpers ----------------------------------------------------------------------
    @staticmethod
    def _dp() -> tuple[int, int, Any]:
        return data_parallel()

    def _gather_dp(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenate every DP rank's ``local`` [n, ...] in rank order (float64, on the CPU)."""
        dp, _, group = self._dp()
        if dp == 1:
            return local.double()
        t = local.double().to(self.engine.device)
        parts = [torch.empty_like(t) for _ in range(dp)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts).cpu()

    def _sum_dp(self, values: list[float]) -> list[float]:
        dp, _, group = self._dp()
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        if dp > 1:
            dist.all_reduce(t, group=group)
        return t.tolist()

    def _rollout_seed(self, dp_rank: int, round_index: int = 0) -> int:
        """Sampling seed of one step (and dynamic-sampling round) on one DP rank: a function of (seed, step, rank,
        round), so a resumed run draws what the uninterrupted one drew, and DP ranks draw different samples."""
        key = f"{self.config.training.seed}/{self.step}/{dp_rank}" + (f"/{round_index}" if round_index else "")
        key = key.encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")

    def _layout(self, batch: SequenceBatch) -> MicrobatchLayout:
        mbs, pad = self.layout.micro_batch_size, self.sampling.pad_token_id
        if not self.config.megatron.enable_sequence_packing:
            return padded_layout(batch, mbs, pad)
        # every DP rank runs the same number of microbatches (empty ones are all padding)
        lengths = [len(t) for t in batch.token_ids]
        local = -(-len(first_fit_decreasing(lengths, max(lengths))) // mbs)
        return packed_layout(batch, mbs, pad, min_microbatches=int(self._max_dp(local)))

    def _max_dp(self, value: float) -> float:
        dp, _, group = self._dp()
        t = torch.tensor([value], dtype=torch.float64, device=self.engine.device)
        if dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

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

    def _any_scored(self, valid: torch.Tensor, errors: list[str]) -> bool:
        """False when every sample of the step was skipped (``on_reward_error: skip``): the step is not
        trained on, with a warning; that many steps in a row means the reward function fails on
        everything, which stops the run instead of training on nothing for ever."""
        if bool(valid.any()):
            self.all_skipped_steps = 0
            return True
        self.all_skipped_steps += 1
        why = "; ".join(errors) or "(the failures were on other data-parallel ranks)"
        if self.all_skipped_steps >= MAX_ALL_SKIPPED_STEPS:
            raise RewardFunctionError(
                f"every sample's reward was skipped (grpo.on_reward_error: skip) in {self.all_skipped_steps} GRPO "
                f"steps in a row, so nothing is being trained. Fix the reward function(s): {why}"
            )
        if global_rank() == 0:
            logger.warning(f"GRPO step {self.step + 1}: every sample's reward was skipped, so this step trains on "
                           f"nothing (no optimizer step). {why}")
        return False

    # -- one GRPO step: collect -> score/filter -> old/ref logprobs -> update -> metrics ------------------
    def grpo_step(self) -> dict[str, Any]:
        """One GRPO step. Each DP rank generates, scores and trains on its own share of the completions;
        rewards are gathered so advantages see whole groups."""
        t_sync, sync = self._sync_rollout_weights()
        t0 = time.perf_counter()
        batch = self._collect_and_score()
        t_rollout = time.perf_counter() - t0
        counted = batch.scores.valid & ~batch.filler  # skipped rewards and filler groups are outside every statistic
        advantages = self.advantage_estimator(batch.scores.total, counted, self.grpo)
        trainable = counted & (batch.scores.finished | (not self.grpo.mask_truncated_completions))
        timings = {"time/rollout_s": t_rollout, "time/sync_s": t_sync}
        if not self._anything_to_train(batch, trainable):
            self.step += 1  # the prompts are used up; nothing to train on, so no optimizer step
            self.last_metrics = {**self._reward_metrics(batch), **timings, "update_skipped": 1,
                                 "pipeline/schedule": self.engine.schedule, "pipeline/deferred_wgrad_ops": 0,
                                 "module_queue/active": False, "module_queue/offloaded_mib": 0.0}
            return self.last_metrics
        layouts = self._microbatch_layouts(batch, advantages, trainable)
        t1 = time.perf_counter()
        logprob_stats = self._old_and_reference_logprobs(layouts)
        t2 = time.perf_counter()
        results = self._update(layouts)
        timings.update({"time/logprob_s": t2 - t1, "time/train_s": time.perf_counter() - t2})
        self.step += 1
        self.last_metrics = self._step_metrics(batch, advantages, trainable, layouts, logprob_stats, results, timings, sync)
        return self.last_metrics

    # collect ------------------------------------------------------------------------------------------
    def _generate_round(self, index: int) -> _Round:
        """The next ``prompts_per_rollout`` prompts: this rank's share of their completions, scored; the round's
        scores gathered over DP (sample i belongs to prompt i // num_generations)."""
        g = self.grpo
        dp, dp_rank, _ = self._dp()
        rows = self._next_rows(self.layout.prompts_per_rollout)
        rendered = [prompt_token_ids(self.tokenizer, r["prompt"], g.max_prompt_length) for r in rows]
        full_lengths = [n for _, n in rendered]
        truncated = sum(n > g.max_prompt_length for n in full_lengths)
        self._note_truncation(full_lengths, truncated)
        per_rank = len(rows) * g.num_generations // dp
        mine = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        rollouts = self.backend.generate([rendered[i // g.num_generations][0] for i in mine], self.sampling,
                                         seed=self._rollout_seed(dp_rank, index))
        completions = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
        prompts = [self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in rollouts]
        rewards = self.rewards(prompts, completions, [rows[i // g.num_generations] for i in mine])
        sample = {"prompt": prompts[0], "completion": completions[0], "reward": rewards.total[0].item()} if rollouts else None
        return _Round(rows, rollouts, self._gather_scores(rewards, rollouts), truncated, rewards.errors, sample)

    def _gather_scores(self, rewards: RewardResult, rollouts: list[Rollout]) -> Scores:
        """The whole round's scores on every rank, with the overlong punishment (``grpo.overlong_buffer_length``)."""
        g = self.grpo
        names = list(rewards.per_function)
        local = torch.stack([rewards.total, rewards.valid.double(), *(rewards.per_function[k] for k in names),
                             torch.tensor([float(len(r.completion_ids)) for r in rollouts]),
                             torch.tensor([float(r.finished) for r in rollouts])], dim=1)
        stats = self._gather_dp(local)  # [n, k], the whole round, on every rank
        total, valid, lengths = stats[:, 0], stats[:, 1] > 0.5, stats[:, -2]
        penalty = torch.zeros_like(total)
        if g.overlong_buffer_length:
            penalty = torch.where(valid, overlong_penalty(lengths, g.max_completion_length, g.overlong_buffer_length,
                                                          g.overlong_penalty_factor), 0.0)
        return Scores(total + penalty, valid, {k: stats[:, 2 + j] for j, k in enumerate(names)}, penalty, lengths,
                      stats[:, -1] > 0.5)

    def _gather_rollouts(self, local: list[list[Rollout]]) -> list[list[Rollout]]:
        """Per round, the whole round's rollouts on every rank (DP ranks' shares in rank order)."""
        dp, _, group = self._dp()
        if dp == 1:
            return local
        parts: list[Any] = [None] * dp
        dist.all_gather_object(parts, local, group=group)
        return [[x for part in parts for x in part[r]] for r in range(len(local))]

    # score / filter -------------------------------------------------------------------------------------
    def _collect_and_score(self) -> StepBatch:
        """One round of generation; under ``grpo.dynamic_sampling`` (DAPO), rounds until the batch is full of groups
        whose rewards differ (or ``dynamic_sampling_max_rounds`` ran out: the rest is filler, not trained on)."""
        g, G = self.grpo, self.grpo.num_generations
        rounds = [self._generate_round(0)]
        extra: dict[str, Any] = {}
        if not g.dynamic_sampling:
            first = rounds[0]
            rollouts, scores, group_rows = first.rollouts, first.scores, first.rows
            filler = torch.zeros(len(scores), dtype=torch.bool)
        else:
            wanted = self.layout.prompts_per_rollout
            signals = [groups_with_signal(rounds[0].scores.total, rounds[0].scores.valid, G)]
            while sum(int(s.sum()) for s in signals) < wanted and len(rounds) < g.dynamic_sampling_max_rounds:
                rounds.append(self._generate_round(len(rounds)))
                signals.append(groups_with_signal(rounds[-1].scores.total, rounds[-1].scores.valid, G))
            kept, filled = choose_groups(signals, wanted)
            chosen = kept + filled
            everything = self._gather_rollouts([r.rollouts for r in rounds])
            whole = [everything[r][i] for r, grp in chosen for i in range(grp * G, (grp + 1) * G)]
            dp, dp_rank, _ = self._dp()
            per_rank = len(whole) // dp
            rollouts = whole[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            scores = Scores.cat([rounds[r].scores.take(list(range(grp * G, (grp + 1) * G))) for r, grp in chosen])
            group_rows = [rounds[r].rows[grp] for r, grp in chosen]
            filler = torch.tensor([False] * len(kept) + [True] * len(filled)).repeat_interleave(G)
            extra = {"groups_dropped": sum(len(s) - int(s.sum()) for s in signals), "groups_filled": len(filled)}
            if filled and global_rank() == 0:
                logger.warning(f"GRPO step {self.step + 1}: dynamic sampling found {len(kept)} of {wanted} groups with "
                               f"reward variance in {len(rounds)} rounds (grpo.dynamic_sampling_max_rounds); "
                               f"{len(filled)} groups without it fill the batch and are not trained on.")
        return StepBatch(rollouts=rollouts, scores=scores, filler=filler, group_rows=group_rows,
                         generated=Scores.cat([r.scores for r in rounds]),
                         prompts_truncated=sum(r.truncated for r in rounds),
                         prompts_used=sum(len(r.rows) for r in rounds), rounds=len(rounds),
                         reward_errors=[e for r in rounds for e in r.errors][:5], sample=rounds[0].sample, **extra)

    def _anything_to_train(self, batch: StepBatch, trainable: torch.Tensor) -> bool:
        """False (with a warning) when no sample of the batch is trained on: every reward skipped (that many steps
        in a row stops the run, see ``_any_scored``), no group with reward variance after dynamic sampling's
        rounds, or every completion truncated under ``mask_truncated_completions``."""
        if not self._any_scored(batch.scores.valid, batch.reward_errors):
            return False
        if bool(trainable.any()):
            return True
        if global_rank() == 0:
            why = (f"no group had reward variance in {batch.rounds} round(s) of dynamic sampling"
                   if bool(batch.filler.all()) else
                   "every completion was cut at max_completion_length (grpo.mask_truncated_completions)")
            logger.warning(f"GRPO step {self.step + 1} trains on nothing: {why}. No optimizer step.")
        return False

    def _microbatch_layouts(self, batch: StepBatch, advantages: torch.Tensor, trainable: torch.Tensor) -> list[MicrobatchLayout]:
        """This rank's share of every mini-batch (one optimizer step each), as microbatches."""
        dp, dp_rank, _ = self._dp()
        first = dp_rank * len(batch.rollouts)  # this rank's share starts here in the whole batch
        per_mini = self.layout.global_batch_size // dp
        rollouts = batch.rollouts
        layouts = []
        for m in range(self.grpo.num_mini_batches):
            part = range(m * per_mini, (m + 1) * per_mini)
            whole = [first + i for i in part]
            seq = SequenceBatch(
                token_ids=[rollouts[i].prompt_ids + rollouts[i].completion_ids for i in part],
                prompt_lengths=[len(rollouts[i].prompt_ids) for i in part],
                advantages=advantages[whole],
                trainable=trainable[whole],
                rollout_logprobs=[rollouts[i].logprobs for i in part] if all(rollouts[i].logprobs is not None for i in part) else None,
            )
            layouts.append(self._layout(seq))
        return layouts

    # old / reference logprobs ---------------------------------------------------------------------------
    def _old_and_reference_logprobs(self, layouts: list[MicrobatchLayout]) -> dict[str, float]:
        """Before any update of this step, without gradients: each microbatch gets ``old_logprobs`` (and
        ``ref_logprobs`` when beta > 0). Returns sums for the metrics: entropy, and the rollout engine's
        logprobs against the trainer's on the same tokens."""
        g = self.grpo
        out = {"entropy_sum": 0.0, "abs_diff_sum": 0.0, "exp_abs_diff_sum": 0.0, "tokens": 0.0, "abs_diff_max": 0.0}
        for layout in layouts:
            old, entropy = self.engine.compute_logprobs_and_entropy(layout.microbatches, g.temperature)
            for mb, lp, ent in zip(layout.microbatches, old, entropy):
                mb["old_logprobs"] = lp
                out["entropy_sum"] += float((ent * mb["completion_mask"]).sum())
                if "rollout_logprobs" in mb:
                    m = logprob_mismatch(mb["rollout_logprobs"], lp, mb["completion_mask"])
                    for k in ("abs_diff_sum", "exp_abs_diff_sum", "tokens"):
                        out[k] += float(m[k])
                    out["abs_diff_max"] = max(out["abs_diff_max"], float(m["abs_diff_max"]))
            if self.reference is not None:
                with self.reference.active():
                    ref = self.engine.compute_logprobs(layout.microbatches, g.temperature)
                for mb, lp in zip(layout.microbatches, ref):
                    mb["ref_logprobs"] = lp
        return out

    # update -----------------------------------------------------------------------------------------------
    def _update(self, layouts: list[MicrobatchLayout]) -> list[StepResult]:
        """``ppo_epochs`` passes over the mini-batches, one optimizer step each."""
        return [self.engine.train_step(layout.microbatches, self.loss_fn, self.grpo.temperature)
                for _ in range(self.grpo.ppo_epochs) for layout in layouts]

    # metrics ------------------------------------------------------------------------------------------
    def _reward_metrics(self, batch: StepBatch) -> dict[str, Any]:
        """Rewards of everything generated this step (all rounds: an unfiltered sample of the policy), completion
        lengths, and what dynamic sampling and the overlong options did."""
        gen, g = batch.generated, self.grpo
        valid = gen.valid
        scored = gen.total[valid]  # skipped samples have no reward
        out: dict[str, Any] = {
            "reward/mean": scored.mean().item() if len(scored) else float("nan"),
            "reward/std": scored.std().item() if len(scored) > 1 else 0.0,
            **{f"reward/{k}": v[valid].mean().item() if len(scored) else float("nan") for k, v in gen.per_function.items()},
            "reward/invalid_samples": int((~valid).sum()),
            "prompt/truncated_fraction": batch.prompts_truncated / max(batch.prompts_used, 1),
            "completion_length/mean": gen.lengths.mean().item(),
            "completion_length/max": int(gen.lengths.max()),
            "completion_length/truncated_fraction": float((~gen.finished).double().mean()),
        }
        if g.overlong_buffer_length:
            out["reward/overlong_penalty"] = gen.overlong_penalty[valid].mean().item() if len(scored) else 0.0
        if g.dynamic_sampling:
            groups = len(gen) // g.num_generations
            out.update({"dynamic_sampling/rounds": batch.rounds, "dynamic_sampling/groups_generated": groups,
                        "dynamic_sampling/groups_dropped": batch.groups_dropped,
                        "dynamic_sampling/groups_filled": batch.groups_filled,
                        "dynamic_sampling/kept_fraction": (groups - batch.groups_dropped) / max(groups, 1)})
        if g.log_completions and global_rank() == 0 and batch.sample is not None:
            out["sample"] = batch.sample
        return out

    def _step_metrics(self, batch: StepBatch, advantages: torch.Tensor, trainable: torch.Tensor,
                      layouts: list[MicrobatchLayout], lp: dict[str, float], results: list[StepResult],
                      timings: dict[str, float], sync: WeightSyncStats | None) -> dict[str, Any]:
        g = self.grpo
        real, processed, padded, entropy_sum, scored, mm_abs, mm_exp, mm_tokens = self._sum_dp([
            float(sum(lo.real_tokens for lo in layouts)), float(sum(lo.processed_tokens for lo in layouts)),
            float(sum(lo.padded_tokens for lo in layouts)),
            lp["entropy_sum"], float(sum(float(mb["completion_mask"].sum()) for lo in layouts for mb in lo.microbatches)),
            lp["abs_diff_sum"], lp["exp_abs_diff_sum"], lp["tokens"],
        ])
        mm_max = self._max_dp(lp["abs_diff_max"])
        last = results[-1]
        tokens = max(last.metrics.get("completion_tokens", 0.0), 1.0)
        n = len(advantages)
        return {
            **self._reward_metrics(batch),
            "advantage/mean": advantages.mean().item(),
            "advantage/std": advantages.std().item() if n > 1 else 0.0,
            "advantage/max_abs": advantages.abs().max().item(),
            "batch/untrained_samples": int((~trainable).sum()),
            "loss": sum(r.loss for r in results) / len(results),
            "kl": last.metrics.get("kl_sum", 0.0) / tokens,
            "clip_fraction": last.metrics.get("clipped_tokens", 0.0) / tokens,
            **({"tis/mean_weight": last.metrics["tis_weight_sum"] / tokens,
                "tis/capped_fraction": last.metrics["tis_capped_tokens"] / tokens} if "tis_weight_sum" in last.metrics else {}),
            "entropy": entropy_sum / max(scored, 1.0),
            # rollout engine vs trainer logprobs of the same tokens, before the update
            "mismatch/mean_abs_diff": mm_abs / max(mm_tokens, 1.0),
            "mismatch/max_abs_diff": mm_max,
            "mismatch/exp_mean_abs_diff": math.exp(mm_abs / max(mm_tokens, 1.0)),
            "mismatch/token_mult_prob_error": mm_exp / max(mm_tokens, 1.0),
            "grad_norm": last.grad_norm,
            "lr": last.lr,
            # the schedule that ran, and the weight-gradient GEMMs ZB-H1 deferred and ran (all ranks, all updates)
            "pipeline/schedule": last.schedule,
            "pipeline/deferred_wgrad_ops": sum(r.deferred_wgrad_ops for r in results),
            # ModuleQueue on the last stage: whether it streamed weights, and the MiB it released (all updates)
            "module_queue/active": any(r.module_queue_active for r in results),
            "module_queue/offloaded_mib": sum(r.module_queue_offloaded_mib for r in results),
            "batch/real_tokens": int(real),
            "batch/processed_tokens": int(processed),
            "batch/padding_fraction": 1.0 - real / max(processed, 1.0),
            # what packing saves against one sequence per row (0 when packing is off)
            "batch/tokens_saved_fraction": 1.0 - processed / max(padded, 1.0),
            **timings,  # time/sync_s is 0 for the embedded backend: the rollout engine is the policy itself
            **({"weight_sync/bytes": sync.bytes, "weight_sync/seconds": sync.seconds, "weight_sync/gbps": sync.gbps}
               if sync is not None else {}),
            "tokens_per_s": float(batch.generated.lengths.sum()) / max(timings["time/rollout_s"], 1e-9),
        }

    def _performance_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        """``training.include_performance_metrics``: throughput and memory on top of the step timings."""
        import resource

        trained = metrics.get("batch/processed_tokens", 0) * self.grpo.ppo_epochs
        out = {
            "perf/step_s": step_s,
            "perf/completions_per_s": self.layout.completions_per_rollout / max(step_s, 1e-9),
            "perf/train_tokens_per_s": trained / max(metrics.get("time/train_s", 0.0), 1e-9),
            # ru_maxrss is in KiB on Linux
            "perf/peak_host_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
        if torch.cuda.is_available():
            out["perf/peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    # -- BaseTrainer --------------------------------------------------------------------------------
    def _resume_point(self, resume_from_checkpoint: str | None) -> Path | None:
        if resume_from_checkpoint:
            return Path(resume_from_checkpoint)
        if getattr(self.config.training, "try_resume_from_last_checkpoint", False):
            return newest_valid_checkpoint(self.output_dir / "checkpoints")
        return None

    def train(self, resume_from_checkpoint: str | None = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        resume = self._resume_point(resume_from_checkpoint)
        if resume is not None:
            state = load_checkpoint(self.engine, resume)
            self.step, self.data_position = state["step"], state["data_position"]
            self.weights_synced_at = -1  # the rollout engines still hold the initial weights
            if global_rank() == 0:
                logger.info(f"Resumed from {resume}: continuing at GRPO step {self.step + 1} "
                            f"(data position {self.data_position}).")
        max_steps = self.config.training.max_steps
        if self.step >= max_steps:
            self._finish_without_training(resume, max_steps)
            return
        save_steps = self.config.training.save_steps
        # the metrics of the steps after the resumed one (an interrupted run's) are dropped, so each step is logged once
        metrics_log = MetricsLogger(self.output_dir, enabled=global_rank() == 0, tensorboard=self.config.training.enable_tensorboard,
                                    start_step=self.step, wandb_run=self._wandb_settings())
        progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("reward {task.fields[reward]:.3f}"),
            TimeElapsedColumn(), disable=global_rank() != 0,
        )
        steps_per_epoch = -(-len(self.dataset) // self.layout.prompts_per_rollout)
        evals = eval_schedule(self.config.training, max_steps, steps_per_epoch) if self.evaluators else set()
        if 0 in evals and self.step == 0:  # the starting point of a fresh run (a resumed run logged it)
            metrics_log.log(0, self.evaluate())
        with progress:
            task = progress.add_task("grpo", total=max_steps, completed=self.step, reward=float("nan"))
            while self.step < max_steps:
                started = time.perf_counter()
                metrics = self.grpo_step()
                if getattr(self.config.training, "include_performance_metrics", False):
                    metrics.update(self._performance_metrics(metrics, time.perf_counter() - started))
                if self.step in evals:
                    metrics.update(self.evaluate())
                if self.async_writer is not None:
                    self.async_writer.poll()
                metrics_log.log(self.step, metrics)
                progress.update(task, completed=self.step, reward=metrics["reward/mean"])
                if save_steps and self.step % save_steps == 0 and self.step < max_steps:
                    self.save_state()
        self.save_state()
        if self.async_writer is not None:
            self.async_writer.close()
        metrics_log.close()
        self.backend.close()
        if self.config.training.save_final_model:
            self.save_model(self.config, final=True)
        if global_rank() == 0:
            plot_curves(self.output_dir)

    def evaluate(self) -> dict[str, float]:
        """Greedy generation on every eval set with the current policy (collective); ``eval/`` (and each further
        set's prefix) metrics."""
        assert self.evaluators
        self._sync_rollout_weights()
        metrics: dict[str, float] = {}
        for evaluator in self.evaluators:
            mine = evaluator.run()
            if global_rank() == 0:
                logger.info(f"eval at step {self.step}: {evaluator.summary(mine)}")
            metrics.update(mine)
        self.last_metrics.update(metrics)
        return metrics

    def _finish_without_training(self, resume: Path | None, max_steps: int) -> None:
        """Resumed at (or past) training.max_steps: nothing to train; keep the run's files as they are, and
        export the model only if the run never did."""
        if global_rank() == 0:
            logger.warning(f"Nothing to train: {resume} is at GRPO step {self.step} and training.max_steps is {max_steps}. "
                           "Raise training.max_steps to train further.")
        if self.async_writer is not None:
            self.async_writer.close()
        self.backend.close()
        if self.config.training.save_final_model and not (self.output_dir / "hf_model").exists():
            self.save_model(self.config, final=True)

    def _wandb_settings(self) -> dict[str, Any] | None:
        """``training.enable_wandb``: W&B run settings (project from WANDB_PROJECT, name from run_name)."""
        t = self.config.training
        if not getattr(t, "enable_wandb", False):
            return None
        import dataclasses

        config = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                  for k, v in (("megatron", self.config.megatron), ("grpo", self.config.grpo))}
        return {"name": getattr(t, "run_name", None), "config": config}

    def save_state(self) -> None:
        save_checkpoint(
            self.engine,
            self.output_dir / "checkpoints",
            self.step,
            {"data_position": self.data_position},
            self.hf_artifacts,
            keep_last=self.config.megatron.checkpoint_config.keep_last_n_checkpoints,
            async_writer=self.async_writer,
        )

    def save_model(self, config: Any, final: bool = True) -> None:
        self.weights.save(self.output_dir / "hf_model")

    def get_last_eval_metrics(self) -> dict[str, Any]:
        return dict(self.last_metrics)
