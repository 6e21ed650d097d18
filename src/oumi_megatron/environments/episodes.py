"""Multi-turn episodes on any rollout backend: the policy takes a turn, the environment answers, its observation is
appended as token ids, and the policy takes the next turn from the whole history, until the environment ends the
episode, ``max_turns`` assistant turns were taken, or the completion budget is spent.

Token-in / token-out: an episode's completion is the policy's sampled ids of every turn exactly as the backend
returned them (with their logprobs), and between turns the observation's ids (environments/rendering.py), marked 0 in
``Sample.loss_mask`` (logprob 0.0 there: never read, the mask excludes them). Nothing is decoded and re-encoded.

``Episodes`` is the episodes' side of a batch (rollout/base.py ``TurnHandler``): it keeps each episode's ids, mask and
counts, and answers each ended turn with the next one (its observation and room) or with the episode's end. The
backend decides when turns are taken: the embedded static-cache decoder runs every episode at its own pace (a row
whose turn ends is answered while the others still decode: rollout/decoding/episodes.py); any other backend takes
turn by turn, one ``generate`` of every going episode's history per turn (rollout/turns.py). Both are one call,
``run_episodes`` here.

Each turn samples up to its room: the episode's budget left, and ``max_turn_tokens``. A turn cut at the budget ends
the episode unfinished (as a single-turn completion cut at max_completion_length); a turn cut at ``max_turn_tokens``
is closed with the end-of-turn token (as context) and answered.
An environment with ``stop_strings`` also ends turns at their tokens (``SamplingParams.stop_token_ids``); its answer to
such a turn continues the assistant's message (rendering.py ``inline_ids``: the text as is, no template), and the
episode is finished only where its last turn ended with the end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd
from oumi_megatron.environments.rendering import inline_ids, observation_ids, stop_token_ids
from oumi_megatron.environments.runner import EnvironmentRunner, Failure
from oumi_megatron.rollout.base import ANSWERING, Answering, EpisodeRun, Generates, NextTurn, RunsEpisodes, TurnEnd
from oumi_megatron.rollout.sample import Sample, SampleStatus
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.rollout.turns import turn_by_turn


@dataclass
class EpisodeStats:
    """What a batch of episodes did as a whole, for the step's ``env/*`` and ``rollout/*`` metrics (each episode's own
    turns, tool calls, end and failure are its ``Sample``'s)."""

    multi_turn: bool = True
    """An environment took part (False: single-turn samples, one turn each, no ``env/*`` metrics)."""
    tool_errors: int = 0
    parse_failures: int = 0
    observation_tokens: int = 0
    observations_truncated: int = 0
    environment_s: float = 0.0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    """The first episode's turns: ``{"turn": text}`` and ``{"observation": text}`` in order."""
    engine: EpisodeRun = field(default_factory=EpisodeRun)
    """What the batch cost the engine: decode steps, each continued turn's time to first token, concurrency."""
    critical_path_tokens: int = 0
    """The longest episode's completion tokens, observations included: the least decode steps a batch whose
    observations are fed one token a step could take (appended in one forward, they take none)."""


@dataclass
class _Episode:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    """Per token, the policy version of the turn it belongs to (an observation: the turn it answers); None where the
    engine reports no version per turn."""
    last_turn: list[int] = field(default_factory=list)
    """The policy's ids of its latest turn (what the environment answers)."""
    appended: list[int] = field(default_factory=list)
    """The ids put after the latest turn (the observation): what the backend feeds before the next turn."""
    logprobs_missing: bool = False
    """A turn came without the engine's logprobs: the rollout has none (the mismatch metrics skip it)."""
    room: int = 0
    """The latest turn's room (the most tokens it could sample)."""
    room_is_turn_limit: bool = False
    """That room was ``max_turn_tokens``, less than the budget left: a turn that fills it is closed and answered."""
    turns: int = 0
    calls: int = 0
    finished: bool = False
    """The latest turn ended with the end-of-turn token (or a stop token) the policy sampled."""
    stopped: bool = False
    """The latest turn ended with one of the environment's stop tokens: its answer continues the assistant's message."""
    running: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    """Why its environment failed (it ends there)."""

    def take_turn(self, turn: TurnEnd, stops: frozenset[int]) -> None:
        """Appends the policy's turn (``stops``: the environment's stop tokens)."""
        ids = self.last_turn = turn.ids
        self.ids += ids
        self.mask += [1] * len(ids)
        self.versions += turn.versions if turn.versions is not None else [None] * len(ids)
        if turn.logprobs is None:
            self.logprobs_missing = True
        self.logprobs += turn.logprobs if turn.logprobs is not None else [0.0] * len(ids)
        self.turns += 1
        self.finished = turn.ended
        self.stopped = self.finished and ids[-1] in stops

    @property
    def at_turn_limit(self) -> bool:
        """The latest turn was cut at ``max_turn_tokens`` (not at the episode's budget): it is closed and answered."""
        return not self.finished and self.room_is_turn_limit and len(self.last_turn) == self.room


class Episodes:
    """The episodes of one batch (``n`` per prompt, episode ``k`` of prompt ``k // n``): a ``TurnHandler``. Collective
    over the model replica (``env`` calls the environment on its first rank): build it, hand it to a backend, then read
    ``samples``. ``env`` None: single-turn samples, every turn ends its episode. ``groups``: each prompt's group id
    (default: its index)."""

    def __init__(self, tokenizer: Any, env: EnvironmentRunner | None, prompts: list[list[int]], rows: list[dict[str, Any]],
                 n: int, budget: int, max_turns: int, max_observation_tokens: int | None = None,
                 max_turn_tokens: int | None = None, stops: tuple[int, ...] = (), eos_token_id: int | None = None,
                 groups: list[int] | None = None) -> None:
        self.tokenizer, self.env, self.n = tokenizer, env, n
        self.background = env is not None and env.workers > 0
        self.budget, self.max_turns, self.max_observation_tokens = budget, max_turns, max_observation_tokens
        self.max_turn_tokens, self.stops, self.eos_token_id = max_turn_tokens, frozenset(stops), eos_token_id
        self.episodes: dict[int, _Episode] = {}
        """Episode key -> its episode (keys 0, 1, ... in the order they were added)."""
        self.group_of: dict[int, int] = {}
        """Episode key -> its group id."""
        self.added = 0
        """Episodes added so far: the next key (keys are never reused, taken episodes' included)."""
        self.stats = EpisodeStats()
        self.env_seconds_before = env.seconds if env is not None else 0.0  # the runner's clock runs over the whole run
        self.add(prompts, rows, list(range(len(prompts))) if groups is None else groups)

    def add(self, prompts: list[list[int]], rows: list[dict[str, Any]], groups: list[int]) -> list[int]:
        """``n`` more episodes of each of ``prompts`` (``rows``, ``groups``: each prompt's row and group id), started in
        the environment; their keys, prompt ``i``'s ``n`` adjacent. Episodes added to a batch that runs (a stream of
        groups, rollout/turns.py ``EpisodeStream``) join the ones going on."""
        first = self.added
        keys = list(range(first, first + len(prompts) * self.n))
        self.added += len(keys)
        for k in keys:
            e = self.episodes[k] = _Episode(prompts[(k - first) // self.n])
            e.room, e.room_is_turn_limit = self.room(e)
            self.group_of[k] = groups[(k - first) // self.n]
        if self.env is not None and keys:
            started = self.env.start_all([(k, rows[(k - first) // self.n]) for k in keys], fresh=first == 0)
            for k, failure in zip(keys, started, strict=True):
                if failure is not None:
                    self.episodes[k].failure = failure.reason  # its first turn is taken (the batch's shape), then it ends
        return keys

    def room(self, e: _Episode) -> tuple[int, bool]:
        """The next turn's room, and whether ``max_turn_tokens`` set it."""
        left = self.budget - len(e.ids)
        if self.max_turn_tokens is not None and self.max_turn_tokens < left:
            return self.max_turn_tokens, True
        return left, False

    def turns_ended(self, ends: list[TurnEnd]) -> list[NextTurn | None | Answering]:
        """Each ended turn's next turn, None (the episode is over), or ``ANSWERING`` (the environment answers in the
        background, ``grpo.environment_workers`` >= 1: ``answered`` returns it)."""
        asked: list[tuple[int, str, list[int]]] = []
        for end in ends:
            e = self.episodes[end.row]
            e.take_turn(end, self.stops)
            if e.failure is not None:  # its environment did not start
                e.running = False
            elif self.env is None or not (e.finished or e.at_turn_limit) or len(e.ids) >= self.budget:
                e.running = False  # no environment, or cut by the budget: nothing more fits
            else:
                asked.append((end.row, self.tokenizer.decode(e.last_turn, skip_special_tokens=True), e.last_turn))
        background = self.background
        asked_rows = {k for k, _, _ in asked}
        if asked and background:
            assert self.env is not None
            self.env.submit(asked)
        answers = dict(zip((k for k, _, _ in asked), self.env.step_all(asked) if asked and self.env and not background else []))
        out: list[NextTurn | None | Answering] = []
        for end in ends:
            k, e = end.row, self.episodes[end.row]
            if background and k in asked_rows:
                out.append(ANSWERING)
                continue
            if k in answers:
                self._answer(k, e, answers[k])
            out.append(self._next(e))
        return out

    def answered(self, wait: bool) -> list[tuple[int, NextTurn | None]]:
        """The turns the environment answered in the background since the last call (``wait``: at least one)."""
        if self.env is None or not self.env.answering:
            return []
        out: list[tuple[int, NextTurn | None]] = []
        for k, answer in self.env.poll(wait):
            e = self.episodes[k]
            self._answer(k, e, answer)
            out.append((k, self._next(e)))
        return out

    @staticmethod
    def _next(e: _Episode) -> NextTurn | None:
        return NextTurn(e.appended, e.room) if e.running else None

    def _answer(self, k: int, e: _Episode, answer: Any) -> None:
        """The environment's ``answer`` to episode ``k``'s latest turn: it ends, or gets its observation (``e.appended``)
        and the next turn's room."""
        stats = self.stats
        if k == 0:
            stats.transcript.append({"turn": self.tokenizer.decode(e.last_turn, skip_special_tokens=True)})
        if isinstance(answer, Failure):
            e.failure, e.running = answer.reason, False
            return
        e.calls += answer.tool_call  # an observation's call, or the call that ended the episode
        if isinstance(answer, EpisodeEnd):
            e.running, e.info = False, dict(answer.info)
            return
        stats.tool_errors += answer.error
        stats.parse_failures += answer.parse_failure
        if e.turns >= self.max_turns:  # max_turns assistant turns taken: the observation would have no turn to answer it
            e.running, e.finished = False, False
            return
        if e.stopped:  # inside the assistant's message, as the environment wrote it
            ids, truncated = inline_ids(self.tokenizer, answer, self.max_observation_tokens)
        else:
            ids, truncated = observation_ids(self.tokenizer, answer, self.max_observation_tokens)
        if e.at_turn_limit and self.eos_token_id is not None:  # the turn the limit cut is closed as the template closes one
            ids = [self.eos_token_id, *ids]
        stats.observations_truncated += truncated or answer.truncated
        if len(e.ids) + len(ids) >= self.budget:  # no room for the observation and a turn after it
            e.running, e.finished = False, False
            return
        if k == 0:
            stats.transcript.append({"observation": answer.text})
        e.ids += ids
        e.mask += [0] * len(ids)
        e.versions += [e.versions[-1] if e.versions else None] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.appended = ids
        e.room, e.room_is_turn_limit = self.room(e)
        stats.observation_tokens += len(ids)

    def samples(self, engine: EpisodeRun) -> tuple[list[Sample], EpisodeStats]:
        """The episodes as samples (prompt ``i``'s ``n`` adjacent), and their stats (``engine``: what the backend
        reported)."""
        return self.take(list(self.episodes)), self.take_stats(engine)

    def take(self, keys: list[int]) -> list[Sample]:
        """Episodes ``keys`` (ended) as samples, in that order; they leave the batch (and the environment's states)."""
        multi_turn = self.env is not None
        out = []
        for k in keys:
            e = self.episodes.pop(k)
            out.append(Sample(e.prompt, e.ids, self.group_of.pop(k), _status(e), None if e.logprobs_missing else e.logprobs,
                              loss_mask=e.mask if multi_turn else None, failure=e.failure, turns=e.turns,
                              tool_calls=e.calls, env_info=e.info if multi_turn else None, versions=_versions(e)))
            self.stats.critical_path_tokens = max(self.stats.critical_path_tokens, len(e.ids))
        if self.env is not None:
            self.env.forget(keys)
        for sample in out:
            sample.check()
        return out

    def take_stats(self, engine: EpisodeRun) -> EpisodeStats:
        """What the episodes did since the last ``take_stats`` (``engine``: what the backend reported of it); the count
        starts again."""
        stats, self.stats = self.stats, EpisodeStats()
        stats.multi_turn = self.env is not None
        if self.env is not None:
            stats.environment_s = self.env.seconds - self.env_seconds_before
            self.env_seconds_before = self.env.seconds
        stats.engine = engine
        return stats


def _versions(e: _Episode) -> list[int]:
    """The episode's per-token versions where the engine reported one for every turn, else none (the driver stamps the
    batch's version)."""
    return [v for v in e.versions if v is not None] if e.versions and None not in e.versions else []


def _status(e: _Episode) -> SampleStatus:
    if e.failure is not None:
        return SampleStatus.FAILED
    # a turn that stopped at one of the environment's stop tokens ended no message: the episode was cut there
    return SampleStatus.FINISHED if e.finished and not e.stopped else SampleStatus.TRUNCATED


def run_episodes(backend: Generates, tokenizer: Any, env: EnvironmentRunner | None, prompts: list[list[int]],
                 rows: list[dict[str, Any]], params: SamplingParams, n: int, max_turns: int,
                 max_observation_tokens: int | None = None, seed: int | None = None,
                 max_turn_tokens: int | None = None, groups: list[int] | None = None,
                 chunk: int | None = None) -> tuple[list[Sample], EpisodeStats]:
    """``n`` episodes of each of ``prompts`` (dataset ``rows`` alongside) as samples, prompt ``i``'s ``n`` adjacent, in
    ``generate``'s order (``groups``: each prompt's group id, default its index);
    ``params.max_new_tokens`` bounds each episode's whole completion (turns and observations), ``max_turn_tokens``
    each turn (a turn cut there is closed with the end-of-turn token, as context, and answered). ``chunk``: each turn
    generated in pieces of at most that many tokens (``grpo.partial_rollouts``, rollout/turns.py). Collective over the
    model replica (``env`` calls the environment on its first rank). An episode whose environment call raises or
    times out ends there, a FAILED sample with its reason (the caller drops it from the loss). ``env`` None: one turn
    each, a plain generation."""
    episodes, params = episodes_of(tokenizer, env, prompts, rows, params, n, max_turns, max_observation_tokens,
                                   max_turn_tokens, groups)
    first = replace(params, max_new_tokens=episodes.episodes[0].room) if episodes.episodes else params
    if isinstance(backend, RunsEpisodes):
        engine = backend.run_episodes(prompts, first, n, episodes, params.max_new_tokens, episodes.max_turns, seed)
    else:
        engine = turn_by_turn(backend, prompts, first, n, episodes, seed, chunk)
    return episodes.samples(engine)


def episodes_of(tokenizer: Any, env: EnvironmentRunner | None, prompts: list[list[int]], rows: list[dict[str, Any]],
                params: SamplingParams, n: int, max_turns: int, max_observation_tokens: int | None = None,
                max_turn_tokens: int | None = None, groups: list[int] | None = None) -> tuple[Episodes, SamplingParams]:
    """The ``Episodes`` of ``prompts`` (``run_episodes``' arguments; none, for a stream that groups join later) and the
    sampling their turns take: the environment's stop tokens end turns too; without an environment, one turn each."""
    stops = stop_token_ids(tokenizer, env.stop_strings) if env is not None else ()
    if stops:
        params = replace(params, stop_token_ids=stops)
    multi_turn = env is not None
    episodes = Episodes(tokenizer, env, prompts, rows, n, params.max_new_tokens, max_turns if multi_turn else 1,
                        max_observation_tokens, max_turn_tokens if multi_turn else None, stops, params.eos_token_id, groups)
    return episodes, params


def merge_stats(parts: list[EpisodeStats]) -> EpisodeStats:
    """Several batches' stats as one (dynamic sampling's rounds): their counts and engine costs added (the rounds ran
    one after another), the first batch's transcript."""
    out = EpisodeStats(multi_turn=any(p.multi_turn for p in parts), transcript=parts[0].transcript if parts else [])
    for part in parts:
        for name in ("tool_errors", "parse_failures", "observation_tokens", "observations_truncated",
                     "environment_s", "critical_path_tokens"):
            setattr(out, name, getattr(out, name) + getattr(part, name))
        out.engine.decode_steps += part.engine.decode_steps
        out.engine.append_forwards += part.engine.append_forwards
        out.engine.continued_ttft_s += part.engine.continued_ttft_s
        out.engine.answer_s += part.engine.answer_s
    steps = [p.engine.decode_steps for p in parts]
    out.engine.concurrency = sum(p.engine.concurrency * s for p, s in zip(parts, steps)) / max(sum(steps), 1)
    return out


def episode_sums(samples: list[Sample], stats: EpisodeStats) -> list[float]:
    """This rank's sums behind ``episode_metrics`` (summed over the DP ranks by the caller), in ``SUM_KEYS`` order:
    ``samples``' episodes and ``stats``, their batches'."""
    return [float(len(samples)), float(sum(s.turns for s in samples)), float(sum(s.tool_calls > 0 for s in samples)),
            float(sum(s.tool_calls for s in samples)), float(stats.tool_errors), float(stats.parse_failures),
            float(stats.observation_tokens), float(stats.observations_truncated), float(sum(s.failed for s in samples)),
            stats.engine.concurrency, float(sum(stats.engine.continued_ttft_s)), float(len(stats.engine.continued_ttft_s))]


SUM_KEYS = ("episodes", "turns", "episodes_with_calls", "tool_calls", "tool_errors", "parse_failures",
            "observation_tokens", "observations_truncated", "failed", "concurrency", "ttft_s", "continued_turns")
MAX_KEYS = ("turns_max", "environment_s", "decode_steps", "critical_path_tokens", "append_forwards")


def episode_maxima(samples: list[Sample], stats: EpisodeStats) -> list[float]:
    """This rank's values behind ``episode_metrics`` taken as the largest over the DP ranks, in ``MAX_KEYS`` order."""
    return [float(max((s.turns for s in samples), default=0)), stats.environment_s, float(stats.engine.decode_steps),
            float(stats.critical_path_tokens), float(stats.engine.append_forwards)]


def episode_metrics(sums: list[float], maxima: list[float], multi_turn: bool) -> dict[str, float]:
    """The step's metrics from the DP-summed ``episode_sums`` and the DP-largest ``episode_maxima``: ``rollout/*``
    for every batch (``decode_steps``: the batch's, where the engine counts them; ``critical_path_tokens``: its
    longest sample's tokens, observations included), ``rollout/append_forwards`` (the forwards that wrote observations
    into the cache) and ``env/*`` for multi-turn episodes."""
    s, m = dict(zip(SUM_KEYS, sums)), dict(zip(MAX_KEYS, maxima))
    out = {"rollout/critical_path_tokens": m["critical_path_tokens"]}
    if m["decode_steps"]:
        out["rollout/decode_steps"] = m["decode_steps"]
    if not multi_turn:
        return out
    if m["decode_steps"]:
        out["rollout/append_forwards"] = m["append_forwards"]
    n = max(s["episodes"], 1.0)
    out.update({
        "env/turns_mean": s["turns"] / n, "env/turns_max": m["turns_max"],
        "env/tool_call_rate": s["episodes_with_calls"] / n, "env/tool_calls_per_episode": s["tool_calls"] / n,
        "env/tool_errors_per_episode": s["tool_errors"] / n, "env/parse_failures": s["parse_failures"],
        "env/observation_tokens_per_episode": s["observation_tokens"] / n,
        "env/observations_truncated": s["observations_truncated"], "env/failed_episodes": s["failed"],
        "env/time_s": m["environment_s"], "env/concurrency": s["concurrency"]})
    if s["continued_turns"]:
        out["env/continued_turn_ttft_s"] = s["ttft_s"] / s["continued_turns"]
    return out


EVAL_SUMS = 4


def eval_sums(scored: list[Sample], stats: EpisodeStats) -> list[float]:
    """Of a batch's scored episodes: those that called a tool, and their turns; the batch's decode steps and its
    longest episode's tokens (``EVAL_SUMS`` values)."""
    return [float(sum(s.tool_calls > 0 for s in scored)), float(sum(s.turns for s in scored)),
            float(stats.engine.decode_steps), float(stats.critical_path_tokens)]


def eval_metrics(sums: list[float], n: float, multi_turn: bool) -> dict[str, float]:
    """An evaluation's episode metrics from ``eval_sums`` (summed over its batches and DP ranks) over ``n`` prompts:
    ``decode_steps`` and ``critical_path_tokens`` where the engine counts its steps; ``tool_call_rate`` and
    ``turns_mean`` for multi-turn episodes."""
    out = {"decode_steps": sums[2], "critical_path_tokens": sums[3]} if sums[2] else {}
    if multi_turn:
        out.update({"tool_call_rate": sums[0] / max(n, 1.0), "turns_mean": sums[1] / max(n, 1.0)})
    return out
