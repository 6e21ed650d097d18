"""The variables torchrun sets for the trainer's ranks, which an engine's processes must not inherit.

A rollout engine's processes (vLLM's engine process, SGLang's scheduler) are no ranks of the trainer's torchrun world;
with its variables inherited they would take them for their own world and wait for ranks that never come.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def forget_launcher_env() -> None:
    """In an engine's own process: drop the trainer's launcher variables for good."""
    for name in LAUNCHER_ENV:
        os.environ.pop(name, None)


@contextlib.contextmanager
def without_launcher_env() -> Iterator[None]:
    """In a trainer's process: the launcher variables hidden while an engine starts its processes, then restored."""
    saved = {name: os.environ.pop(name) for name in LAUNCHER_ENV if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
