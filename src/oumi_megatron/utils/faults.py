"""``kill -9`` of the trainer at a named point of the asynchronous loop, for the resume stress test
(scripts/stress_async_resume.py): ``OUMI_MEGATRON_KILL_AT=POINT:N`` sends this process SIGKILL the N-th time it passes
``POINT`` (1-based), exactly as an out-of-memory kill or a lost node would stop it: no handler, no flush. Unset (every
real run), ``kill_point`` is a dictionary lookup and nothing else."""

from __future__ import annotations

import collections
import os
import signal

KILL_POINTS = ("push", "episode", "checkpoint", "train", "between_steps")
"""During a weight push (the transfer in flight); mid-episode (a piece of open turns about to be generated); during a
background checkpoint write; inside a step's update; between two steps."""

_passed: collections.Counter[str] = collections.Counter()


def kill_point(point: str) -> None:
    """SIGKILL this process if ``OUMI_MEGATRON_KILL_AT`` names ``point`` and this is its N-th pass."""
    spec = os.environ.get("OUMI_MEGATRON_KILL_AT")
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _passed[point] += 1
    if _passed[point] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
