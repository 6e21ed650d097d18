"""What the collect and score/filter phases of a GRPO step hand to the update (trainer/grpo_trainer.py).

``StepBatch``: this rank's ``Sample``s of the step (rollout/sample.py), scored, and what the step's metrics report
about its rounds. ``BatchScores``: the scores of every data-parallel rank's samples, gathered (the same on every rank),
for what needs whole groups (advantages, dynamic sampling's choice) or the whole batch (the reward metrics): a view of
the samples' scores, not a second copy of the samples. ``choose_groups`` is DAPO's dynamic-sampling choice over several
generation rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from oumi_megatron.rollout.sample import Sample
from oumi_megatron.trainer.dp import dp_size_and_rank, gather_dp


@dataclass
class BatchScores:
    """The scores of every DP rank's samples, in rank order ([n] float64 / bool, on the CPU, every rank): DP rank d's
    samples are rows d x share onwards, as the DP gather places them."""

    total: torch.Tensor
    """What the advantages see (``Sample.score``): the weighted reward functions plus the overlong penalty, 0 where
    there is no reward."""
    valid: torch.Tensor
    """False where the reward was skipped (``on_reward_error: skip``) or the episode failed."""
    per_function: dict[str, torch.Tensor]
    overlong_penalty: torch.Tensor
    """What the overlong punishment added (0 when off, or invalid)."""
    lengths: torch.Tensor
    """Completion tokens."""
    finished: torch.Tensor
    """True where the completion ended with EOS (False: cut at max_completion_length, or failed)."""

    @staticmethod
    def gather(samples: list[Sample], names: list[str], device: torch.device) -> BatchScores:
        """Collective over DP: every rank's ``samples``' scores (``names``: the reward columns, the same on every
        rank)."""
        local = torch.tensor([[s.score, float(s.valid), *(s.rewards[k] for k in names), float(len(s.completion_ids)),
                               float(s.finished), s.overlong_penalty] for s in samples],
                             dtype=torch.float64).view(len(samples), len(names) + 5)
        rows = gather_dp(local, device)
        return BatchScores(rows[:, 0], rows[:, 1] > 0.5, {k: rows[:, 2 + j] for j, k in enumerate(names)}, rows[:, -1],
                           rows[:, -3], rows[:, -2] > 0.5)

    def __len__(self) -> int:
        return len(self.total)

    def take(self, index: torch.Tensor | list[int]) -> BatchScores:
        index = torch.as_tensor(index, dtype=torch.long)
        return BatchScores(self.total[index], self.valid[index], {k: v[index] for k, v in self.per_function.items()},
                           self.overlong_penalty[index], self.lengths[index], self.finished[index])

    @staticmethod
    def cat(parts: list[BatchScores]) -> BatchScores:
        return BatchScores(torch.cat([p.total for p in parts]), torch.cat([p.valid for p in parts]),
                           {k: torch.cat([p.per_function[k] for p in parts]) for k in parts[0].per_function},
                           torch.cat([p.overlong_penalty for p in parts]), torch.cat([p.lengths for p in parts]),
                           torch.cat([p.finished for p in parts]))


@dataclass
class StepBatch:
    """One GRPO step's training batch after scoring and filtering."""

    samples: list[Sample]
    """This rank's share of the batch (DP rank d holds samples d x share onwards), scored."""
    scores: BatchScores
    """The whole batch's scores (every DP rank's share, in rank order)."""
    filler: torch.Tensor
    """[n] bool: samples of groups placed in the batch only to fill it (dynamic sampling ran out of rounds): they are
    outside the advantage statistics and the loss."""
    group_rows: list[dict[str, Any]]
    """The dataset row of each of the batch's prompts (``num_generations`` adjacent samples each)."""
    generated: BatchScores
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

    def set_advantages(self, advantages: torch.Tensor, trainable: torch.Tensor) -> None:
        """Each of this rank's samples gets its own of the whole batch's ``advantages`` and ``trainable`` ([n], in
        ``scores``' order: this rank's share starts at DP rank x its length)."""
        first = dp_size_and_rank()[1] * len(self.samples)
        mine = slice(first, first + len(self.samples))
        for sample, advantage, trains in zip(self.samples, advantages[mine].tolist(), trainable[mine].tolist(), strict=True):
            sample.advantage, sample.trainable = advantage, trains


def choose_groups(signal_per_round: list[torch.Tensor], wanted: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """DAPO's dynamic sampling over generation rounds: ``(kept, filler)`` as (round, group) pairs. ``kept``: the first
    ``wanted`` groups with reward variance, in generation order; ``filler``: when fewer exist, the first groups
    without it, to keep the batch's size (they are not trained on)."""
    order = [(r, g) for r, signal in enumerate(signal_per_round) for g in range(len(signal))]
    informative = [(r, g) for r, g in order if bool(signal_per_round[r][g])]
    kept = informative[:wanted]
    constant = [(r, g) for r, g in order if not bool(signal_per_round[r][g])]
    return kept, constant[: wanted - len(kept)]
