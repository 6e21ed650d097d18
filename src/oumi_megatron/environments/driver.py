"""The one way a run gets samples: every rollout is an episode (slime's one ``Sample`` path, verl's AgentLoop).

A single-turn rollout is an episode of one turn with no environment; under ``grpo.environment`` an episode takes turns
until the environment ends it (environments/episodes.py). ``RolloutDriver`` is built once per run (assembly.py) and
handed to the trainer's collector (training rounds, dynamic sampling's rounds, asynchronous GRPO's submissions) and to
the evaluators; none of them asks whether an environment is set: the driver's result is the same shape either way
(the samples grouped per prompt, and their ``EpisodeStats``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from oumi_megatron.environments.episodes import EpisodeStats, run_episodes, single_generation_stats
from oumi_megatron.environments.registry import environment_runner
from oumi_megatron.environments.runner import EnvironmentRunner
from oumi_megatron.rollout.base import AsyncEpisodeBackend, AsyncRolloutBackend, DecodeProfile, Rollout, RolloutBackend
from oumi_megatron.rollout.sampling import SamplingParams


class RolloutDriver:
    """Episodes of ``grpo``'s shape (``max_turns``, observation and turn limits) on ``backend``; ``environment``: the
    runner of ``grpo.environment`` for this rank's replica (None: single-turn)."""

    def __init__(self, backend: RolloutBackend, tokenizer: Any, grpo: Any, environment: EnvironmentRunner | None) -> None:
        self.backend, self.tokenizer, self.grpo, self.environment = backend, tokenizer, grpo, environment
        self._worker: tuple[Any, EnvironmentRunner | None] | None = None
        """Asynchronous episodes: the tokenizer and environment their thread uses (``submit``)."""

    @property
    def system_prompt(self) -> str | None:
        """The environment's instructions to the model, put first in every prompt (None: none)."""
        return self.environment.system_prompt if self.environment is not None else None

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None

    def run(self, prompts: list[list[int]], rows: list[dict[str, Any]], params: SamplingParams, n: int,
            seed: int | None = None) -> tuple[list[list[Rollout]], EpisodeStats]:
        """``n`` episodes of each of ``prompts`` (``rows[i]``: prompt i's dataset row), grouped per prompt. Collective
        over the model replica."""
        return self._episodes(self.backend, self.tokenizer, self.environment, prompts, rows, params, n, seed)

    def _episodes(self, engine: Any, tokenizer: Any, environment: EnvironmentRunner | None, prompts: list[list[int]],
                  rows: list[dict[str, Any]], params: SamplingParams, n: int,
                  seed: int | None) -> tuple[list[list[Rollout]], EpisodeStats]:
        g = self.grpo
        return run_episodes(engine, tokenizer, environment, prompts, rows, params, n, g.max_turns, g.max_observation_tokens,
                            seed=seed, max_turn_tokens=g.max_turn_tokens)

    # -- asynchronous GRPO: a step's episodes submitted ahead, collected when the trainer gets to them ------------------
    def submit(self, backend: AsyncRolloutBackend, prompts: list[list[int]], rows: list[dict[str, Any]],
               params: SamplingParams, n: int, seed: int | None = None) -> None:
        """Queue the episodes of ``prompts`` on ``backend`` and return at once; ``collected`` reads them. Single-turn
        ones are one generation of the engine; multi-turn ones a job on the engine owner's episode thread
        (``AsyncEpisodeBackend``), with its own tokenizer and environment (a fast tokenizer is not safe to share across
        threads while it encodes, and the main thread evaluates meanwhile)."""
        if self.environment is None:
            backend.submit(prompts, params, n)
            return
        assert isinstance(backend, AsyncEpisodeBackend), "validation refuses asynchronous episodes on this backend"
        if self._worker is None:
            self._worker = (copy.deepcopy(self.tokenizer), environment_runner(self.grpo))
        tokenizer, environment = self._worker
        job = functools.partial(self._episodes, tokenizer=tokenizer, environment=environment, prompts=prompts, rows=rows,
                                params=params, n=n, seed=seed)
        backend.submit_episodes(prompts, job)

    def collected(self, tagged: Any) -> tuple[list[list[Rollout]], EpisodeStats]:
        """A collected submission (``AsyncRolloutBackend.collect``) as ``run``'s result."""
        if tagged.episodes is not None:
            return tagged.rollouts, tagged.episodes
        return tagged.rollouts, single_generation_stats(tagged.rollouts)

    def decode_profile(self) -> DecodeProfile:
        return self.backend.decode_profile()

    def close(self) -> None:
        self.backend.close()
