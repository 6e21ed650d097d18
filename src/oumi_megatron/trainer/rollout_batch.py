"""What the collect and score/filter phases of a GRPO step hand to the update (trainer/grpo_trainer.py).

``Scores`` are per-sample statistics of the whole rollout batch, the same on every rank (gathered over
data parallelism); ``StepBatch`` adds this rank's share of the sequences. ``choose_groups`` is DAPO's
dynamic-sampling choice over several generation rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from oumi_megatron.rollout.base import Rollout


@dataclass
class Scores:
    """Per-sample statistics of rollouts ([n] float64 / bool, on the CPU, every rank)."""

    total: torch.Tensor
    """The reward the advantages see: the weighted reward functions plus the overlong penalty (0 where invalid)."""
    valid: torch.Tensor
    """False where the reward was skipped (``on_reward_error: skip``)."""
    per_function: dict[str, torch.Tensor]
    overlong_penalty: torch.Tensor
    """What the overlong punishment added (0 when off, or invalid)."""
    lengths: torch.Tensor
    """Completion tokens."""
    finished: torch.Tensor
    """True where the completion ended with EOS (False: cut at max_completion_length)."""

    def __len__(self) -> int:
        return len(self.total)

    def take(self, index: torch.Tensor | list[int]) -> Scores:
        index = torch.as_tensor(index, dtype=torch.long)
        return Scores(self.total[index], self.valid[index], {k: v[index] for k, v in self.per_function.items()},
                      self.overlong_penalty[index], self.lengths[index], self.finished[index])

    @staticmethod
    def cat(parts: list[Scores]) -> Scores:
        return Scores(torch.cat([p.total for p in parts]), torch.cat([p.valid for p in parts]),
                      {k: torch.cat([p.per_function[k] for p in parts]) for k in parts[0].per_function},
                      torch.cat([p.overlong_penalty for p in parts]), torch.cat([p.lengths for p in parts]),
                      torch.cat([p.finished for p in parts]))


@dataclass
class StepBatch:
    """One GRPO step's training batch after scoring and filtering."""

    rollouts: list[Rollout]
    """This rank's share of the batch's sequences (contiguous: DP rank d holds samples d x n/DP onwards)."""
    scores: Scores
    """The whole batch (every DP rank's share, in rank order)."""
    filler: torch.Tensor
    """[n] bool: samples of groups placed in the batch only to fill it (dynamic sampling ran out of rounds): they are
    outside the advantage statistics and the loss."""
    group_rows: list[dict[str, Any]]
    """The dataset row of each of the batch's prompts (``num_generations`` adjacent samples each)."""
    generated: Scores
    """Everything generated this step (every round), for the reward metrics: an unfiltered sample of the policy."""
    prompts_truncated: int = 0
    prompts_used: int = 0
    rounds: int = 1
    groups_dropped: int = 0
    """Generated groups without reward variance (dynamic sampling only)."""
    groups_filled: int = 0
    """Dropped groups placed in the batch, untrained, because the rounds ran out (dynamic sampling only)."""
    reward_errors: list[str] = field(default_factory=list)
    sample: dict[str, Any] | None = None
    """This rank's first prompt, completion and reward (``grpo.log_completions``)."""
    generation_s: float = 0.0
    """This rank's time in the backend's ``generate`` (every round); the DP ranks generate at the same time."""
    decode_ms_per_step: float | None = None
    """The embedded backend's decode step time (its ``last_stats``); None for backends that do not report it."""
    episode_metrics: dict[str, float] = field(default_factory=dict)
    """The step's episode metrics over every DP rank: ``rollout/decode_steps`` and ``rollout/critical_path_tokens``,
    and the ``env/*`` ones under ``grpo.environment`` (environments/episodes.py ``episode_metrics``)."""
    profile: dict[str, float] = field(default_factory=dict)
    """This rank's collection phases, ``time/<phase>_s`` (trainer/step_profile.py)."""


def choose_groups(signal_per_round: list[torch.Tensor], wanted: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """DAPO's dynamic sampling over generation rounds: ``(kept, filler)`` as (round, group) pairs. ``kept``: the first
    ``wanted`` groups with reward variance, in generation order; ``filler``: when fewer exist, the first groups
    without it, to keep the batch's size (they are not trained on)."""
    order = [(r, g) for r, signal in enumerate(signal_per_round) for g in range(len(signal))]
    informative = [(r, g) for r, g in order if bool(signal_per_round[r][g])]
    kept = informative[:wanted]
    constant = [(r, g) for r, g in order if not bool(signal_per_round[r][g])]
    return kept, constant[: wanted - len(kept)]
