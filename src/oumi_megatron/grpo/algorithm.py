"""GRPO (DeepSeekMath, arXiv:2402.03300) with the refinements current practice uses:
DAPO's asymmetric clipping and token-level mean, Dr. GRPO's mean-only advantages and length
normalization, and Schulman's k1/k2/k3 KL estimators.

Shapes: ``[B]`` per sequence, ``[B, T]`` per token. ``mask`` is 1 on completion tokens that are
trained on (not prompt, not padding). Everything here is differentiable where it must be and free of
NaNs on degenerate inputs (a group with identical rewards, an all-masked row).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from oumi_megatron.config.grpo_params import OFF_POLICY_CORRECTIONS, ON_REWARD_ERROR
from oumi_megatron.config.problems import choices
from oumi_megatron.grpo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, register_advantage_estimator, register_policy_loss

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig


KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")
SCALE_REWARDS = ("group", "batch", "none")


def scale_rewards_mode(value: bool | str) -> str:
    """``grpo.scale_rewards`` as one of SCALE_REWARDS (TRL's names); the boolean form stays an alias:
    true = ``group``, false = ``none`` (Dr. GRPO)."""
    if isinstance(value, bool):
        return "group" if value else "none"
    mode = {"true": "group", "false": "none"}.get(str(value).lower(), str(value).lower())
    if mode not in SCALE_REWARDS:
        raise ValueError(f"unknown value {value!r}. Use one of {', '.join(SCALE_REWARDS)} (or true / false).")
    return mode


def groups_with_signal(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: True where a group's valid rewards differ (DAPO's dynamic sampling keeps these). A group
    whose valid rewards are all equal, or that has fewer than 2, gets a zero advantage under every built-in
    estimator (``group_advantages`` zeroes it through this function), so it adds no policy gradient: only the KL
    term and the loss's token count."""
    grouped = rewards.double().view(-1, group_size)
    keep = valid.bool().view(-1, group_size)
    lowest = torch.where(keep, grouped, torch.inf).amin(dim=1)
    highest = torch.where(keep, grouped, -torch.inf).amax(dim=1)
    return (keep.sum(dim=1) >= 2) & (lowest != highest)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: bool | str = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group(r)) / (std + eps)`` (float32).

    ``rewards`` is ``[B]`` with the ``group_size`` completions of each prompt adjacent. ``scale_rewards``
    (scale_rewards_mode): ``group`` divides by each group's std, ``batch`` by the std of the whole batch's
    rewards (TRL's ``scale_rewards="batch"``: more robust to low-variance groups), ``none`` not at all
    (Dr. GRPO); stds are unbiased, as TRL's. ``valid`` ([B] bool) marks samples whose reward exists
    (``on_reward_error: skip`` drops the others): only valid samples enter the means and stds, invalid ones get 0.

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
    mode = scale_rewards_mode(scale_rewards)
    if mode == "group":
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    elif mode == "batch":
        kept = grouped[keep]
        std = kept.std() if kept.numel() > 1 else kept.new_zeros(())
        centred = centred / (std + eps)
    constant = ~groups_with_signal(rewards, keep, group_size).unsqueeze(1)
    return torch.where(constant, 0.0, centred).float().view(-1)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each sample's reward minus the mean of the other valid samples of its group,
    ``n / (n - 1) x (r - mean_group(r))`` (float32); constant groups and groups of fewer than 2 valid samples get 0."""
    n = (torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()).view(-1, group_size).sum(1, keepdim=True)
    centred = group_advantages(rewards, group_size, "none", valid=valid).double().view(-1, group_size)
    return (centred * n / (n - 1).clamp(min=1)).float().view(-1)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's ``overlong_buffer``): 0 up to
    ``max_length - buffer_length`` completion tokens, then falling linearly to ``-factor`` at ``max_length``
    and beyond (float64, [N])."""
    expected = max_length - buffer_length
    return (-(lengths.double() - expected) / buffer_length * factor).clamp(min=-factor, max=0.0)


@register_advantage_estimator("grpo")
def grpo_advantage_estimator(rewards: torch.Tensor, valid: torch.Tensor, grpo: MegatronGrpoParams) -> torch.Tensor:
    return group_advantages(rewards, grpo.num_generations, grpo.scale_rewards, valid=valid)


@register_advantage_estimator("rloo")
def rloo_advantage_estimator(rewards: torch.Tensor, valid: torch.Tensor, grpo: MegatronGrpoParams) -> torch.Tensor:
    return leave_one_out_advantages(rewards, grpo.num_generations, valid=valid)


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
    clip_ratio_c: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a per-token loss (to minimize), and where clipping was active.

    ``ratio = exp(logprobs - old_logprobs)`` (or ``exp(log_ratio)`` when given: GSPO's sequence-level ratio);
    loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A). ``clip_ratio_c`` (dual clip, Ye et al. 2020,
    verl's ``clip_ratio_c``): where A < 0 the loss is at most -A * c, so a huge ratio on a bad token cannot
    dominate the step. ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs if log_ratio is None else log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.to(logprobs.dtype)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's sequence's mean of ``values`` over its masked-in tokens, broadcast back to [B, T]: per row,
    or per packed sequence (``segment_ids`` [B, T], -1 on padding, which gets 0)."""
    mask = mask.to(values.dtype)
    sums, tokens = _per_sequence_sums(values * mask, mask, segment_ids)
    means = sums / tokens.clamp(min=1.0)
    if segment_ids is None:
        return means.unsqueeze(-1).expand_as(values)
    ids = segment_ids.reshape(-1)
    return torch.where(ids >= 0, means[ids.clamp(min=0)], 0.0).view_as(values)


@register_policy_loss("grpo")
def grpo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     grpo: MegatronGrpoParams, segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level importance ratios, PPO's clip (DAPO's clip-higher), optional dual clip."""
    return clipped_surrogate(logprobs, old_logprobs, advantages, grpo.epsilon, grpo.epsilon_high,
                             grpo.clip_ratio_c)


@register_policy_loss("gspo")
def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     grpo: MegatronGrpoParams, segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025; TRL's ``importance_sampling_level="sequence"``): one importance ratio per sequence,
    exp(mean over its tokens of log(p / p_old)), clipped as PPO's; every token of a sequence gets its loss. The
    paper's clip ranges are far smaller than GRPO's (3e-4 / 4e-4): set grpo.epsilon / epsilon_high for it."""
    log_ratio = sequence_mean(logprobs - old_logprobs, mask, segment_ids)
    return clipped_surrogate(logprobs, old_logprobs, advantages, grpo.epsilon, grpo.epsilon_high,
                             grpo.clip_ratio_c, log_ratio=log_ratio)


def _per_sequence_sums(masked: torch.Tensor, mask: torch.Tensor,
                       segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ``masked``, masked-in tokens) per sequence: per row, or per packed sequence of ``segment_ids``
    [B, T] (numbered 0..S-1 across the microbatch, -1 on padding)."""
    if segment_ids is None:
        return masked.sum(-1), mask.sum(-1)
    ids = segment_ids.reshape(-1)
    keep = ids >= 0
    n = int(ids.max().item()) + 1 if bool(keep.any()) else 0
    return (masked.new_zeros(n).index_add(0, ids[keep], masked.reshape(-1)[keep]),
            mask.new_zeros(n).index_add(0, ids[keep], mask.reshape(-1)[keep]))


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
    seq_sum, seq_tokens = _per_sequence_sums(masked, mask, segment_ids)
    # sequences with no trained token (skipped rewards, padding rows) are not in the mean
    count = (seq_tokens > 0).sum().to(torch.int64)
    if mode == "seq_mean":
        return (seq_sum / seq_tokens.clamp(min=1.0)).sum(), count
    if not max_len:
        raise ValueError("seq_mean_token_sum_norm needs max_len (grpo.max_completion_length)")
    return (seq_sum / float(max_len)).sum(), count


def logprob_mismatch(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor,
                     stale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the rollout engine's logprobs of the sampled tokens are from the trainer's, on the same
    tokens (before any update). Sums over masked tokens, so they add up over microbatches and ranks:
    ``abs_diff_sum`` (/ tokens = mean |diff|), ``exp_abs_diff_sum`` (/ tokens = NeMo-RL's
    token_mult_prob_error, the mean of exp(|diff|)), ``tokens``; and ``abs_diff_max``. ``stale`` (asynchronous GRPO:
    1 where an older policy version than the trainer's sampled the token): also ``stale_abs_diff_sum`` and
    ``stale_tokens``, the same sums over those tokens alone."""
    mask = mask.to(trainer_logprobs.dtype)
    diff = (rollout_logprobs - trainer_logprobs).abs() * mask
    out = {
        "abs_diff_sum": diff.sum(),
        "exp_abs_diff_sum": (diff.exp() * mask).sum(),
        "tokens": mask.sum(),
        "abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
    }
    if stale is not None:
        stale = stale.to(diff.dtype) * mask
        out.update({"stale_abs_diff_sum": (diff * stale).sum(), "stale_tokens": stale.sum()})
    return out


def sequence_ratio_mask(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
                        segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``grpo.off_policy_correction: seq_mask_tis``: 1 where the token's sequence has a geometric-mean importance
    ratio exp(mean log(p_trainer / p_rollout)) inside [1 / cap, cap], 0 where it is outside (the sequence drifted too
    far from the policy that sampled it to be trained on). Per row, or per packed sequence (``segment_ids``)."""
    log_ratio = sequence_mean(trainer_logprobs - rollout_logprobs, mask, segment_ids)
    bound = math.log(cap)
    return ((log_ratio >= -bound) & (log_ratio <= bound)).to(trainer_logprobs.dtype).detach()


def icepop_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, lower: float,
                   upper: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo.off_policy_correction: icepop`` (masked importance sampling, Ling team 2025): each token's
    policy-gradient term is weighted by its ratio p_trainer / p_rollout where the ratio lies in [lower, upper] and
    by 0 where it does not, so a token the two policies disagree on too much leaves the loss instead of being
    capped. Returns (weights, kept), both detached; kept is 1 where the token stays."""
    ratio = torch.exp(trainer_logprobs - rollout_logprobs).detach()
    kept = ((ratio >= lower) & (ratio <= upper)).to(ratio.dtype)
    return ratio * kept, kept


def truncated_importance_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"): the samples came from the rollout engine's distribution, the
    gradient is taken for the trainer's, so each token's policy-gradient term is weighted by
    ``min(p_trainer / p_rollout, cap)`` (no gradient through the weight)."""
    return torch.exp(trainer_logprobs - rollout_logprobs).clamp(max=cap).detach()


# -- the grpo: section's rules (validation.py runs them in its order) -----------------------------------------------
def check_sampling_and_clipping(config: MegatronTrainingConfig, found: Findings) -> None:
    """The sampling the logprobs are taken at, the group size, the clip ranges and the off-policy correction."""
    g = config.grpo
    if not isinstance(g.temperature, (int, float)) or not 0.0 < g.temperature <= 2.0:
        found.add("grpo.temperature", f"must be in (0, 2], got {g.temperature!r}. Typical: 0.6-1.0.")
    if not isinstance(g.num_generations, int) or g.num_generations < 2:
        found.add("grpo.num_generations", f"must be at least 2, got {g.num_generations!r}: GRPO's advantage compares "
                                          "completions of the same prompt. Typical: 4-16.")
    if not 0.0 < g.top_p <= 1.0:
        found.add("grpo.top_p", f"must be in (0, 1], got {g.top_p!r}. Use 1.0 to disable nucleus sampling.")
    if not g.epsilon > 0:
        found.add("grpo.epsilon", f"must be > 0, got {g.epsilon!r}. Typical: 0.2.")
    if g.epsilon_high is not None and not g.epsilon_high > 0:
        found.add("grpo.epsilon_high", f"must be > 0 or null (= epsilon), got {g.epsilon_high!r}. DAPO uses 0.28.")
    if g.tis_cap is not None and not g.tis_cap >= 1.0:
        found.add("grpo.tis_cap", f"must be >= 1 or null (off), got {g.tis_cap!r}: it caps p_trainer / p_rollout. "
                                  "Typical: 2.0.")
    if g.off_policy_correction is not None and g.off_policy_correction not in OFF_POLICY_CORRECTIONS:
        found.add("grpo.off_policy_correction", f"unknown value {g.off_policy_correction!r}. Use one of "
                                                f"{choices(OFF_POLICY_CORRECTIONS)}, or leave it unset.")
        return
    correction = g.off_policy_correction_choice
    if g.tis_cap is not None and correction not in ("tis", "seq_mask_tis"):
        found.add("grpo.tis_cap", f"is set but off_policy_correction is {correction!r}, which does not read it. "
                                  "Remove tis_cap, or use off_policy_correction: tis or seq_mask_tis.")
    for name in ("icepop_lower", "icepop_upper"):
        if getattr(g, name) is not None and correction != "icepop":
            found.add(f"grpo.{name}", f"is set but off_policy_correction is {correction!r}: only icepop reads it. "
                                      f"Remove {name}, or set off_policy_correction: icepop.")
    lower, upper = g.icepop_band
    if correction == "icepop" and not (isinstance(lower, (int, float)) and isinstance(upper, (int, float))
                                       and 0.0 < lower < 1.0 < upper):
        found.add("grpo.icepop_lower", f"IcePop's band must satisfy 0 < icepop_lower < 1 < icepop_upper, got "
                                       f"[{lower!r}, {upper!r}]. The paper's: [0.5, 5.0] (leave both unset).")


def check_loss_and_updates(config: MegatronTrainingConfig, found: Findings) -> None:
    """KL, the loss's aggregation, reward errors, the registered loss and estimator (``grpo.plugins`` are imported),
    the lengths and updates per batch, and DAPO's dynamic sampling and overlong punishment."""
    g = config.grpo
    if g.beta < 0:
        found.add("grpo.beta", f"must be >= 0, got {g.beta!r}. Use 0 to train without a KL penalty.")
    if g.kl_estimator not in KL_ESTIMATORS:
        found.add("grpo.kl_estimator", f"unknown value {g.kl_estimator!r}. Use one of {choices(KL_ESTIMATORS)}.")
    if g.loss_aggregation not in LOSS_AGGREGATIONS:
        found.add("grpo.loss_aggregation", f"unknown value {g.loss_aggregation!r}. Use one of "
                                           f"{choices(LOSS_AGGREGATIONS)}.")
    if g.on_reward_error not in ON_REWARD_ERROR:
        found.add("grpo.on_reward_error", f"unknown value {g.on_reward_error!r}. Use 'raise' or 'skip'.")
    for registry, value in ((POLICY_LOSSES, g.policy_loss), (ADVANTAGE_ESTIMATORS, g.advantage_estimator)):
        if value not in registry:
            found.add(registry.field, registry.unknown_message(value))
    try:
        scale_rewards_mode(g.scale_rewards)
    except ValueError as e:
        found.add("grpo.scale_rewards", str(e))
    if g.clip_ratio_c is not None and not g.clip_ratio_c > 1.0:
        found.add("grpo.clip_ratio_c", f"must be > 1 or null (off), got {g.clip_ratio_c!r}: it bounds the loss of "
                                       "negative-advantage tokens at -A x clip_ratio_c. verl's default: 3.0.")
    for name in ("max_prompt_length", "max_completion_length", "ppo_epochs", "num_mini_batches"):
        found.positive(f"grpo.{name}", getattr(g, name))
    found.positive("grpo.dynamic_sampling_max_rounds", g.dynamic_sampling_max_rounds)
    buffer, longest = g.overlong_buffer_length, g.max_completion_length
    if buffer is not None and (not isinstance(buffer, int) or isinstance(buffer, bool) or not 0 < buffer <= longest):
        found.add("grpo.overlong_buffer_length", f"must be an integer in [1, grpo.max_completion_length = {longest}] or "
                                                 f"null (off), got {buffer!r}: the last this-many tokens before the limit "
                                                 f"are penalised. DAPO: a fifth of the limit (here {max(longest // 5, 1)}).")
    if not isinstance(g.overlong_penalty_factor, (int, float)) or not g.overlong_penalty_factor >= 0:
        found.add("grpo.overlong_penalty_factor", f"must be >= 0, got {g.overlong_penalty_factor!r}: the most reward the "
                                                  "overlong punishment takes. DAPO: 1.0.")
