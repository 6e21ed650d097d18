"""Environment calls made once per model replica, each bounded in time.

The ranks of a model replica (TP x PP x CP) generate every episode together, so they must see the same observations:
an environment whose answer depends on timing, randomness or the outside world (a sandbox, a judge, a time limit)
could answer each rank differently, and the ranks' next ``generate`` calls would then differ and hang. So only the
replica's first rank calls the environment (its episode states live there); a turn's answers reach the other ranks in
one broadcast of objects over the replica's gloo group (the reward scorer's group, trainer/scoring.py).

Each call (``start`` or ``step``) runs on a worker thread and is given ``timeout_s``: a call that takes longer ends its
episode as failed (the run goes on) and its thread is abandoned, since Python cannot stop a thread; a fresh worker
takes the next calls. An environment that hangs for good leaks one idle thread per hang, not the run.

Two ways a turn's answer comes (``grpo.environment_workers``):
- **in line** (0, the default): ``step_all`` answers the turns one after another while the decoder waits; when each
  turn is answered does not depend on how long the environment takes, so a seed draws the same episodes every time;
- **in the background** (N >= 1): ``submit`` hands the turns to up to N threads and returns; ``poll`` returns the
  answers that came back (and those that ran out of time), so a slow tool delays only its own episode while the other
  rows decode. The replica's first rank decides what has come back and broadcasts it, so every rank of the replica
  sees the same answers at the same point; which decode step an answer meets depends on the environment's time, so
  sampled episodes may differ between runs (greedy ones do not), as in verl's AgentLoop.
An ``async def`` ``start`` or ``step`` is awaited on one event loop of the runner's (its calls run concurrently up to
the thread count, and an environment's own asyncio objects live on that loop).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
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


OBSERVATION_CHARS_PER_TOKEN = 64
"""An observation's text is cut to this many characters per token of ``grpo.max_observation_tokens`` before it is
broadcast or tokenized (more than any tokenizer's tokens hold), so a tool that answers with megabytes costs no more
than one that answers with the most the episode keeps."""
MAX_REASON_CHARS = 2000
"""A failure's reason (an exception's message, which may quote model text) is cut to this many characters."""


def observation_char_cap(max_observation_tokens: int) -> int:
    return OBSERVATION_CHARS_PER_TOKEN * max(max_observation_tokens, 1)


def _answer(k: int, ok: bool, value: Any, max_chars: int) -> Answer:
    """A call's outcome as the episode's answer: the environment's (an observation's text cut to ``max_chars``), or the
    ``Failure`` naming what went wrong (an exception, a value that is not an answer, an observation without text)."""
    if isinstance(value, _Raised):
        ok, value = False, f"step (episode {k}): {type(value.error).__name__}: {value.error}"
    if ok and not isinstance(value, (Observation, EpisodeEnd)):
        ok, value = False, f"step (episode {k}): returned {type(value).__name__}, not an Observation or EpisodeEnd"
    if ok and isinstance(value, Observation):
        if not isinstance(value.text, str) or not isinstance(value.role, str):
            bad = "text" if not isinstance(value.text, str) else "role"
            ok, value = False, (f"step (episode {k}): returned an Observation whose {bad} is "
                                f"{type(getattr(value, bad)).__name__}, not str")
        elif len(value.text) > max_chars:
            value = dataclasses.replace(value, text=value.text[:max_chars], truncated=True)
    return value if ok else Failure(str(value)[:MAX_REASON_CHARS])


class _EventLoop:
    """One asyncio loop on a daemon thread: where ``async def`` environment methods are awaited."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="oumi-megatron-environment-loop").start()

    def blocking(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """``fn(*args)`` as a blocking call for a worker thread: awaited on the loop when ``fn`` is a coroutine function."""
        if not inspect.iscoroutinefunction(fn):
            return partial(fn, *args)
        return lambda: asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result()


class _Pool:
    """Up to ``workers`` calls at once, each on a thread of its own with its own deadline (the background mode). Calls
    are told apart by a number of their own: an abandoned call of an earlier batch that ends late is dropped, never
    taken for a later call of the same episode index."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self.calls = 0
        self.queued: collections.deque[tuple[int, int, Callable[[], Any], str]] = collections.deque()
        self.running: dict[int, tuple[int, float, str]] = {}
        """Call -> (its episode, when it started, what it is)."""
        self.finished: queue.Queue[tuple[int, bool, Any]] = queue.Queue()

    def submit(self, k: int, fn: Callable[[], Any], what: str) -> None:
        self.calls += 1
        self.queued.append((self.calls, k, fn, what))
        self._start()

    def _start(self) -> None:
        while self.queued and len(self.running) < self.workers:
            call, k, fn, what = self.queued.popleft()
            self.running[call] = (k, time.perf_counter(), what)

            def run(call: int = call, fn: Callable[[], Any] = fn) -> None:
                try:
                    self.finished.put((call, True, fn()))
                except BaseException as e:  # noqa: BLE001 - the episode's failure
                    self.finished.put((call, False, e))

            threading.Thread(target=run, daemon=True, name="oumi-megatron-environment").start()

    def collect(self, wait: bool) -> list[tuple[int, bool, Any]]:
        """(episode, ok, value or exception or why) of every call that ended or ran out of time; with ``wait``, at least
        one when any call is in flight. A call past its deadline is abandoned (its thread runs on, its result is
        dropped) and its slot given to the next."""
        out: list[tuple[int, bool, Any]] = []
        while True:
            try:
                call, ok, value = self.finished.get(timeout=self._until_deadline()) if wait and not out and self.running \
                    else self.finished.get_nowait()
                entry = self.running.pop(call, None)
                if entry is not None:  # else abandoned already
                    out.append((entry[0], ok, value))
                continue
            except queue.Empty:
                pass
            now = time.perf_counter()
            for call, (k, started, what) in list(self.running.items()):
                if now - started > self.timeout_s:
                    del self.running[call]
                    out.append((k, False, f"{what}: no answer within grpo.environment_timeout_s = {self.timeout_s:g} s"))
            self._start()
            if out or not wait or not self.running:
                return out

    def _until_deadline(self) -> float:
        earliest = min(started for _, started, _ in self.running.values())
        return max(earliest + self.timeout_s - time.perf_counter(), 1e-3)


class EnvironmentRunner:
    """``env``'s calls for the episodes of one replica: made on ``ranks[0]`` (this process when ``group`` is None),
    their answers broadcast over ``group``. ``start_all`` and ``step_all`` are collective over the replica."""

    def __init__(self, env: Environment, timeout_s: float, group: Any = None, ranks: list[int] | None = None,
                 workers: int = 0, max_observation_chars: int = observation_char_cap(256)) -> None:
        """``workers``: 0 answers in line (``step_all``); N >= 1 in the background on up to N threads (``submit``,
        ``poll``). ``max_observation_chars``: an observation's text is cut to it before it leaves this rank
        (``observation_char_cap``)."""
        self.env = env
        self.max_observation_chars = max_observation_chars
        self.workers = workers
        self._loop = _EventLoop() if inspect.iscoroutinefunction(env.step) or inspect.iscoroutinefunction(env.start) else None
        self._pool: _Pool | None = None
        self.answering: set[int] = set()
        """Episodes whose turn is being answered in the background (the same set on every rank of the replica)."""
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
        """Wall time the calling rank spent waiting for the environment (0 on the others): every call in line; in the
        background only ``poll(wait=True)``'s waits."""
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

    def _blocking(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return self._loop.blocking(fn, *args) if self._loop is not None else partial(fn, *args)

    def start_all(self, rows: list[tuple[int, dict[str, Any]]], fresh: bool = True) -> list[Failure | None]:
        """Starts episode ``k`` from ``row`` for each ``(k, row)``; per episode its failure or None. ``fresh``: a new
        batch (the previous batch's states are dropped); False: these episodes join the ones going on."""
        out: list[Failure | None] = []
        if fresh:
            self.states.clear()
            self.answering.clear()
        if self.calls_here:
            for k, row in rows:
                ok, value = self._call(self._blocking(self.env.start, row), f"start (row of episode {k})")
                if ok:
                    self.states[k] = value
                out.append(None if ok else Failure(value))
        return self._shared(out)

    def forget(self, keys: list[int]) -> None:
        """Ended episodes' states dropped (a stream of episodes runs as long as the run)."""
        for k in keys:
            self.states.pop(k, None)

    def step_all(self, turns: list[tuple[int, str, list[int]]]) -> list[Answer]:
        """The answer to each ``(episode k, turn text, turn ids)``, in line."""
        out: list[Answer] = []
        if self.calls_here:
            for k, text, ids in turns:
                ok, value = self._call(self._blocking(self.env.step, self.states[k], text, ids), f"step (episode {k})")
                out.append(_answer(k, ok, value, self.max_observation_chars))
        return self._shared(out)

    def submit(self, turns: list[tuple[int, str, list[int]]]) -> None:
        """The background mode: each ``(episode k, turn text, turn ids)`` handed to the pool; ``poll`` returns the answers."""
        self.answering.update(k for k, _, _ in turns)
        if not self.calls_here:
            return
        if self._pool is None:
            self._pool = _Pool(max(self.workers, 1), self.timeout_s)
        for k, text, ids in turns:
            self._pool.submit(k, self._blocking(self.env.step, self.states[k], text, ids), f"step (episode {k})")

    def poll(self, wait: bool) -> list[tuple[int, Answer]]:
        """The answers that came back since the last poll, the same on every rank of the replica; with ``wait``, at
        least one while any is outstanding."""
        out: list[tuple[int, Answer]] = []
        if self.calls_here and self._pool is not None:
            started = time.perf_counter()
            out = [(k, _answer(k, ok, value if ok or isinstance(value, str) else _Raised(value), self.max_observation_chars))
                   for k, ok, value in self._pool.collect(wait and bool(self.answering))]
            self.seconds += time.perf_counter() - started if wait else 0.0
        out = self._shared(out)
        self.answering.difference_update(k for k, _ in out)
        return out
