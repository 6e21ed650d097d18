"""Name -> function tables for the GRPO variants a config selects (as verl's core_algos registers them).

- ``POLICY_LOSSES`` (``grpo.policy_loss``): per-token policy-gradient loss from the current and old
  logprobs and the advantages; built-ins ``grpo`` (PPO's clipped surrogate, optional dual clip) and ``gspo``
  (sequence-level importance ratio) live in grpo/algorithm.py.
- ``ADVANTAGE_ESTIMATORS`` (``grpo.advantage_estimator``): per-sample advantages from the whole rollout batch's
  rewards; built-ins ``grpo`` (group-relative, scaled per ``grpo.scale_rewards``) and ``rloo`` (leave-one-out).

Your own: put ``@register_policy_loss("my_loss")`` (or ``@register_advantage_estimator``) on a function with the
built-ins' signature in a module of yours, name the module in ``grpo.plugins`` and select it by name; validation
imports the plugins first and lists every registered name when one is unknown (docs/grpo.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
"""name -> fn(logprobs [b, T], old_logprobs [b, T], advantages [b] or [b, T], mask [b, T], grpo, segment_ids)
-> (per-token loss [b, T], where clipping was active [b, T])."""

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
"""name -> fn(rewards [n], valid [n] bool, grpo) -> advantages [n] float32 (``grpo.num_generations`` adjacent
completions per prompt; invalid samples get 0 and stay out of every statistic)."""


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in table and table[name] is not fn:
            raise ValueError(f"a {kind} named {name!r} is registered already ({table[name].__module__}.{table[name].__name__})")
        table[name] = fn
        return fn

    return decorate


def register_policy_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _register(POLICY_LOSSES, "policy loss", name)


def register_advantage_estimator(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def lookup(table: dict[str, Callable[..., Any]], field_name: str, name: str) -> Callable[..., Any]:
    if name not in table:
        raise ValueError(f"{field_name}: unknown value {name!r}. Registered: {', '.join(sorted(table))} "
                         "(your own: a module in grpo.plugins, see docs/grpo.md).")
    return table[name]
