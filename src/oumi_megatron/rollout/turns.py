"""Multi-turn episodes on an engine that only generates: one ``generate`` per turn over every episode still going,
each from its whole token history (a vLLM engine with prefix caching serves the history from its cache).

This is the turn barrier: a turn lasts until its slowest row stops. Backends that run episodes at their own pace
implement rollout/base.py ``RunsEpisodes`` instead (the embedded static-cache decoder). Both report to the same
``TurnHandler``, so an episode's bookkeeping (environments/episodes.py) is one piece of code.

The turn samples up to the largest room any going episode has; each episode's turn is then cut at its own room (the
tokens before a cut are drawn as they would be with a smaller limit), and reported as not ended.
"""

from __future__ import annotations

from dataclasses import replace

from oumi_megatron.rollout.base import ANSWERING, EpisodeRun, Generates, NextTurn, TurnEnd, TurnHandler
from oumi_megatron.rollout.sampling import SamplingParams


def turn_by_turn(engine: Generates, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler,
                 seed: int | None = None) -> EpisodeRun:
    """``n`` episodes of each of ``prompts`` (row ``i * n + j``), each first turn up to ``params.max_new_tokens``
    tokens; later turns' rooms come from ``turns``. Turn t > 0 is drawn with seed ``seed + t``."""
    first = engine.generate(prompts, params, n, seed=seed)
    histories = [list(r.prompt_ids) + list(r.completion_ids) for group in first for r in group]
    going = _next_turns(turns, [TurnEnd(k, list(r.completion_ids), r.logprobs, r.finished)
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
            ends.append(TurnEnd(k, ids, logprobs, r.finished and len(ids) == len(r.completion_ids)))
        going = _next_turns(turns, ends)
        turn += 1
    return EpisodeRun()


def _next_turns(turns: TurnHandler, ends: list[TurnEnd]) -> dict[int, NextTurn]:
    """The next turn of each episode of ``ends`` that goes on, once every one is answered (the barrier)."""
    answers = dict(zip((e.row for e in ends), turns.turns_ended(ends)))
    while any(a is ANSWERING for a in answers.values()):
        answers.update(turns.answered(wait=True))
    return {k: a for k, a in sorted(answers.items()) if isinstance(a, NextTurn)}

