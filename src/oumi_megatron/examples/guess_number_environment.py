"""An example environment plugin: ``guess_number`` (configs/tiny_cpu_grpo_guess_number.yaml names this module in
``grpo.plugins``).

The episode holds a secret number from 0 to 99, the model writes a guess as its turn, and the environment answers
``higher`` or ``lower`` as a ``user`` message until the guess is right (the episode ends with
``{"guesses": k, "solved": True}`` for the rewards) or ``grpo.max_turns`` runs out. A turn without a number gets a
nudge. It shows the three parts of an environment: ``start`` (state from the dataset row), ``step`` (an ``Observation``
or ``EpisodeEnd``) and the registration. It runs no code from the model; an environment that must (a code runner)
belongs in a sandbox (a container or a separate, resource-limited process), never ``exec`` in the trainer.

With a random model almost every turn is answered, so episodes run to ``max_turns``: the multi-turn tests use it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd, Observation
from oumi_megatron.environments.registry import register_environment

_NUMBER = re.compile(r"-?\d+")


def secret_of(row: dict[str, Any]) -> int:
    """The row's secret: its ``extra_info.secret`` if it has one, else a number from its prompt's text."""
    secret = (row.get("extra_info") or {}).get("secret")
    if isinstance(secret, int):
        return secret
    return int.from_bytes(hashlib.sha256(str(row.get("prompt")).encode()).digest()[:4], "little") % 100


@register_environment("guess_number")
class GuessNumberEnvironment:
    observation_roles = ("user",)
    """The message roles its observations take (validation checks the chat template renders them)."""

    def start(self, row: dict[str, Any]) -> dict[str, int]:
        return {"secret": secret_of(row), "guesses": 0}

    def step(self, state: dict[str, int], turn_text: str, turn_ids: list[int]) -> Observation | EpisodeEnd:
        found = _NUMBER.findall(turn_text)
        if not found:
            return Observation("Write one number from 0 to 99.", role="user", tool_call=False)
        state["guesses"] += 1
        guess = int(found[-1])
        if guess == state["secret"]:
            return EpisodeEnd(info={"guesses": state["guesses"], "solved": True})
        return Observation("higher" if guess < state["secret"] else "lower", role="user")
