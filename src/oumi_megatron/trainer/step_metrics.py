"""What one GRPO step reports: the rows of metrics.jsonl (and TensorBoard, W&B), built from the step's pieces.

``reward_metrics``: rewards, completion lengths, dynamic sampling, over everything generated this step;
``step_metrics``: those plus advantages, loss, KL, clipping, entropy, rollout/trainer logprob mismatch, token
counts and timings (token sums reduced over DP, so rank 0 logs the whole batch); ``skipped_step_metrics``: a step
that trained on nothing; ``performance_metrics``: ``training.include_performance_metrics``; ``link_metrics``: the
engines' own (weight-sync link, restarts); ``wandb_settings``: ``training.enable_wandb``. Where the metrics go is
trainer/metrics.py (``MetricsLogger``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.engine.engine import StepResult
from oumi_megatron.rollout.base import WeightSyncStats
from oumi_megatron.trainer.batches import MicrobatchLayout
from oumi_megatron.trainer.dp import max_dp, sum_dp
from oumi_megatron.trainer.rollout_batch import StepBatch
from oumi_megatron.utils.disk import GIB
from oumi_megatron.utils.ranks import global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.training_config import MegatronTrainingConfig


def reward_metrics(batch: StepBatch, grpo: MegatronGrpoParams) -> dict[str, Any]:
    """Rewards of everything generated this step (all rounds: an unfiltered sample of the policy), completion
    lengths, and what dynamic sampling and the overlong options did."""
    gen, g = batch.generated, grpo
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
        # generated tokens (every DP rank's) over the time in generate alone (no scoring, no weight sync)
        "rollout/tokens_per_s": float(gen.lengths.sum()) / max(batch.generation_s, 1e-9),
    }
    if batch.decode_ms_per_step is not None:
        out["rollout/decode_ms_per_step"] = batch.decode_ms_per_step
    out.update(batch.episode_metrics)
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


def skipped_step_metrics(batch: StepBatch, grpo: MegatronGrpoParams, timings: dict[str, float],
                         schedule: str) -> dict[str, Any]:
    """A step that trained on nothing (no optimizer step): its rewards and timings."""
    return {**reward_metrics(batch, grpo), **timings, "update_skipped": 1, "pipeline/schedule": schedule,
            "pipeline/deferred_wgrad_ops": 0, "module_queue/active": False, "module_queue/offloaded_mib": 0.0}


def _token_sums(layouts: list[MicrobatchLayout], lp: dict[str, float], device: torch.device) -> dict[str, float]:
    """The batch's token counts, entropy and mismatch sums, over every DP rank."""
    keys = ("real", "processed", "padded", "entropy_sum", "scored", "mm_abs", "mm_exp", "mm_tokens", "mm_stale_abs",
            "mm_stale_tokens")
    sums = sum_dp([
        float(sum(lo.real_tokens for lo in layouts)), float(sum(lo.processed_tokens for lo in layouts)),
        float(sum(lo.padded_tokens for lo in layouts)),
        lp["entropy_sum"], float(sum(float(mb["completion_mask"].sum()) for lo in layouts for mb in lo.microbatches)),
        lp["abs_diff_sum"], lp["exp_abs_diff_sum"], lp["tokens"], lp.get("stale_abs_diff_sum", 0.0),
        lp.get("stale_tokens", 0.0),
    ], device)
    return {**dict(zip(keys, sums)), "mm_max": max_dp(lp["abs_diff_max"], device)}


def mismatch_by_staleness(s: dict[str, float]) -> dict[str, float]:
    """``mismatch/mean_abs_diff_stale`` (tokens an older policy version sampled) and ``..._current`` (the trainer's
    version), from the step's DP-summed sums; a side with no token is left out."""
    stale, current = s["mm_stale_tokens"], s["mm_tokens"] - s["mm_stale_tokens"]
    out = {}
    if stale > 0:
        out["mismatch/mean_abs_diff_stale"] = s["mm_stale_abs"] / stale
    if current > 0:
        out["mismatch/mean_abs_diff_current"] = (s["mm_abs"] - s["mm_stale_abs"]) / current
    return out


def step_metrics(batch: StepBatch, advantages: torch.Tensor, trainable: torch.Tensor, layouts: list[MicrobatchLayout],
                 lp: dict[str, float], results: list[StepResult], timings: dict[str, float],
                 sync: WeightSyncStats | None, grpo: MegatronGrpoParams, device: torch.device) -> dict[str, Any]:
    """A trained step's row. ``lp``: the old-logprob phase's sums; ``results``: every optimizer step's."""
    s = _token_sums(layouts, lp, device)
    # a first update that took its old logprobs from its own forward reports that pass's sums (over DP already)
    first = results[0].metrics
    for key, name in (("entropy_sum", "entropy_sum"), ("mm_abs", "mismatch_abs_sum"), ("mm_exp", "mismatch_exp_abs_sum"),
                      ("mm_tokens", "mismatch_tokens"), ("mm_stale_abs", "mismatch_stale_abs_sum"),
                      ("mm_stale_tokens", "mismatch_stale_tokens")):
        s[key] += first.get(name, 0.0)
    s["mm_max"] = max(s["mm_max"], first.get("mismatch_abs_max", 0.0))
    last = results[-1]
    tokens = max(last.metrics.get("completion_tokens", 0.0), 1.0)
    mm_tokens = max(s["mm_tokens"], 1.0)
    return {
        **reward_metrics(batch, grpo),
        "advantage/mean": advantages.mean().item(),
        "advantage/std": advantages.std().item() if len(advantages) > 1 else 0.0,
        "advantage/max_abs": advantages.abs().max().item(),
        "batch/untrained_samples": int((~trainable).sum()),
        "loss": sum(r.loss for r in results) / len(results),
        "kl": last.metrics.get("kl_sum", 0.0) / tokens,
        "clip_fraction": last.metrics.get("clipped_tokens", 0.0) / tokens,
        **({"tis/mean_weight": last.metrics["tis_weight_sum"] / tokens,
            "tis/capped_fraction": last.metrics["tis_capped_tokens"] / tokens} if "tis_weight_sum" in last.metrics else {}),
        **({"off_policy/masked_token_fraction": last.metrics["off_policy_masked_tokens"] / tokens}
           if "off_policy_masked_tokens" in last.metrics else {}),
        **({"off_policy/mean_weight": last.metrics["off_policy_weight_sum"] / tokens}
           if "off_policy_weight_sum" in last.metrics else {}),
        "entropy": s["entropy_sum"] / max(s["scored"], 1.0),
        # rollout engine vs trainer logprobs of the same tokens, before the update
        "mismatch/mean_abs_diff": s["mm_abs"] / mm_tokens,
        "mismatch/max_abs_diff": s["mm_max"],
        "mismatch/exp_mean_abs_diff": math.exp(s["mm_abs"] / mm_tokens),
        "mismatch/token_mult_prob_error": s["mm_exp"] / mm_tokens,
        # asynchronous GRPO: the same mismatch over the tokens an older policy sampled, and over the current policy's
        **(mismatch_by_staleness(s) if "stale_tokens" in lp or "mismatch_stale_tokens" in first else {}),
        "grad_norm": last.grad_norm,
        "lr": last.lr,
        # the schedule that ran, and the weight-gradient GEMMs ZB-H1 deferred and ran (all ranks, all updates)
        "pipeline/schedule": last.schedule,
        "pipeline/deferred_wgrad_ops": sum(r.deferred_wgrad_ops for r in results),
        # ModuleQueue on the last stage: whether it streamed weights, and the MiB it released (all updates)
        "module_queue/active": any(r.module_queue_active for r in results),
        "module_queue/offloaded_mib": sum(r.module_queue_offloaded_mib for r in results),
        # of time/train_s: the forward and backward passes and the optimizer steps (the rest: the host's batches)
        "time/train_forward_backward_s": sum(r.forward_backward_s for r in results),
        "time/train_optimizer_s": sum(r.optimizer_s for r in results),
        "batch/real_tokens": int(s["real"]),
        "batch/processed_tokens": int(s["processed"]),
        "batch/padding_fraction": 1.0 - s["real"] / max(s["processed"], 1.0),
        # what packing saves against one sequence per row (0 when packing is off)
        "batch/tokens_saved_fraction": 1.0 - s["processed"] / max(s["padded"], 1.0),
        **timings,  # time/sync_s is 0 for the embedded backend: the rollout engine is the policy itself
        **({"weight_sync/bytes": sync.bytes, "weight_sync/seconds": sync.seconds, "weight_sync/gbps": sync.gbps,
            "weight_sync/export_s": sync.export_seconds, "weight_sync/senders": sync.senders,
            **({"weight_sync/sender_bytes_max": sync.sender_bytes} if sync.sender_bytes else {}),
            **({"weight_sync/probe_max_diff": sync.probe_max_diff} if sync.probe_max_diff is not None else {})}
           if sync is not None else {}),
        "tokens_per_s": float(batch.generated.lengths.sum()) / max(timings["time/rollout_s"], 1e-9),
    }


def performance_metrics(metrics: dict[str, Any], step_s: float, completions_per_rollout: int,
                        ppo_epochs: int) -> dict[str, float]:
    """``training.include_performance_metrics``: throughput and memory on top of the step timings."""
    import resource

    trained = metrics.get("batch/processed_tokens", 0) * ppo_epochs
    out = {
        "perf/step_s": step_s,
        "perf/completions_per_s": completions_per_rollout / max(step_s, 1e-9),
        "perf/train_tokens_per_s": trained / max(metrics.get("time/train_s", 0.0), 1e-9),
        # ru_maxrss is in KiB on Linux
        "perf/peak_host_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if torch.cuda.is_available():
        out["perf/peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def link_metrics(engine: dict[str, float], step: dict[str, Any]) -> dict[str, float]:
    """The engines' own metrics (rank 0) and, where the step moved weights over a link whose plain broadcast was
    measured, the push's share of that bandwidth (``weight_sync/fraction_of_raw``)."""
    out = dict(engine)
    raw, gbps = engine.get("weight_sync/raw_gbps"), step.get("weight_sync/gbps")
    if raw and gbps:
        out["weight_sync/fraction_of_raw"] = gbps / raw
    return out


SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials", "auth"})
"""A setting named with one of these words (``api_key``, ``hf_token``; not ``max_tokens``) is not sent to a dashboard."""
REDACTED = "<redacted>"


def _secret(name: Any) -> bool:
    return isinstance(name, str) and not SECRET_WORDS.isdisjoint(re.split(r"[^a-z0-9]+", name.lower()))


def redacted(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every setting named like a secret (``SECRET_WORDS``) replaced."""
    if isinstance(value, dict):
        return {k: REDACTED if _secret(k) else redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value


def wandb_settings(config: MegatronTrainingConfig) -> dict[str, Any] | None:
    """``training.enable_wandb``: W&B run settings (project from WANDB_PROJECT, name from run_name); the config it
    shows has its secrets redacted (reward kwargs and engine arguments are the user's free-form settings)."""
    t = config.training
    if not t.enable_wandb:
        return None
    sections = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                for k, v in (("megatron", config.megatron), ("grpo", config.grpo))}
    return {"name": t.run_name, "config": redacted(sections)}
