"""The GRPO variants a config selects by name (as verl's core_algos registers them).

- ``POLICY_LOSSES`` (``grpo.policy_loss``): per-token policy-gradient loss from the current and old
  logprobs and the advantages; built-ins ``grpo`` (PPO's clipped surrogate, optional dual clip) and ``gspo``
  (sequence-level importance ratio) live in grpo/algorithm.py.
- ``ADVANTAGE_ESTIMATORS`` (``grpo.advantage_estimator``): per-sample advantages from the whole rollout batch's
  rewards; built-ins ``grpo`` (group-relative, scaled per ``grpo.scale_rewards``) and ``rloo`` (leave-one-out).

Your own: put ``@register_policy_loss("my_loss")`` (or ``@register_advantage_estimator``) on a function with the
built-ins' signature in a module of yours, name the module in ``grpo.plugins`` and select it by name; validation
imports the plugins first and checks the name against these live tables (docs/grpo.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oumi_megatron.utils.registry import Registry

_HINT = "your own: a module in grpo.plugins, see docs/grpo.md"

PolicyLoss = Callable[..., Any]
"""fn(logprobs [b, T], old_logprobs [b, T], advantages [b] or [b, T], mask [b, T], grpo, segment_ids)
-> (per-token loss [b, T], where clipping was active [b, T])."""

AdvantageEstimator = Callable[..., Any]
"""fn(rewards [n], valid [n] bool, grpo) -> advantages [n] float32 (``grpo.num_generations`` adjacent
completions per prompt; invalid samples get 0 and stay out of every statistic)."""

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "grpo.policy_loss", _HINT)
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "grpo.advantage_estimator", _HINT)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    return POLICY_LOSSES.register(name)


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    return ADVANTAGE_ESTIMATORS.register(name)
