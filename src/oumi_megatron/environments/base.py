"""What an environment is, and the registry ``grpo.environment`` names one from.

An episode starts from a dataset row (``Environment.start``: the per-episode state). After each assistant turn the
environment gets the turn's text and token ids (``step``) and answers with an ``Observation`` (text the trainer renders
as a ``tool`` message through the tokenizer's chat template and appends as context the policy does not train on) or
an ``EpisodeEnd``. ``info`` travels to the reward functions with the episode (verl's AgentLoop and NeMo-RL's
environments keep the same split: the environment observes, the rewards score).

Your own: ``@register_environment("my_env")`` on a class with this interface (or a factory returning one) in a module
named in ``grpo.plugins``; docs/grpo.md has an example. An environment must not run untrusted code unsandboxed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from oumi_megatron.utils.registry import Registry


@dataclass
class Observation:
    """The environment's answer to a turn: ``text`` becomes a ``role`` message (``tool`` by default) the model reads
    before its next turn."""

    text: str
    role: str = "tool"
    tool_call: bool = True
    """Whether the turn called a tool (``False``: e.g. a nudge after a turn with no call and no answer)."""
    error: bool = False
    """The call failed (a parse failure, or the tool refused its arguments): counted in ``env/tool_errors``."""
    parse_failure: bool = False
    """The turn's tool call did not parse (``env/parse_failures``); implies ``error``."""


@dataclass
class EpisodeEnd:
    """The episode is over after this turn; ``info`` goes to the reward functions."""

    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    def start(self, row: dict[str, Any]) -> Any:
        """The per-episode state for a dataset row (anything; passed back to ``step``)."""

    def step(self, state: Any, turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        """The answer to one assistant turn (its decoded text and the token ids the policy sampled)."""


EnvironmentFactory = Callable[[], Environment]
"""Builds a fresh environment for a run (a class is one)."""

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment", "grpo.environment", "your own: @register_environment in a module in grpo.plugins, see docs/grpo.md")


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    return ENVIRONMENTS.register(name)


def build_environment(name: str) -> Environment:
    """The environment registered as ``name`` (the built-ins are imported first); the error names the field."""
    from oumi_megatron.environments import calculator  # noqa: F401 - registers the built-ins

    return ENVIRONMENTS.get(name)()
