"""Multi-turn episodes on an engine that only generates: one ``generate`` per turn over every episode still going,
each from its whole token history (a vLLM engine with prefix caching serves the history from its cache).

This is the turn barrier: a turn lasts until its slowest row stops. Backends that run episodes at their own pace
implement rollout/base.py ``RunsEpisodes`` instead: the embedded static-cache decoder, and vLLM through
``request_chains`` below (every episode its own chain of requests to an engine that batches continuously, the next
request submitted as soon as the episode's observation is ready). All report to the same ``TurnHandler``, so an
episode's bookkeeping (environments/episodes.py) is one piece of code.

The turn samples up to the largest room any going episode has; each episode's turn is then cut at its own room (the
tokens before a cut are drawn as they would be with a smaller limit), and reported as not ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from oumi_megatron.rollout.base import ANSWERING, EpisodeRun, Generates, NextTurn, TurnEnd, TurnHandler
from oumi_megatron.rollout.sampling import SamplingParams


def turn_by_turn(engine: Generates, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler,
                 seed: int | None = None) -> EpisodeRun:
    """``n`` episodes of each of ``prompts`` (row ``i * n + j``), each first turn up to ``params.max_new_tokens``
    tokens; later turns' rooms come from ``turns``. Turn t > 0 is drawn with seed ``seed + t``."""
    first = engine.generate(prompts, params, n, seed=seed)
    histories = [list(r.prompt_ids) + list(r.completion_ids) for group in first for r in group]
    going = _next_turns(turns, [TurnEnd(k, list(r.completion_ids), r.logprobs, r.finished, r.version)
                                for k, r in enumerate(r for group in first for r in group)])
    turn = 1
    while going:
        rows = sorted(going)
        for k in rows:
            histories[k] += going[k].appended
        room = max(going[k].room for k in rows)
        out = engine.generate([histories[k] for k in rows], replace(params, max_new_tokens=room), 1,
                              seed=None if seed is None else seed + turn)
        ends = []
        for k, (r,) in zip(rows, out, strict=True):
            ids = list(r.completion_ids[:going[k].room])
            histories[k] += ids
            logprobs = None if r.logprobs is None else list(r.logprobs[:len(ids)])
            ends.append(TurnEnd(k, ids, logprobs, r.finished and len(ids) == len(r.completion_ids), r.version))
        going = _next_turns(turns, ends)
        turn += 1
    return EpisodeRun()


def _next_turns(turns: TurnHandler, ends: list[TurnEnd]) -> dict[int, NextTurn]:
    """The next turn of each episode of ``ends`` that goes on, once every one is answered (the barrier)."""
    answers = dict(zip((e.row for e in ends), turns.turns_ended(ends)))
    while any(a is ANSWERING for a in answers.values()):
        answers.update(turns.answered(wait=True))
    return {k: a for k, a in sorted(answers.items()) if isinstance(a, NextTurn)}



_BATCHES = itertools.count()

FinishedRequest = tuple[str, list[int], list[float], str]
"""A request an engine finished: (its id, token ids, their logprobs, finish reason: ``stop`` at an end token)."""


def request_chains(add: Callable[[list[tuple[str, list[int], Any]]], None], step: Callable[[], list[FinishedRequest]],
                   sampling: Callable[[int], Any], prompts: list[list[int]], params: SamplingParams, n: int,
                   turns: TurnHandler) -> EpisodeRun:
    """``n`` episodes of each of ``prompts`` on an engine that batches requests continuously (vLLM's engine loop):
    ``add`` submits ``(request id, prompt ids, sampling(room))`` requests, ``step`` runs the engine until some finish.
    Each episode is a chain of requests, each turn's prompt its whole history (the engine's prefix cache serves it),
    the next one added as soon as the turn is answered: no turn waits for another episode's."""
    batch = next(_BATCHES)
    rows = len(prompts) * n
    histories = [list(prompts[k // n]) for k in range(rows)]
    taken = [0] * rows
    add([(f"episode-{batch}-{k}-0", histories[k], sampling(params.max_new_tokens)) for k in range(rows)])
    in_flight, answering = rows, 0
    while in_flight or answering:
        decided: list[tuple[int, NextTurn | None]] = []
        if in_flight:
            ends = []
            for request_id, ids, logprobs, reason in step():
                k = int(request_id.split("-")[2])
                in_flight -= 1
                histories[k] += ids
                ends.append(TurnEnd(k, list(ids), list(logprobs) or None, reason == "stop"))
            for end, answer in zip(ends, turns.turns_ended(ends), strict=True):
                if answer is ANSWERING:
                    answering += 1
                else:
                    decided.append((end.row, answer))
        if answering:  # wait only when the engine has nothing else to run
            got = turns.answered(wait=not in_flight and all(a is None for _, a in decided))
            answering -= len(got)
            decided += got
        requests = []
        for k, answer in decided:
            if answer is None:
                continue
            histories[k] += answer.appended
            taken[k] += 1
            requests.append((f"episode-{batch}-{k}-{taken[k]}", list(histories[k]), sampling(answer.room)))
        if requests:
            add(requests)
            in_flight += len(requests)
    return EpisodeRun()
