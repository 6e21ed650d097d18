"""GRPO (DeepSeekMath, arXiv:2402.03300) with the refinements current practice uses:
DAPO's asymmetric clipping and token-level mean, Dr. GRPO's mean-only advantages and length
normalization, and Schulman's k1/k2/k3 KL estimators.

Shapes: ``[B]`` per sequence, ``[B, T]`` per token. ``mask`` is 1 on completion tokens that are
trained on (not prompt, not padding). Everything here is differentiable where it must be and free of
NaNs on degenerate inputs (a group with identical rewards, an all-masked row).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group(r)) / (std_group(r) + eps)`` (float32).

    ``rewards`` is ``[B]`` with the ``group_size`` completions of each prompt adjacent. With
    ``scale_rewards=False`` (Dr. GRPO) the std division is skipped; the std is unbiased, as TRL's.
    ``valid`` ([B] bool) marks samples whose reward exists (``on_reward_error: skip`` drops the
    others): only valid samples enter their group's mean and std, invalid ones get 0.

    A group whose valid rewards are all equal (or that has fewer than 2) gets exactly 0, in any
    dtype: the statistics are taken in float64, and such groups are zeroed explicitly, because even
    float64 gives ``mean([0.1] * 8) != 0.1``, and that rounding residue divided by a std of the same
    size would be an advantage of order 1.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be [B] with B divisible by group_size={group_size}, got {tuple(rewards.shape)}")
    grouped = rewards.double().view(-1, group_size)
    keep = torch.ones_like(grouped, dtype=torch.bool) if valid is None else valid.view(-1, group_size).bool()
    count = keep.sum(dim=1, keepdim=True)
    mean = torch.where(keep, grouped, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(keep, grouped - mean, 0.0)
    if scale_rewards:
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    lowest = torch.where(keep, grouped, torch.inf).amin(dim=1, keepdim=True)
    highest = torch.where(keep, grouped, -torch.inf).amax(dim=1, keepdim=True)
    constant = (count < 2) | (lowest == highest)
    return torch.where(constant, 0.0, centred).float().view(-1)


def kl_divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = log(p/q); k2 = (log(p/q))^2 / 2; k3 = q/p - 1 - log(q/p) (unbiased, always >= 0), with
    p the policy and q the reference probability of the sampled token.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        neg = -log_ratio.clamp(-20.0, 20.0)  # log(q/p), clamped so exp() stays finite
        return neg.exp() - 1.0 - neg
    raise ValueError(f"unknown kl_estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a per-token loss (to minimize), and where clipping was active.

    ``ratio = exp(logprobs - old_logprobs)``; loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A).
    ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, was_clipped


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_len: int | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) such that the global loss is sum over microbatches/ranks of ``sum`` / of ``count``.

    token_mean: every completion token weighs the same (DAPO); count = tokens.
    seq_mean: mean over each sequence's tokens, then over sequences (original GRPO); count = sequences.
    seq_mean_token_sum_norm: each sequence's token sum / ``max_len`` (a constant), then mean over
    sequences (Dr. GRPO); count = sequences. Only sequences with at least one masked-in token count.

    Sequences are the rows, or, for packed rows, ``segment_ids`` [B, T]: the sequence of each token
    numbered 0..S-1 across the microbatch, -1 on padding.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum(), mask.sum().round().to(torch.int64)
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation {mode!r}; use one of {LOSS_AGGREGATIONS}")
    if segment_ids is None:
        seq_sum, seq_tokens = masked.sum(-1), mask.sum(-1)
    else:
        ids = segment_ids.reshape(-1)
        keep = ids >= 0
        n = int(ids.max().item()) + 1 if bool(keep.any()) else 0
        seq_sum = masked.new_zeros(n).index_add(0, ids[keep], masked.reshape(-1)[keep])
        seq_tokens = mask.new_zeros(n).index_add(0, ids[keep], mask.reshape(-1)[keep])
    # sequences with no trained token (skipped rewards, padding rows) are not in the mean
    count = (seq_tokens > 0).sum().to(torch.int64)
    if mode == "seq_mean":
        return (seq_sum / seq_tokens.clamp(min=1.0)).sum(), count
    if not max_len:
        raise ValueError("seq_mean_token_sum_norm needs max_len (grpo.max_completion_length)")
    return (seq_sum / float(max_len)).sum(), count


def logprob_mismatch(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's logprobs of the sampled tokens are from the trainer's, on the same
    tokens (before any update). Sums over masked tokens, so they add up over microbatches and ranks:
    ``abs_diff_sum`` (/ tokens = mean |diff|), ``exp_abs_diff_sum`` (/ tokens = NeMo-RL's
    token_mult_prob_error, the mean of exp(|diff|)), ``tokens``; and ``abs_diff_max``."""
    mask = mask.to(trainer_logprobs.dtype)
    diff = (rollout_logprobs - trainer_logprobs).abs() * mask
    return {
        "abs_diff_sum": diff.sum(),
        "exp_abs_diff_sum": (diff.exp() * mask).sum(),
        "tokens": mask.sum(),
        "abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
    }


def truncated_importance_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"): the samples came from the rollout engine's distribution, the
    gradient is taken for the trainer's, so each token's policy-gradient term is weighted by
    ``min(p_trainer / p_rollout, cap)`` (no gradient through the weight)."""
    return torch.exp(trainer_logprobs - rollout_logprobs).clamp(max=cap).detach()
