"""What a reward function may return besides its rewards: per-sample metrics (grpo/rewards.py reports them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardsAndMetrics:
    """What a reward function may return instead of its list of rewards: the rewards and, per sample, the values of
    the metrics it declares in its ``reward_metrics`` attribute (e.g. ``code_tests``: ``passed``, ``timeout``). They are
    reported as ``reward/<function>/<metric>`` (their mean over the scored samples; ``eval/...`` in evaluations) and
    take no part in the reward."""

    rewards: list[float]
    metrics: dict[str, list[float]]
