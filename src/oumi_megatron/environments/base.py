"""What an environment is (the registry ``grpo.environment`` names one from: environments/registry.py).

An episode starts from a dataset row (``Environment.start``: the per-episode state). After each assistant turn the
environment gets the turn's text and token ids (``step``) and answers with an ``Observation`` (text the trainer renders
as a ``tool`` message through the tokenizer's chat template and appends as context the policy does not train on) or
an ``EpisodeEnd``. ``info`` travels to the reward functions with the episode (verl's AgentLoop and NeMo-RL's
environments keep the same split: the environment observes, the rewards score).

An environment must not run untrusted code unsandboxed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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
    truncated: bool = False
    """Set by the runner: ``text`` was cut to its character cap before it left the environment's rank
    (``env/observations_truncated``)."""


@dataclass
class EpisodeEnd:
    """The episode is over after this turn; ``info`` goes to the reward functions."""

    info: dict[str, Any] = field(default_factory=dict)
    tool_call: bool = False
    """Whether the turn that ended it called a tool (``python_tests``: the program whose public tests passed): counted
    in ``env/tool_calls_per_episode`` as an observation's call is."""


class Environment(Protocol):
    """Optional attributes: ``system_prompt`` (text put first in every prompt as a system message: how to use the
    tool), ``observation_roles`` (the roles its observations take, default ``("tool",)``; validation checks the
    chat template renders them) and ``stop_strings`` (a turn also ends at any token whose text ends with one of
    them, e.g. ``("=",)``; the observation that answers such a turn is not a message: its text is appended inside the
    assistant's message, as is, and the policy's next turn continues that message: GSM8K's calculator)."""

    def start(self, row: dict[str, Any]) -> Any:
        """The per-episode state for a dataset row (anything; passed back to ``step``)."""

    def step(self, state: Any, turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        """The answer to one assistant turn (its decoded text and the token ids the policy sampled)."""
