"""Multi-turn episodes on any rollout backend: generate a turn, let the environment answer, append its observation
as token ids, generate the next turn from the whole history, until the environment ends the episode, ``max_turns``
assistant turns were taken, or the completion budget is spent.

Token-in / token-out: an episode's completion is the policy's sampled ids of every turn exactly as the backend
returned them (with their logprobs), and between turns the observation's ids (environments/rendering.py), marked 0 in
``Rollout.loss_mask`` (logprob 0.0 there: never read, the mask excludes them). Nothing is decoded and re-encoded.

Each turn after the first is one call over the episodes still running. A backend that keeps the histories cached
(``ContinuesEpisodes``: the embedded static-cache decoder, rollout/decoding/continuation.py) gets only each episode's
appended ids; any other gets a ``generate`` with each episode's full token history as its prompt (n = 1), what a vLLM
engine with prefix caching serves without recomputing the history. The call samples up
to the largest remaining budget; each episode's turn is then cut at its own (the tokens before a cut are drawn as they
would be with a smaller limit), and an episode cut there ends unfinished, as a single-turn completion does.
An environment with ``stop_strings`` also ends turns at their tokens (``SamplingParams.stop_token_ids``); its answer to
such a turn continues the assistant's message (rendering.py ``inline_ids``: the text as is, no template), and the
episode is finished only where its last turn ended with the end-of-turn token.
Under expert parallelism the replicas take every cached turn together (``EpisodeTurns.peers_agree``: each MoE
layer's all-to-all pairs their forwards): a replica whose episodes have all ended still runs the turn, with no row
continuing, until none of its peers' episodes go on, and the turn's room is the largest any peer asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from oumi_megatron.environments.base import EpisodeEnd
from oumi_megatron.environments.rendering import inline_ids, observation_ids, stop_token_ids
from oumi_megatron.environments.runner import EnvironmentRunner, Failure
from oumi_megatron.rollout.base import ContinuesEpisodes, EpisodeTurns, Generates, Rollout
from oumi_megatron.rollout.sampling import SamplingParams


@dataclass
class EpisodeStats:
    """What a batch of episodes did, for the step's ``env/*`` metrics (episode ``k`` is sample ``k`` of the result,
    groups flattened)."""

    episodes: int = 0
    turns: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    """Per episode, the turns that called a tool."""
    tool_errors: int = 0
    parse_failures: int = 0
    observation_tokens: int = 0
    observations_truncated: int = 0
    failed: dict[int, str] = field(default_factory=dict)
    """Episodes whose environment call raised or timed out (out of the loss): episode index -> why."""
    infos: list[dict[str, Any]] = field(default_factory=list)
    """Per episode, the ``EpisodeEnd.info`` that ended it (``{}``: ended otherwise), for the rewards."""
    environment_s: float = 0.0
    sample: list[dict[str, Any]] = field(default_factory=list)
    """The first episode's turns: ``{"turn": text}`` and ``{"observation": text}`` in order."""

    @property
    def tool_calls(self) -> int:
        return sum(self.calls)

    def reward_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` (row i: episode i's; the first ``len(rows)`` episodes) with how each episode ended (``env_info``:
        its ``EpisodeEnd.info``), for the reward functions."""
        return [{**row, "env_info": info} for row, info in zip(rows, self.infos)]


@dataclass
class _Episode:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    """The policy's ids of its latest turn (what the environment answers)."""
    appended: list[int] = field(default_factory=list)
    """The ids put after the latest turn (the observation): what a backend that caches the history prefills."""
    turns: int = 0
    calls: int = 0
    finished: bool = False
    """The latest turn ended with the end-of-turn token (or a stop token) the policy sampled."""
    stopped: bool = False
    """The latest turn ended with one of the environment's stop tokens: its answer continues the assistant's message."""
    at_turn_limit: bool = False
    """The latest turn was cut at ``max_turn_tokens`` (not at the episode's budget): it is closed and answered."""
    running: bool = True
    info: dict[str, Any] = field(default_factory=dict)

    def take_turn(self, turn: Rollout, budget: int, turn_limit: int | None, stops: frozenset[int] = frozenset()) -> None:
        """Appends the policy's turn, cut to ``budget`` tokens (what is left of the episode's) and ``turn_limit``;
        ``stops``: the environment's stop tokens."""
        keep = budget if turn_limit is None else min(budget, turn_limit)
        ids = self.last_turn = turn.completion_ids[:keep]
        self.appended = []
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(turn.logprobs[:keep]) if turn.logprobs is not None else [0.0] * len(ids)
        self.turns += 1
        self.finished = turn.finished and len(ids) == len(turn.completion_ids)
        self.stopped = self.finished and ids[-1] in stops
        self.at_turn_limit = not self.finished and turn_limit is not None and len(ids) == turn_limit < budget


def run_episodes(backend: Generates, tokenizer: Any, env: EnvironmentRunner, prompts: list[list[int]],
                 rows: list[dict[str, Any]], params: SamplingParams, n: int, max_turns: int,
                 max_observation_tokens: int | None = None, seed: int | None = None,
                 max_turn_tokens: int | None = None) -> tuple[list[list[Rollout]], EpisodeStats]:
    """``n`` episodes of each of ``prompts`` (dataset ``rows`` alongside), grouped per prompt as ``generate``'s result;
    ``params.max_new_tokens`` bounds each episode's whole completion (turns and observations), ``max_turn_tokens``
    each turn (a turn cut there is closed with the end-of-turn token, as context, and answered). Collective over the
    model replica (``env`` calls the environment on its first rank). An episode whose environment call raises or
    times out ends there, named in ``EpisodeStats.failed`` (the caller drops it from the loss)."""
    stats = EpisodeStats()
    env_seconds_before = env.seconds  # the runner's clock runs over the whole run
    stop_ids = stop_token_ids(tokenizer, env.stop_strings)
    stops = frozenset(stop_ids)
    if stop_ids:
        params = replace(params, stop_token_ids=stop_ids)
    budget = params.max_new_tokens
    first_room = budget if max_turn_tokens is None else min(budget, max_turn_tokens)
    first_params = replace(params, max_new_tokens=first_room)
    started_cached = backend.start_episodes(prompts, first_params, n, budget, seed) if isinstance(backend, ContinuesEpisodes) else None
    cached: EpisodeTurns | None = None
    if started_cached is not None:
        first, cached = started_cached
    else:
        first = backend.generate(prompts, first_params, n, seed=seed)
    episodes = [_Episode(prompts[i]) for i, group in enumerate(first) for _ in group]
    started = env.start_all([(k, rows[k // n]) for k in range(len(episodes))])
    for k, (e, turn) in enumerate(zip(episodes, (t for group in first for t in group))):
        e.take_turn(turn, budget, max_turn_tokens, stops)
        if started[k] is not None:
            stats.failed[k], e.running = started[k].reason, False  # type: ignore[union-attr]
    for turn_index in range(1, max_turns + 1):
        _answer_turns(episodes, tokenizer, env, budget, turn_index == max_turns, max_observation_tokens, stats,
                      params.eos_token_id)
        going = [e for e in episodes if e.running]
        room = max((budget - len(e.ids) for e in going), default=0)
        room = room if max_turn_tokens is None else min(room, max_turn_tokens)
        any_going = bool(going)
        if cached is not None:  # expert peers take every turn together: each turn's room is the largest of theirs
            any_going, room = cached.peers_agree(any_going, room)
        if not any_going:
            break
        turn_seed = None if seed is None else seed + turn_index
        turn_params = replace(params, max_new_tokens=room)
        if cached is not None:
            answered = cached.next_turn([e.appended if e.running else None for e in episodes], turn_params, turn_seed)
            turns = [[t] for t in answered if t is not None]
        else:
            turns = backend.generate([e.prompt + e.ids for e in going], turn_params, 1, seed=turn_seed)
        for e, (turn,) in zip(going, turns):
            e.take_turn(turn, budget - len(e.ids), max_turn_tokens, stops)
    stats.episodes = len(episodes)
    stats.turns = [e.turns for e in episodes]
    stats.calls = [e.calls for e in episodes]
    stats.infos = [e.info for e in episodes]
    stats.environment_s = env.seconds - env_seconds_before
    out = [Rollout(e.prompt, e.ids, e.finished and not e.stopped and k not in stats.failed, e.logprobs, loss_mask=e.mask)
           for k, e in enumerate(episodes)]
    return [out[i * n:(i + 1) * n] for i in range(len(prompts))], stats


def _answer_turns(episodes: list[_Episode], tokenizer: Any, env: EnvironmentRunner, budget: int, last_turn: bool,
                  max_observation_tokens: int | None, stats: EpisodeStats, eos_token_id: int | None) -> None:
    """The environment's answers to the running episodes' latest turns: each ends, or gets an observation and goes on."""
    asked: list[tuple[int, str, list[int]]] = []
    for k, e in enumerate(episodes):
        if not e.running:
            continue
        if not (e.finished or e.at_turn_limit) or len(e.ids) >= budget:  # cut by the budget: nothing more fits
            e.running = False
            continue
        asked.append((k, tokenizer.decode(e.last_turn, skip_special_tokens=True), e.last_turn))
    for (k, text, _), answer in zip(asked, env.step_all(asked)):
        e = episodes[k]
        if k == 0:
            stats.sample.append({"turn": text})
        if isinstance(answer, Failure):
            stats.failed[k], e.running = answer.reason, False
            continue
        if isinstance(answer, EpisodeEnd):
            e.running, e.info = False, dict(answer.info)
            continue
        e.calls += answer.tool_call
        stats.tool_errors += answer.error
        stats.parse_failures += answer.parse_failure
        if last_turn:  # max_turns assistant turns taken: the observation would have no turn to answer it
            e.running, e.finished = False, False
            continue
        if e.stopped:  # inside the assistant's message, as the environment wrote it
            ids, truncated = inline_ids(tokenizer, answer, max_observation_tokens)
        else:
            ids, truncated = observation_ids(tokenizer, answer, max_observation_tokens)
        if e.at_turn_limit and eos_token_id is not None:  # the turn the limit cut is closed as the template closes one
            ids = [eos_token_id, *ids]
        stats.observations_truncated += truncated
        if len(e.ids) + len(ids) >= budget:  # no room for the observation and a turn after it
            e.running, e.finished = False, False
            continue
        if k == 0:
            stats.sample.append({"observation": answer.text})
        e.ids += ids
        e.appended = ids
        e.mask += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        stats.observation_tokens += len(ids)


def merge_stats(parts: list[EpisodeStats]) -> EpisodeStats:
    """Several batches' stats as one (dynamic sampling's rounds), episodes renumbered in order."""
    out = EpisodeStats(sample=parts[0].sample if parts else [])
    for part in parts:
        out.failed.update({out.episodes + k: why for k, why in part.failed.items()})
        out.episodes += part.episodes
        for name in ("turns", "calls", "infos"):
            getattr(out, name).extend(getattr(part, name))
        for name in ("tool_errors", "parse_failures", "observation_tokens", "observations_truncated",
                     "environment_s"):
            setattr(out, name, getattr(out, name) + getattr(part, name))
    return out


def episode_sums(stats: EpisodeStats) -> list[float]:
    """This rank's sums behind ``episode_metrics`` (summed over the DP ranks by the caller), in ``SUM_KEYS`` order."""
    return [float(stats.episodes), float(sum(stats.turns)), float(sum(c > 0 for c in stats.calls)),
            float(stats.tool_calls), float(stats.tool_errors), float(stats.parse_failures),
            float(stats.observation_tokens), float(stats.observations_truncated), float(len(stats.failed))]


SUM_KEYS = ("episodes", "turns", "episodes_with_calls", "tool_calls", "tool_errors", "parse_failures",
            "observation_tokens", "observations_truncated", "failed")


def episode_metrics(sums: list[float], turns_max: float, environment_s: float) -> dict[str, float]:
    """The step's ``env/*`` metrics from the DP-summed ``episode_sums``, the longest episode's turns and the slowest
    rank's environment time."""
    s = dict(zip(SUM_KEYS, sums))
    n = max(s["episodes"], 1.0)
    return {"env/turns_mean": s["turns"] / n, "env/turns_max": turns_max,
            "env/tool_call_rate": s["episodes_with_calls"] / n, "env/tool_calls_per_episode": s["tool_calls"] / n,
            "env/tool_errors_per_episode": s["tool_errors"] / n, "env/parse_failures": s["parse_failures"],
            "env/observation_tokens_per_episode": s["observation_tokens"] / n,
            "env/observations_truncated": s["observations_truncated"], "env/failed_episodes": s["failed"],
            "env/time_s": environment_s}
