"""Rewards scored once: each sample by exactly one rank, the first rank of its model replica.

The ranks of a replica (TP x PP x CP ranks that share a data-parallel rank) hold the same completions, so scoring on
every one of them would call each reward function TP x PP x CP times per sample (16x at 70B on TP 8 x PP 2; a remote
judge would get 16x the requests). The replica's first rank scores; the scores reach the others in one broadcast of
objects over the replica's gloo group (a few floats per sample); the DP gather that follows is unchanged.

A reward that raises (``grpo.on_reward_error: raise``) raises on the scoring rank only, and the others would wait in
the broadcast, and the other replicas in the DP gather: so every rank learns of the first failure anywhere in the
world (``first_failure``, one small object per rank) and raises the same error, naming the reward function, the
sample and the exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from oumi_megatron.engine.parallel.distributed import replica_group
from oumi_megatron.grpo.rewards import RewardComputer, RewardFunctionError, RewardResult
from oumi_megatron.rollout.sample import Sample
from oumi_megatron.utils.ranks import first_failure

T = TypeVar("T")


class ReplicaScorer:
    """``RewardComputer`` called on one rank per replica. Collective over the world (build it on every rank, in the
    same order as the other groups)."""

    def __init__(self, rewards: RewardComputer) -> None:
        self.rewards = rewards
        self.specs = rewards.specs
        self.columns = rewards.columns
        self.group: Any
        self.ranks: list[int]
        self.group, self.ranks = replica_group() if dist.is_initialized() else (None, [0])
        self.is_scorer = not dist.is_initialized() or dist.get_rank() == self.ranks[0]
        self.samples_scored = 0
        """Samples this rank scored (the counting tests: their sum over ranks is the samples generated)."""

    def once(self, fn: Callable[[], T], what: str) -> T:
        """Collective over the world: ``fn()`` on the replica's scoring rank, its result on every rank of the replica;
        a failure anywhere raises the same ``RewardFunctionError`` on every rank."""
        box: list[Any] = [None]
        problem = None
        if self.is_scorer:
            try:
                box[0] = fn()
            except RewardFunctionError as e:
                problem = str(e)
            except Exception as e:  # noqa: BLE001 - anything else the scoring raised stops every rank the same way
                problem = f"{what} raised {type(e).__name__}: {e}"
        problem = first_failure(problem)
        if problem is not None:
            raise RewardFunctionError(problem)
        if len(self.ranks) > 1:
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]) -> RewardResult:
        """The weighted rewards of each sample, scored once; an empty share (evaluation's last batch on some ranks)
        calls no function but is still collective."""
        result = self.once(lambda: self.rewards(prompts, completions, rows) if completions else self._empty(),
                           "reward scoring")
        if self.is_scorer:
            self.samples_scored += len(completions)
        return result

    def score(self, samples: list[Sample], prompts: list[str], completions: list[str],
              rows: list[dict[str, Any]]) -> RewardResult:
        """``samples`` scored (collective, as a call): ``prompts`` and ``completions`` are their texts, ``rows`` the
        batch's dataset rows (a sample's is ``rows[sample.group]``; the reward functions also see its ``env_info`` where
        an environment took part). Fills each sample's ``reward`` (None where skipped) and ``rewards``; returns the
        result (its ``errors`` name the skipped ones)."""
        result = self(prompts, completions, [reward_row(rows[s.group], s) for s in samples])
        columns = {name: values.tolist() for name, values in result.per_function.items()}
        for k, (sample, total, valid) in enumerate(zip(samples, result.total.tolist(), result.valid.tolist(), strict=True)):
            sample.reward = total if valid else None
            sample.rewards = {name: values[k] for name, values in columns.items()}
        return result

    def _empty(self) -> RewardResult:
        return RewardResult(total=torch.zeros(0, dtype=torch.float64), valid=torch.ones(0, dtype=torch.bool),
                            per_function={name: torch.zeros(0, dtype=torch.float64) for name in self.columns})


def reward_row(row: dict[str, Any], sample: Sample) -> dict[str, Any]:
    """What the reward functions see of ``sample``'s dataset ``row``: the row, and how its episode ended (``env_info``)
    where an environment took part."""
    return row if sample.env_info is None else {**row, "env_info": sample.env_info}
