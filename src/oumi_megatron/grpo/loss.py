"""The GRPO loss in the engine's loss contract (see ``engine/engine.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oumi_megatron.engine.engine import LossFn
from oumi_megatron.grpo.algorithm import aggregate, kl_divergence, truncated_importance_weights
from oumi_megatron.grpo.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams


def make_grpo_loss_fn(grpo: MegatronGrpoParams) -> LossFn:
    """Per-token GRPO loss for ``MegatronEngine.train_step``, from the ``grpo:`` section: the policy-gradient term
    of ``grpo.policy_loss`` (grpo/registry.py), the KL term, ``grpo.loss_aggregation``.

    Each microbatch must carry, aligned with the engine's logprob positions (position t scores
    token t + 1): ``completion_mask`` [b, T], ``old_logprobs`` [b, T], ``advantages`` [b] or [b, T] and, when
    ``grpo.beta > 0``, ``ref_logprobs`` [b, T]; packed rows also carry ``segment_ids`` [b, T]
    (see ``trainer/batches.py``). With ``grpo.tis_cap`` set, ``rollout_logprobs`` [b, T] (the rollout
    engine's logprobs of the sampled tokens) turn on truncated importance sampling. Metrics are sums over the microbatch (the trainer
    divides by ``completion_tokens``).
    """

    policy_loss = POLICY_LOSSES.get(grpo.policy_loss)

    def loss_fn(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["completion_mask"].to(logprobs.dtype)
        pg_loss, was_clipped = policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask, grpo,
                                           batch.get("segment_ids"))
        tis_metrics: dict[str, torch.Tensor] = {}
        if grpo.tis_cap is not None and "rollout_logprobs" in batch:
            # old_logprobs are the trainer's, before any update: the behaviour policy as the trainer sees it
            tis = truncated_importance_weights(batch["old_logprobs"], batch["rollout_logprobs"], grpo.tis_cap)
            pg_loss = pg_loss * tis
            tis_metrics = {"tis_weight_sum": (tis * mask).sum(),
                           "tis_capped_tokens": ((tis >= grpo.tis_cap) * mask).sum()}
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
            "ratio_sum": (torch.exp(logprobs - batch["old_logprobs"]) * mask).sum().detach(),
            **tis_metrics,
        }
        return loss_sum, count, metrics

    return loss_fn
