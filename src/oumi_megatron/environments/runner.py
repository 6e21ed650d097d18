"""Environment calls made once per model replica, each bounded in time.

The ranks of a model replica (TP x PP x CP) generate every episode together, so they must see the same observations:
an environment whose answer depends on timing, randomness or the outside world (a sandbox, a judge, a time limit)
could answer each rank differently, and the ranks' next ``generate`` calls would then differ and hang. So only the
replica's first rank calls the environment (its episode states live there); a turn's answers reach the other ranks in
one broadcast of objects over the replica's gloo group (the reward scorer's group, trainer/scoring.py).

Each call (``start`` or ``step``) runs on a worker thread and is given ``timeout_s``: a call that takes longer ends its
episode as failed (the run goes on) and its thread is abandoned, since Python cannot stop a thread; a fresh worker
takes the next calls. An environment that hangs for good leaks one idle thread per hang, not the run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.distributed as dist

from oumi_megatron.environments.base import Environment, EpisodeEnd, Observation


@dataclass
class Failure:
    """An environment call that raised or ran out of time: why, for the log."""

    reason: str


Answer = Observation | EpisodeEnd | Failure


class _Worker:
    """One daemon thread that runs calls in order; ``run`` waits for one up to a deadline."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[[], Any], queue.Queue]] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="oumi-megatron-environment").start()

    def _loop(self) -> None:
        while True:
            fn, reply = self.calls.get()
            try:
                reply.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - the caller turns it into the episode's failure
                reply.put((False, e))

    def run(self, fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
        """(done, value or exception); ``(False, None)`` when the call is still running at the deadline."""
        reply: queue.Queue = queue.Queue(maxsize=1)
        self.calls.put((fn, reply))
        try:
            ok, value = reply.get(timeout=timeout_s)
        except queue.Empty:
            return False, None
        return True, (value if ok else _Raised(value))


@dataclass
class _Raised:
    error: BaseException


class EnvironmentRunner:
    """``env``'s calls for the episodes of one replica: made on ``ranks[0]`` (this process when ``group`` is None),
    their answers broadcast over ``group``. ``start_all`` and ``step_all`` are collective over the replica."""

    def __init__(self, env: Environment, timeout_s: float, group: Any = None, ranks: list[int] | None = None) -> None:
        self.env = env
        self.system_prompt: str | None = getattr(env, "system_prompt", None)
        """The environment's instructions to the model (how to call its tool): the prompts' system message."""
        self.stop_strings: tuple[str, ...] = tuple(getattr(env, "stop_strings", ()))
        """Turns also end at tokens whose text ends with one of these (answered inside the assistant's message)."""
        self.timeout_s = timeout_s
        self.group = group
        self.ranks = ranks or [0]
        self.calls_here = group is None or dist.get_rank() == self.ranks[0]
        self.states: dict[int, Any] = {}
        """Episode index -> the environment's state, on the calling rank only."""
        self.seconds = 0.0
        """Wall time spent in the environment's calls on the calling rank (0 on the others)."""
        self._worker: _Worker | None = None

    def _call(self, fn: Callable[[], Any], what: str) -> tuple[bool, Any]:
        """(ok, value) of ``fn()`` within the time limit; (False, reason) otherwise."""
        if self._worker is None:
            self._worker = _Worker()
        started = time.perf_counter()
        done, value = self._worker.run(fn, self.timeout_s)
        self.seconds += time.perf_counter() - started
        if not done:
            self._worker = None  # the hung call keeps its thread; the next call gets a fresh one
            return False, f"{what}: no answer within grpo.environment_timeout_s = {self.timeout_s:g} s"
        if isinstance(value, _Raised):
            return False, f"{what}: {type(value.error).__name__}: {value.error}"
        return True, value

    def _shared(self, answers: list[Any]) -> list[Any]:
        if self.group is not None and len(self.ranks) > 1:
            box = [answers]
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
            answers = box[0]
        return answers

    def start_all(self, rows: list[tuple[int, dict[str, Any]]]) -> list[Failure | None]:
        """Starts episode ``k`` from ``row`` for each ``(k, row)``; per episode its failure or None."""
        out: list[Failure | None] = []
        self.states.clear()  # a new batch of episodes
        if self.calls_here:
            for k, row in rows:
                ok, value = self._call(partial(self.env.start, row), f"start (row of episode {k})")
                if ok:
                    self.states[k] = value
                out.append(None if ok else Failure(value))
        return self._shared(out)

    def step_all(self, turns: list[tuple[int, str, list[int]]]) -> list[Answer]:
        """The answer to each ``(episode k, turn text, turn ids)``."""
        out: list[Answer] = []
        if self.calls_here:
            for k, text, ids in turns:
                ok, value = self._call(partial(self.env.step, self.states[k], text, ids), f"step (episode {k})")
                if ok and not isinstance(value, (Observation, EpisodeEnd)):
                    ok, value = False, f"step (episode {k}): returned {type(value).__name__}, not an Observation or EpisodeEnd"
                out.append(value if ok else Failure(value))
        return self._shared(out)
