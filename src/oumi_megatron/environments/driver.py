"""The one way a run gets samples: every rollout is an episode (slime's one ``Sample`` path, verl's AgentLoop).

A single-turn rollout is an episode of one turn with no environment; under ``grpo.environment`` an episode takes turns
until the environment ends it (environments/episodes.py). ``RolloutDriver`` is built once per run (assembly.py) and
handed to the trainer's collector (training rounds, dynamic sampling's rounds, asynchronous GRPO's submissions) and to
the evaluators; none of them asks whether an environment is set: the driver's result is the same either way (a
``Sample`` per episode, rollout/sample.py, and the batch's ``EpisodeStats``), and every sample it returns went through
the same episodes' bookkeeping, asynchronous ones included.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from oumi_megatron.environments.episodes import EpisodeStats, episodes_of, run_episodes
from oumi_megatron.environments.runner import EnvironmentRunner
from oumi_megatron.rollout.base import (
    AsyncEpisodeBackend,
    AsyncRolloutBackend,
    DecodeProfile,
    EpisodeJob,
    EpisodeRun,
    Generates,
    Rollout,
    RolloutBackend,
    RunsEpisodeJobs,
    StreamingEpisodeBackend,
    TaggedRollouts,
)
from oumi_megatron.rollout.sample import Sample
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.turns import PARTIAL_ROLLOUT_CHUNK, EpisodeStream

logger = logging.getLogger("oumi")


@dataclass(frozen=True)
class EpisodeTools:
    """What one thread's episodes run with: a tokenizer and the environment's runner (None: single-turn). Asynchronous
    episodes run on the engine owner's episode thread with tools of their own: a fast tokenizer is not safe to share
    across threads while it encodes, and the main thread evaluates meanwhile."""

    tokenizer: Any
    environment: EnvironmentRunner | None


@dataclass(frozen=True)
class _Submitted:
    """A submission in flight (asynchronous GRPO): what its episodes are."""

    prompts: list[list[int]]
    rows: list[dict[str, Any]]
    params: SamplingParams
    n: int
    seed: int | None
    groups: list[int] | None
    chunk: int | None = None
    """Turns in pieces of at most this many tokens (``grpo.partial_rollouts``); None: whole turns."""


class _Generated:
    """A generation the engine made on its own (a single-turn submission, collected) as the one turn of each episode."""

    def __init__(self, grouped: list[list[Rollout]]) -> None:
        self.grouped = grouped

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        return self.grouped


@dataclass
class FinishedGroup:
    """A group the stream of episodes finished (``grpo.streaming_groups``): its key, its ``n`` samples (or why the
    stream failed), and what the stream did since the group before it finished (its stats, the engine's seconds)."""

    key: int
    samples: list[Sample]
    stats: EpisodeStats
    engine_seconds: float
    error: str | None = None


class _GroupStream:
    """The owner's stream of episodes (``grpo.streaming_groups``), run by the backend on a thread of its own: groups
    join from ``inbox`` whenever the trainer submits them, every episode going on advances in one ``generate`` per
    round (rollout/turns.py ``EpisodeStream``), and each group goes to ``outbox`` as soon as its last episode ends."""

    def __init__(self, tools: EpisodeTools, grpo: Any, params: SamplingParams, n: int, chunk: int | None) -> None:
        self.tools, self.grpo, self.params, self.n, self.chunk = tools, grpo, params, n, chunk
        self.inbox: queue.Queue[tuple[int, list[int], dict[str, Any]]] = queue.Queue()
        self.outbox: queue.Queue[FinishedGroup] = queue.Queue()
        self.closed = threading.Event()

    def __call__(self, engine: Generates) -> None:
        try:
            self._run(engine)
        except Exception as e:  # noqa: BLE001 - the trainer raises it at its next collect
            if self.closed.is_set():  # the run ended and closed the engine under it
                return
            logger.exception("the stream of episodes failed")
            self.outbox.put(FinishedGroup(-1, [], EpisodeStats(), 0.0, f"{type(e).__name__}: {e}"))

    def _run(self, engine: Generates) -> None:
        g = self.grpo
        episodes, params = episodes_of(self.tools.tokenizer, self.tools.environment, [], [], self.params, self.n,
                                       g.max_turns, g.max_observation_tokens, g.max_turn_tokens)
        stream = EpisodeStream(engine, params, episodes, self.chunk)
        members: dict[int, set[int]] = {}  # group key -> its episodes still going
        rows: dict[int, list[int]] = {}  # group key -> all its episodes, in order
        group_of: dict[int, int] = {}
        seconds_before = getattr(engine, "seconds", 0.0)
        while not self.closed.is_set():
            joined = self._joining(block=not stream.busy)
            for key, prompt, row in joined:
                keys = episodes.add([prompt], [row], [key])
                members[key], rows[key] = set(keys), keys
                group_of.update(dict.fromkeys(keys, key))
                stream.add({k: (prompt, episodes.episodes[k].room) for k in keys})
            if not stream.busy:
                continue
            ended = stream.advance(wait=False)
            if not ended and not stream.open:
                time.sleep(0.002)  # every going episode waits for its tool: look for new groups meanwhile
            for k in ended:
                key = group_of.pop(k)
                members[key].discard(k)
                if not members[key]:
                    del members[key]
                    seconds = getattr(engine, "seconds", 0.0)
                    self.outbox.put(FinishedGroup(key, episodes.take(rows.pop(key)),
                                                  episodes.take_stats(EpisodeRun()), seconds - seconds_before))
                    seconds_before = seconds

    def _joining(self, block: bool) -> list[tuple[int, list[int], dict[str, Any]]]:
        out = []
        try:
            out.append(self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            return out


class RolloutDriver:
    """Episodes of ``grpo``'s shape (``max_turns``, observation and turn limits) on ``backend``; ``tools``: this rank's
    tokenizer and the runner of ``grpo.environment`` for its replica (None: single-turn); ``async_tools``: those of
    asynchronous episodes' thread (None: no asynchronous multi-turn episodes)."""

    def __init__(self, backend: RolloutBackend, grpo: Any, tools: EpisodeTools, async_tools: EpisodeTools | None = None) -> None:
        self.backend, self.grpo, self.tools, self.async_tools = backend, grpo, tools, async_tools
        self._submitted: collections.deque[_Submitted] = collections.deque()
        """Asynchronous GRPO: the submissions not collected yet, oldest first (a backend collects in order)."""
        self._stream: _GroupStream | None = None
        """``grpo.streaming_groups``: the replica owner's stream of episodes (started by the first ``submit_groups``)."""

    @property
    def tokenizer(self) -> Any:
        return self.tools.tokenizer

    @property
    def environment(self) -> EnvironmentRunner | None:
        return self.tools.environment

    @property
    def system_prompt(self) -> str | None:
        """The environment's instructions to the model, put first in every prompt (None: none)."""
        return self.environment.system_prompt if self.environment is not None else None

    @property
    def _chunk(self) -> int | None:
        """Turns' piece size under ``grpo.partial_rollouts`` (None: whole turns)."""
        return PARTIAL_ROLLOUT_CHUNK if getattr(self.grpo, "partial_rollouts", False) else None

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None

    def run(self, prompts: list[list[int]], rows: list[dict[str, Any]], params: SamplingParams, n: int,
            seed: int | None = None, *, groups: list[int] | None = None, version: int = 0) -> tuple[list[Sample], EpisodeStats]:
        """``n`` episodes of each of ``prompts`` (``rows[i]``: prompt i's dataset row; ``groups[i]``: its group id,
        default i) as samples, prompt i's ``n`` adjacent, generated by policy ``version``. Collective over the model
        replica (over every rank where the backend runs episodes as jobs)."""
        if self.multi_turn and isinstance(self.backend, RunsEpisodeJobs):
            job = EpisodeJob(_Submitted(prompts, rows, params, n, seed, groups), self._run_job)
            tagged = self.backend.run_episode_job(prompts, job)
            assert tagged.episodes is not None, "an episode job returns its episodes"
            samples, stats = tagged.episodes
            for sample in samples:  # a synchronous batch is one policy's (its engines' tags are the loop's, not versions)
                sample.stamp(version)
            return samples, stats
        samples, stats = self._episodes(self.backend, self.tools, prompts, rows, params, n, seed, groups)
        for sample in samples:
            if not sample.versions:  # the engine told no version per turn: the batch's
                sample.stamp(version)
        return samples, stats

    def _episodes(self, engine: Any, tools: EpisodeTools, prompts: list[list[int]], rows: list[dict[str, Any]],
                  params: SamplingParams, n: int, seed: int | None, groups: list[int] | None,
                  chunk: int | None = None) -> tuple[list[Sample], EpisodeStats]:
        g = self.grpo
        return run_episodes(engine, tools.tokenizer, tools.environment, prompts, rows, params, n, g.max_turns,
                            g.max_observation_tokens, seed=seed, max_turn_tokens=g.max_turn_tokens, groups=groups,
                            chunk=chunk)

    # -- asynchronous GRPO: a step's episodes submitted ahead, collected when the trainer gets to them ------------------
    def submit(self, backend: AsyncRolloutBackend, prompts: list[list[int]], rows: list[dict[str, Any]],
               params: SamplingParams, n: int, seed: int | None = None, *, groups: list[int] | None = None) -> None:
        """Queue the episodes of ``prompts`` on ``backend`` and return at once; ``collect`` returns them, in the order of
        submission. Single-turn episodes are one generation the engine makes on its own (read as their one turn at
        ``collect``); multi-turn ones a job on the engine owner's episode thread (``AsyncEpisodeBackend``), with the
        thread's own tools."""
        request = _Submitted(prompts, rows, params, n, seed, groups, self._chunk)
        self._submitted.append(request)
        if not self.multi_turn and self._chunk is None:
            backend.submit(prompts, params, n)
            return
        # episodes, and under partial rollouts single turns too: a job of requests a weight push can land between
        assert isinstance(backend, AsyncEpisodeBackend), "validation refuses asynchronous episodes on this backend"
        assert self.async_tools is not None, "assembly.py builds the episode thread's tools for asynchronous episode jobs"
        backend.submit_episodes(prompts, EpisodeJob(request, self._run_job))

    def _run_job(self, request: _Submitted, engine: Generates) -> tuple[list[Sample], EpisodeStats]:
        """An episode job (``submit``, or ``run`` on a ``RunsEpisodeJobs`` backend) with the episode thread's tools
        (their environment is called by one rank: no group), on whichever process runs it."""
        assert self.async_tools is not None, "assembly.py builds the episode thread's tools for asynchronous episode jobs"
        return self._episodes(engine, self.async_tools, request.prompts, request.rows, request.params, request.n,
                              request.seed, request.groups, request.chunk)

    def collect(self, backend: AsyncRolloutBackend) -> tuple[list[Sample], EpisodeStats, TaggedRollouts]:
        """The oldest submission's samples and stats (waiting for them), and the backend's account of it (the policy
        version that generated it, the engine's seconds)."""
        request = self._submitted.popleft()
        tagged = backend.collect()
        if tagged.episodes is not None:
            samples, stats = tagged.episodes
        else:
            samples, stats = self._episodes(_Generated(tagged.rollouts), self.tools, request.prompts, request.rows,
                                            request.params, request.n, request.seed, request.groups)
        for sample in samples:
            if not sample.versions:  # else each turn's own (an engine a push reached between turns)
                sample.stamp(tagged.version)
        return samples, stats, tagged

    # -- grpo.streaming_groups: groups join one stream of episodes, the trainer takes the first that finish ---------------
    def submit_groups(self, backend: StreamingEpisodeBackend, prompts: list[list[int]], rows: list[dict[str, Any]],
                      keys: list[int], params: SamplingParams, n: int) -> None:
        """Each of ``prompts`` (``rows``: its row, ``keys``: its group's key) as a group of ``n`` episodes joining the
        replica owner's stream (started at the first call); returns at once. Every rank of a replica calls it."""
        if self._stream is None:
            assert self.async_tools is not None, "assembly.py builds the stream's tools for streaming groups"
            self._stream = _GroupStream(self.async_tools, self.grpo, params, n, self._chunk)
            backend.start_stream(self._stream)
        for key, prompt, row in zip(keys, prompts, rows, strict=True):
            self._stream.inbox.put((key, prompt, row))

    def finished_groups(self, backend: StreamingEpisodeBackend, count: int) -> list[FinishedGroup]:
        """The next ``count`` groups the stream finishes, in the order they finished (waits for them); the same on every
        rank of the replica. Raises where the stream failed."""
        assert self._stream is not None, "submit_groups starts the stream"
        outbox = self._stream.outbox

        def take() -> list[FinishedGroup]:
            out: list[FinishedGroup] = []
            while len(out) < count and not (out and out[-1].error is not None):  # a failed stream sends nothing more
                out.append(outbox.get())
            return out

        got: list[FinishedGroup] = backend.from_owner(take)
        failed = next((f.error for f in got if f.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"the stream of episodes failed on the replica's engine: {failed}")
        return got

    def decode_profile(self) -> DecodeProfile:
        return self.backend.decode_profile()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.closed.set()
        self.backend.close()
