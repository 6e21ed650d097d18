"""The GRPO loss in the engine's loss contract (see ``engine/engine.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oumi_megatron.engine.engine import LossFn
from oumi_megatron.grpo.algorithm import (
    aggregate,
    icepop_weights,
    kl_divergence,
    logprob_mismatch,
    sequence_ratio_mask,
    truncated_importance_weights,
)
from oumi_megatron.grpo.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams


def make_grpo_loss_fn(grpo: MegatronGrpoParams) -> LossFn:
    """Per-token GRPO loss for ``MegatronEngine.train_step``, from the ``grpo:`` section: the policy-gradient term
    of ``grpo.policy_loss`` (grpo/registry.py), the KL term, ``grpo.loss_aggregation``.

    Each microbatch must carry, aligned with the engine's logprob positions (position t scores
    token t + 1): ``completion_mask`` [b, T], ``old_logprobs`` [b, T], ``advantages`` [b] or [b, T] and, when
    ``grpo.beta > 0``, ``ref_logprobs`` [b, T]; packed rows also carry ``segment_ids`` [b, T]
    (see ``trainer/batches.py``). Under ``grpo.off_policy_correction`` (``tis_cap`` alone: ``tis``),
    ``rollout_logprobs`` [b, T] (the rollout engine's logprobs of the sampled tokens) weigh each token's
    policy-gradient term: truncated importance sampling (``tis``, ``seq_mask_tis``) or IcePop's band (``icepop``).
    Metrics are sums over the microbatch (the trainer divides by ``completion_tokens``).

    A microbatch without ``old_logprobs`` is trained on by the policy that generated it (the step's first
    optimizer step): its old logprobs are this forward's, detached (TRL's on-policy shortcut), so the ratio is
    exactly 1, and the metrics the old-logprob pass would have given come from here: ``entropy_sum`` (the
    batch's ``entropy``, from ``train_step(with_entropy=True)``) and, with ``rollout_logprobs``, the mismatch
    sums ``mismatch_abs_sum``, ``mismatch_exp_abs_sum``, ``mismatch_tokens``, ``mismatch_abs_max``.
    """

    policy_loss = POLICY_LOSSES.get(grpo.policy_loss)
    correction, cap, (lower, upper) = grpo.off_policy_correction_choice, grpo.importance_cap, grpo.icepop_band

    def loss_fn(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["completion_mask"].to(logprobs.dtype)
        on_policy = "old_logprobs" not in batch
        old_logprobs = logprobs.detach() if on_policy else batch["old_logprobs"]
        pg_loss, was_clipped = policy_loss(logprobs, old_logprobs, batch["advantages"], mask, grpo,
                                           batch.get("segment_ids"))
        tis_metrics: dict[str, torch.Tensor] = {}
        if cap is not None and "rollout_logprobs" in batch:
            # old_logprobs are the trainer's, before any update (the proximal policy); rollout_logprobs the engine's
            # (the behaviour policy: another precision, or older weights under grpo.max_staleness)
            tis = truncated_importance_weights(old_logprobs, batch["rollout_logprobs"], cap)
            tis_metrics = {"tis_weight_sum": (tis * mask).sum(), "tis_capped_tokens": ((tis >= cap) * mask).sum()}
            if correction == "seq_mask_tis":
                kept = sequence_ratio_mask(old_logprobs, batch["rollout_logprobs"], mask, cap, batch.get("segment_ids"))
                tis = tis * kept
                tis_metrics["off_policy_masked_tokens"] = ((1.0 - kept) * mask).sum()
            pg_loss = pg_loss * tis
        elif correction == "icepop" and "rollout_logprobs" in batch:
            weight, kept = icepop_weights(old_logprobs, batch["rollout_logprobs"], lower, upper)
            tis_metrics = {"off_policy_weight_sum": (weight * mask).sum(), "off_policy_masked_tokens": ((1.0 - kept) * mask).sum()}
            pg_loss = pg_loss * weight
        per_token = pg_loss
        kl = torch.zeros_like(logprobs)
        if grpo.beta > 0:
            kl = kl_divergence(logprobs, batch["ref_logprobs"], grpo.kl_estimator)
            per_token = per_token + grpo.beta * kl
        loss_sum, count = aggregate(per_token, mask, grpo.loss_aggregation, grpo.max_completion_length, batch.get("segment_ids"))
        metrics = {
            "completion_tokens": mask.sum().detach(),
            "pg_loss_sum": (pg_loss * mask).sum().detach(),
            "kl_sum": (kl * mask).sum().detach(),
            "clipped_tokens": (was_clipped * mask).sum().detach(),
            "ratio_sum": (torch.exp(logprobs - old_logprobs) * mask).sum().detach(),
            **tis_metrics,
            **(_old_logprob_pass_metrics(old_logprobs, mask, batch) if on_policy else {}),
        }
        return loss_sum, count, metrics

    return loss_fn


def _old_logprob_pass_metrics(old_logprobs: torch.Tensor, mask: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entropy and rollout/trainer mismatch sums of a microbatch whose old logprobs are the training forward's."""
    out = {"entropy_sum": (batch["entropy"] * mask).sum()} if "entropy" in batch else {}
    if "rollout_logprobs" in batch:
        m = logprob_mismatch(batch["rollout_logprobs"], old_logprobs, mask, batch.get("stale_mask"))
        out.update({"mismatch_abs_sum": m["abs_diff_sum"], "mismatch_exp_abs_sum": m["exp_abs_diff_sum"],
                    "mismatch_tokens": m["tokens"], "mismatch_abs_max": m["abs_diff_max"]})
        if "stale_tokens" in m:
            out.update({"mismatch_stale_abs_sum": m["stale_abs_diff_sum"], "mismatch_stale_tokens": m["stale_tokens"]})
    return {k: v.detach() for k, v in out.items()}
