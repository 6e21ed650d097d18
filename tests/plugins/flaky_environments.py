"""A test plugin (``grpo.plugins: [flaky_environments]``, with tests/plugins on PYTHONPATH): ``guess_number`` that
fails on purpose, and records which ranks call it.

- ``start`` raises for rows whose secret is a multiple of 3;
- ``step`` hangs (past ``grpo.environment_timeout_s``) on the first turn of rows whose secret is 1 mod 5;
- every call appends ``rank`` to ``$FLAKY_ENV_CALLS`` (the test checks only each replica's first rank calls).
"""

from __future__ import annotations

import os
import time
from typing import Any

from oumi_megatron.environments.registry import register_environment
from oumi_megatron.examples.guess_number_environment import GuessNumberEnvironment, secret_of


def _record() -> None:
    with open(os.environ["FLAKY_ENV_CALLS"], "a") as f:
        f.write(f"{os.environ.get('RANK', '0')}\n")


@register_environment("flaky_guess_number")
class FlakyGuessNumber(GuessNumberEnvironment):
    def start(self, row: dict[str, Any]) -> dict[str, int]:
        _record()
        if secret_of(row) % 3 == 0:
            raise RuntimeError("could not start")
        return super().start(row)

    def step(self, state: dict[str, int], turn_text: str, turn_ids: list[int]) -> Any:
        _record()
        if state["secret"] % 5 == 1 and state.get("hung") is None:
            state["hung"] = 1
            time.sleep(3)
        return super().step(state, turn_text, turn_ids)
