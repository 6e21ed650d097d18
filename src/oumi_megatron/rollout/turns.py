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
from oumi_megatron.utils.faults import kill_point

PARTIAL_ROLLOUT_CHUNK = 32
"""``grpo.partial_rollouts``: the most tokens of a turn one request generates; a weight push waits for at most one such
piece of each episode in flight (the engine's prefix cache serves the tokens before it)."""


def turn_by_turn(engine: Generates, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler,
                 seed: int | None = None, chunk: int | None = None) -> EpisodeRun:
    """``n`` episodes of each of ``prompts`` (row ``i * n + j``), each first turn up to ``params.max_new_tokens``
    tokens; later turns' rooms come from ``turns``. Turn t > 0 is drawn with seed ``seed + t``. ``chunk``: each turn
    generated in pieces of at most that many tokens (``grpo.partial_rollouts``), each piece a request continuing the
    row's tokens so far."""
    rows = [r for group in engine.generate(prompts, _capped(params, chunk), n, seed=seed) for r in group]
    histories = [list(r.prompt_ids) for r in rows]
    asked = min(params.max_new_tokens, chunk or params.max_new_tokens)
    firsts = [_Turn(list(r.completion_ids), r.logprobs, r.finished, r.version, asked) for r in rows]
    if chunk is not None:
        _pieces(engine, params, histories, dict(enumerate(firsts)), {k: params.max_new_tokens for k in range(len(rows))}, chunk)
    for k, t in enumerate(firsts):
        histories[k] += t.ids
    going = _next_turns(turns, [t.end(k) for k, t in enumerate(firsts)])
    turn = 1
    while going:
        keys = sorted(going)
        for k in keys:
            histories[k] += going[k].appended
        rooms = {k: going[k].room for k in keys}
        later = {k: _Turn([], [], False, None) for k in keys}  # open: its first piece is still to come
        _pieces(engine, params, histories, later, rooms, chunk or max(rooms.values()), None if seed is None else seed + turn)
        for k in keys:
            histories[k] += later[k].ids
        going = _next_turns(turns, [later[k].end(k) for k in keys])
        turn += 1
    return EpisodeRun()


class _Turn:
    """A turn being generated: its ids, logprobs, whether it ended (EOS or a stop token) and each token's version."""

    def __init__(self, ids: list[int], logprobs: list[float] | None, finished: bool, version: int | None,
                 asked: int = 0) -> None:
        self.ids, self.logprobs, self.finished = ids, logprobs, finished
        self.versions: list[int | None] = [version] * len(ids)
        self.open = not finished and len(ids) == asked
        """Its latest piece stopped at the piece's size: under partial rollouts the turn goes on."""

    def add(self, ids: list[int], logprobs: list[float] | None, finished: bool, version: int | None, asked: int) -> None:
        self.ids += ids
        self.logprobs = None if self.logprobs is None or logprobs is None else self.logprobs + logprobs
        self.finished = finished
        self.versions += [version] * len(ids)
        self.open = not finished and len(ids) == asked

    def goes_on(self, room: int) -> bool:
        """Its latest piece stopped at the piece's size and the turn has room left: another piece follows."""
        return self.open and len(self.ids) < room

    def end(self, row: int) -> TurnEnd:
        return TurnEnd(row, self.ids, self.logprobs, self.finished, self.versions)


def _capped(params: SamplingParams, chunk: int | None) -> SamplingParams:
    return params if chunk is None else replace(params, max_new_tokens=min(params.max_new_tokens, chunk))


def _pieces(engine: Generates, params: SamplingParams, histories: list[list[int]], turns: dict[int, _Turn],
            rooms: dict[int, int], chunk: int, seed: int | None = None) -> None:
    """Each turn of ``turns`` that neither ended nor filled its room goes on, one piece of at most ``chunk`` tokens a
    request (the first drawn with ``seed``), from its row's history and the turn so far (token ids, never
    re-tokenized), until it ends or fills its room. Whole turns: ``chunk`` >= every room, one piece. Under
    ``grpo.partial_rollouts`` the engine may take a weight push between two pieces: each piece keeps its version."""
    while True:
        going = [k for k, t in turns.items() if t.goes_on(rooms[k])]
        if not going:
            return
        _piece(engine, params, histories, turns, rooms, going, chunk, seed)
        seed = None


def _piece(engine: Generates, params: SamplingParams, histories: list[list[int]] | dict[int, list[int]],
           turns: dict[int, _Turn], rooms: dict[int, int], keys: list[int], chunk: int | None,
           seed: int | None = None) -> None:
    """One piece of the turns of ``keys`` in one ``generate``: at most ``chunk`` tokens each (None: the rest of its
    room), a request from its row's history and the turn so far."""
    kill_point("episode")  # turns open (the resume stress test)
    asked = {k: min(chunk or rooms[k], rooms[k] - len(turns[k].ids)) for k in keys}
    out = engine.generate([histories[k] + turns[k].ids for k in keys],
                          replace(params, max_new_tokens=max(asked.values())), 1, seed=seed)
    for k, (r,) in zip(keys, out, strict=True):
        ids = list(r.completion_ids[:asked[k]])
        turns[k].add(ids, None if r.logprobs is None else list(r.logprobs[:len(ids)]),
                     r.finished and len(ids) == len(r.completion_ids), r.version, asked[k])


class EpisodeStream:
    """Episodes that join while others run (``grpo.streaming_groups``): each ``advance`` is one ``generate`` over every
    row that has a turn to take (a piece of at most ``chunk`` tokens each, or its whole turn), whichever batch it came
    with, and each row's next turn is taken as soon as its observation is back: no row waits for another's turn or
    tool. Rows are the handler's episode keys; ``advance`` returns those whose episodes ended."""

    def __init__(self, engine: Generates, params: SamplingParams, turns: TurnHandler, chunk: int | None) -> None:
        self.engine, self.params, self.turns, self.chunk = engine, params, turns, chunk
        self.histories: dict[int, list[int]] = {}
        """Each row's tokens so far, its open turn's excepted."""
        self.open: dict[int, _Turn] = {}
        """Rows taking a turn (their pieces so far)."""
        self.rooms: dict[int, int] = {}
        self.answering: set[int] = set()
        """Rows whose environment answers in the background."""

    def add(self, rows: dict[int, tuple[list[int], int]]) -> None:
        """New rows, each ``(prompt ids, first turn's room)``: their first turns are taken from the next ``advance``."""
        for k, (prompt, room) in rows.items():
            self.histories[k], self.rooms[k], self.open[k] = list(prompt), room, _Turn([], [], False, None)

    @property
    def busy(self) -> bool:
        """Some row takes a turn or waits for its answer."""
        return bool(self.open or self.answering)

    def advance(self, wait: bool) -> list[int]:
        """One round: a piece of every open turn, the turns that ended handed to the handler, the answers that came back
        taken (with ``wait``, waiting for one when no row has a turn to take). The rows whose episodes ended."""
        decided: list[tuple[int, NextTurn | None]] = []
        if self.open:
            keys = sorted(self.open)
            _piece(self.engine, self.params, self.histories, self.open, self.rooms, keys, self.chunk)
            ends = []
            for k in keys:
                turn = self.open[k]
                if not turn.goes_on(self.rooms[k]):  # the turn ended, or filled its room
                    del self.open[k]
                    self.histories[k] += turn.ids
                    ends.append(turn.end(k))
            for end, answer in zip(ends, self.turns.turns_ended(ends), strict=True):
                if answer is ANSWERING:
                    self.answering.add(end.row)
                else:
                    decided.append((end.row, answer))
        if self.answering:
            got = self.turns.answered(wait=wait and not self.open and not decided)
            self.answering.difference_update(k for k, _ in got)
            decided += got
        ended = []
        for k, answer in decided:
            if answer is None:
                ended.append(k)
                del self.histories[k], self.rooms[k]
            else:
                self.histories[k] += answer.appended
                self.rooms[k], self.open[k] = answer.room, _Turn([], [], False, None)
        return ended


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
