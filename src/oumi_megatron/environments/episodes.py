"""Multi-turn episodes on any rollout backend: generate a turn, let the environment answer, append its observation
as token ids, generate the next turn from the whole history, until the environment ends the episode, ``max_turns``
assistant turns were taken, or the completion budget is spent.

Token-in / token-out: an episode's completion is the policy's sampled ids of every turn exactly as the backend
returned them (with their logprobs), and between turns the observation's ids (environments/rendering.py), marked 0 in
``Rollout.loss_mask`` (logprob 0.0 there: never read, the mask excludes them). Nothing is decoded and re-encoded.

Each turn after the first is one ``generate`` call over the episodes still running, each a prompt of its full token
history (n = 1): what a vLLM engine with prefix caching serves without recomputing the history. The call samples up
to the largest remaining budget; each episode's turn is then cut at its own (the tokens before a cut are drawn as they
would be with a smaller limit), and an episode cut there ends unfinished, as a single-turn completion does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from oumi_megatron.environments.base import Environment, EpisodeEnd
from oumi_megatron.environments.rendering import observation_ids
from oumi_megatron.rollout.base import Rollout, RolloutBackend
from oumi_megatron.rollout.sampling import SamplingParams


@dataclass
class EpisodeStats:
    """What a batch of episodes did, for the step's ``env/*`` metrics."""

    episodes: int = 0
    turns: list[int] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    parse_failures: int = 0
    observation_tokens: int = 0
    observations_truncated: int = 0
    failed: list[str] = field(default_factory=list)
    """Episodes the environment raised in (out of the loss): ``row i: exception`` (in ``start``) or ``episode k:
    exception`` (in ``step``)."""
    environment_s: float = 0.0
    sample: list[dict[str, Any]] = field(default_factory=list)
    """The first episode's turns: ``{"turn": text}`` and ``{"observation": text}`` in order."""


@dataclass
class _Episode:
    prompt: list[int]
    state: Any
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    """The policy's ids of its latest turn (what the environment answers)."""
    turns: int = 0
    finished: bool = False
    running: bool = True
    failed: str | None = None

    def take_turn(self, turn: Rollout, budget: int) -> None:
        """Appends the policy's turn, cut to ``budget`` tokens."""
        ids = self.last_turn = turn.completion_ids[:budget]
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(turn.logprobs[:budget]) if turn.logprobs is not None else [0.0] * len(ids)
        self.turns += 1
        self.finished = turn.finished and len(ids) == len(turn.completion_ids)


def run_episodes(backend: RolloutBackend, tokenizer: Any, env: Environment, prompts: list[list[int]],
                 rows: list[dict[str, Any]], params: SamplingParams, n: int, max_turns: int,
                 max_observation_tokens: int | None = None, seed: int | None = None) -> tuple[list[list[Rollout]], EpisodeStats]:
    """``n`` episodes of each of ``prompts`` (dataset ``rows`` alongside), grouped per prompt as ``generate``'s result;
    ``params.max_new_tokens`` bounds each episode's whole completion (turns and observations). An episode whose
    environment raises ends there; its index is in ``EpisodeStats.failed`` (the caller drops it from the loss)."""
    stats = EpisodeStats()
    budget = params.max_new_tokens
    first = backend.generate(prompts, params, n, seed=seed)
    episodes: list[_Episode] = []
    for i, group in enumerate(first):
        for turn in group:
            started = time.perf_counter()
            e = _Episode(prompts[i], None)
            try:
                e.state = env.start(rows[i])
            except Exception as ex:  # noqa: BLE001 - an environment's failure ends its episode, not the run
                e.failed, e.running = f"row {i}: {type(ex).__name__}: {ex}", False
            stats.environment_s += time.perf_counter() - started
            e.take_turn(turn, budget)
            episodes.append(e)
    for turn_index in range(1, max_turns + 1):
        for k, e in enumerate(episodes):
            if e.running:
                _answer(e, k, tokenizer, env, budget, turn_index == max_turns, max_observation_tokens, stats)
        going = [e for e in episodes if e.running]
        if not going:
            break
        room = max(budget - len(e.ids) for e in going)
        turn_seed = None if seed is None else seed + turn_index
        turns = backend.generate([e.prompt + e.ids for e in going], replace(params, max_new_tokens=room), 1, seed=turn_seed)
        for e, (turn,) in zip(going, turns):
            e.take_turn(turn, budget - len(e.ids))
    stats.episodes = len(episodes)
    stats.turns = [e.turns for e in episodes]
    stats.failed = [e.failed for e in episodes if e.failed]
    out = [Rollout(e.prompt, e.ids, e.finished and e.failed is None, e.logprobs, loss_mask=e.mask) for e in episodes]
    return [out[i * n:(i + 1) * n] for i in range(len(prompts))], stats


def _answer(e: _Episode, index: int, tokenizer: Any, env: Environment, budget: int, last_turn: bool,
            max_observation_tokens: int | None, stats: EpisodeStats) -> None:
    """The environment's answer to ``e``'s latest turn: the episode ends, or gets an observation and goes on."""
    if not e.finished or len(e.ids) >= budget:  # cut by the budget: nothing more fits
        e.running = False
        return
    turn_ids = e.last_turn
    text = tokenizer.decode(turn_ids, skip_special_tokens=True)
    started = time.perf_counter()
    try:
        answer = env.step(e.state, text, turn_ids)
    except Exception as ex:  # noqa: BLE001
        e.failed, e.running = f"episode {index}: {type(ex).__name__}: {ex}", False
        return
    finally:
        stats.environment_s += time.perf_counter() - started
    if index == 0:
        stats.sample.append({"turn": text})
    if isinstance(answer, EpisodeEnd):
        e.running = False
        return
    stats.tool_calls += answer.tool_call
    stats.tool_errors += answer.error
    stats.parse_failures += answer.parse_failure
    if last_turn:  # max_turns assistant turns taken: the observation would have no turn to answer it
        e.running, e.finished = False, False
        return
    ids, truncated = observation_ids(tokenizer, answer, max_observation_tokens)
    stats.observations_truncated += truncated
    if len(e.ids) + len(ids) >= budget:  # no room for the observation and a turn after it
        e.running, e.finished = False, False
        return
    if index == 0:
        stats.sample.append({"observation": answer.text})
    e.ids += ids
    e.mask += [0] * len(ids)
    e.logprobs += [0.0] * len(ids)
    stats.observation_tokens += len(ids)

