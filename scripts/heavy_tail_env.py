"""A ``grpo.plugins`` module for scripts/bench_async_episodes.py: the ``heavy_tail_tools`` environment and the
``heavy_tail_score`` reward (with scripts/ on PYTHONPATH: ``grpo.plugins: ["heavy_tail_env"]``).

An episode is a task that needs ``k`` tool calls, 0 to ``HEAVY_TAIL_MAX_CALLS`` (5), drawn per dataset row from the
seed, so it takes ``k + 1`` turns (1 to 6): each of its first ``k`` turns is a tool call, answered after the tool's
latency with a short ``tool`` message; the environment ends the episode after turn ``k + 1``. The latency is the
environment's own ``time.sleep`` inside ``step`` (on ``grpo.environment_workers`` threads, so calls run in the
background): ``HEAVY_TAIL_FAST_S`` (0.05 s) for most calls, ``HEAVY_TAIL_SLOW_S`` (3 s) for 1 call in
``HEAVY_TAIL_SLOW_ONE_IN`` (20). Which calls are slow is drawn from the seed, the row, the episode's copy of it (the
n-th episode started from that row in this process) and the turn, so every run of the same data order waits for the
same calls, whatever the policy writes.

The reward is learnable by the tiny CPU model: each turn is scored as the demo's ``char_class`` scores a completion
(the fraction of its characters in the class the row's ``target`` asks for), and the episode's mean goes to the reward
as ``env_info["score"]``.

Settings come from the environment variables above and ``HEAVY_TAIL_SEED`` (0), read when the environment is built.
``HEAVY_TAIL_CALLS_LOG``, if set, names a file that gets one JSON line per episode start and per tool call (the
benchmark reads it back to count slow calls and what they cost a step with and without a turn barrier).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.registry import register_environment
from oumi_megatron.examples.demo_task import char_class_score

ENVIRONMENT = "heavy_tail_tools"
REWARD = "heavy_tail_score"


@dataclass(frozen=True)
class Latency:
    """The tools' latency law: ``fast_s`` for most calls, ``slow_s`` for 1 in ``slow_one_in``; ``max_calls`` tool calls
    per episode at most; every draw from ``seed``."""

    fast_s: float = 0.05
    slow_s: float = 3.0
    slow_one_in: int = 20
    max_calls: int = 5
    seed: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Latency:
        env = os.environ if env is None else env
        return cls(fast_s=float(env.get("HEAVY_TAIL_FAST_S", cls.fast_s)), slow_s=float(env.get("HEAVY_TAIL_SLOW_S", cls.slow_s)),
                   slow_one_in=int(env.get("HEAVY_TAIL_SLOW_ONE_IN", cls.slow_one_in)),
                   max_calls=int(env.get("HEAVY_TAIL_MAX_CALLS", cls.max_calls)), seed=int(env.get("HEAVY_TAIL_SEED", cls.seed)))

    def as_env(self) -> dict[str, str]:
        """The environment variables that give this law to the environment of a run."""
        return {"HEAVY_TAIL_FAST_S": str(self.fast_s), "HEAVY_TAIL_SLOW_S": str(self.slow_s),
                "HEAVY_TAIL_SLOW_ONE_IN": str(self.slow_one_in), "HEAVY_TAIL_MAX_CALLS": str(self.max_calls),
                "HEAVY_TAIL_SEED": str(self.seed)}

    def _uniform(self, *parts: Any) -> float:
        """A number in [0, 1) that depends on ``parts`` and the seed only."""
        digest = hashlib.sha256("|".join(map(str, (self.seed, *parts))).encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64

    def tool_calls(self, row_key: str) -> int:
        """How many tool calls the row's task needs: 0 .. ``max_calls``, uniform over rows."""
        return min(int(self._uniform("calls", row_key) * (self.max_calls + 1)), self.max_calls)

    def is_slow(self, row_key: str, copy: int, call: int) -> bool:
        """Whether call ``call`` (0-based) of the ``copy``-th episode of the row is a slow one (probability 1 /
        ``slow_one_in``)."""
        return self._uniform("slow", row_key, copy, call) < 1.0 / self.slow_one_in

    def seconds(self, row_key: str, copy: int, call: int) -> float:
        return self.slow_s if self.is_slow(row_key, copy, call) else self.fast_s


def row_key(row: dict[str, Any]) -> str:
    """A dataset row's identity for the draws: its prompt (chat messages or text)."""
    return json.dumps(row.get("prompt"), sort_keys=True)


@register_environment(ENVIRONMENT)
class HeavyTailTools:
    """Episodes of 1 to 6 turns whose tool calls take heavy-tailed time (the module's docstring)."""

    def __init__(self, latency: Latency | None = None) -> None:
        self.latency = latency or Latency.from_env()
        self.copies: collections.Counter[str] = collections.Counter()
        """Episodes started per row in this process: which copy of a row an episode is (the runner starts a batch's
        episodes one after another, in the batch's order)."""
        self.log_path = os.environ.get("HEAVY_TAIL_CALLS_LOG")
        self.lock = threading.Lock()
        self.started = 0

    def _log(self, record: dict[str, Any]) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def start(self, row: dict[str, Any]) -> dict[str, Any]:
        key = row_key(row)
        copy = self.copies[key]
        self.copies[key] += 1
        state = {"key": key, "copy": copy, "calls": self.latency.tool_calls(key), "turn": 0, "target": row["target"],
                 "scores": []}
        self._log({"start": self.started, "key": key, "copy": copy, "calls": state["calls"], "t": round(time.time(), 3)})
        self.started += 1
        return state

    def step(self, state: dict[str, Any], turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        state["scores"].append(char_class_score(turn_text, state["target"]))
        call = state["turn"]
        state["turn"] += 1
        if call >= state["calls"]:  # the task's calls are done: this turn was the answer
            return EpisodeEnd(info={"score": sum(state["scores"]) / len(state["scores"]), "tool_calls": state["calls"]})
        slow = self.latency.is_slow(state["key"], state["copy"], call)
        seconds = self.latency.slow_s if slow else self.latency.fast_s
        time.sleep(seconds)  # the tool's own time, on the environment's worker thread
        self._log({"key": state["key"], "copy": state["copy"], "call": call, "s": seconds, "slow": slow,
                   "t": round(time.time(), 3)})
        return Observation(f"ok {call + 1}")


def heavy_tail_score(completions: list[str], env_info: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[float]:
    """The episode's mean per-turn score (``env_info["score"]``); 0 for an episode the environment did not end (cut by
    the completion budget or ``grpo.max_turns``)."""
    infos = env_info or [{}] * len(completions)
    return [float((info or {}).get("score", 0.0)) for info in infos]


def _register_reward() -> None:
    try:
        import oumi.datasets  # noqa: F401 - first, as Oumi's registry does (oumi.core.datasets alone is circular)
    except ImportError:  # engine-only machines: pass the function to the trainer directly
        return
    from oumi.core.registry import REGISTRY, RegistryType

    if REGISTRY.get_reward_function(REWARD) is None:
        REGISTRY.register(REWARD, RegistryType.REWARD_FUNCTION, heavy_tail_score)


_register_reward()
