"""``Sample``: one sample of a GRPO step, the same record from the rollout driver to the microbatches (slime's one
``Sample``).

The driver (environments/driver.py) makes one per episode, with its tokens, the engine's logprobs, the policy version
of each token and how the episode ended; scoring (trainer/collection.py, trainer/scoring.py) fills its rewards; the
advantage phase (trainer/grpo_trainer.py) its advantage and whether it is trained on; the batch builder
(trainer/batches.py) packs it into the engine's microbatches; rollout dumps (trainer/rollout_dump.py) write it as a JSON
line. A sample is found by what it is (its group, its round), never by its place in a parallel list.

A backend's ``generate`` still returns ``Rollout``s (rollout/base.py): one generation of an engine, which the driver's
episodes read turn by turn.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(enum.StrEnum):
    """How a sample's episode ended."""

    FINISHED = "finished"
    """Its last turn ended with the end-of-turn token the policy sampled."""
    TRUNCATED = "truncated"
    """Cut: at ``max_completion_length`` (the episode's budget), at ``max_turns`` with a turn still to answer, or at a
    stop token the environment did not answer."""
    FAILED = "failed"
    """Its environment raised or timed out (``failure`` says why): out of the loss and the group statistics."""


@dataclass
class Sample:
    """One sample: an episode of a prompt (single-turn: one turn, no environment), then its scores, its advantage."""

    # -- from the driver: what the policy generated -----------------------------------------------------------------
    prompt_ids: list[int]
    completion_ids: list[int]
    """The policy's sampled ids of every turn and, between turns, the environment's observations."""
    group: int
    """The prompt it came from: its row among the batch's rows (the same on every data-parallel rank). A GRPO group is
    the ``num_generations`` samples of one group."""
    status: SampleStatus = SampleStatus.FINISHED
    logprobs: list[float] | None = None
    """The behaviour policy's (the engine's) log p(token) of each completion token under softmax(logits / T) (full
    vocabulary; before top-p), 0.0 on observation tokens; None where the engine returned none."""
    loss_mask: list[int] | None = None
    """Per completion token, 1 where the policy sampled it and 0 where an environment's observation put it. None: every
    completion token is the policy's (single-turn)."""
    versions: list[int] = field(default_factory=list)
    """Per completion token, the policy version (optimizer steps taken) of the weights that generated it (observation
    tokens: that of the turn they follow)."""
    failure: str | None = None
    """Why the environment failed (``status`` FAILED)."""
    turns: int = 1
    """The policy's turns in the episode."""
    tool_calls: int = 0
    """The turns that called a tool."""
    env_info: dict[str, Any] | None = None
    """The ``EpisodeEnd.info`` that ended the episode (``{}``: it ended otherwise), which the reward functions read as
    ``env_info``; None where no environment took part."""
    round: int = 0
    """The generation round of its step (dynamic sampling's; 0: the step's first)."""

    # -- from scoring ----------------------------------------------------------------------------------------------
    reward: float | None = None
    """The weighted sum of the reward functions; None where the reward was skipped (``grpo.on_reward_error: skip``), the
    episode failed or it is not scored yet."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Each reward function's value (and the per-sample metrics the functions declare, ``<name>/<metric>``)."""
    overlong_penalty: float = 0.0
    """What DAPO's overlong punishment adds to ``reward`` (``grpo.overlong_buffer_length``; 0 when off or not scored)."""

    # -- from the advantage phase ----------------------------------------------------------------------------------
    advantage: float = 0.0
    """Its advantage, on each of its policy tokens in the loss."""
    trainable: bool = False
    """Whether the loss trains on it (False: kept in the batch, no token trained on: a skipped reward, a filler group,
    a truncated completion under ``grpo.mask_truncated_completions``)."""

    @property
    def finished(self) -> bool:
        return self.status is SampleStatus.FINISHED

    @property
    def failed(self) -> bool:
        return self.status is SampleStatus.FAILED

    @property
    def valid(self) -> bool:
        """Scored: it has a reward (a skipped reward or a failed episode has none)."""
        return self.reward is not None

    @property
    def score(self) -> float:
        """What the advantages see: the reward plus the overlong penalty; 0 where there is no reward."""
        return self.reward + self.overlong_penalty if self.reward is not None else 0.0

    @property
    def token_ids(self) -> list[int]:
        """Prompt and completion: the sequence the trainer runs."""
        return self.prompt_ids + self.completion_ids

    @property
    def length(self) -> int:
        """Prompt and completion tokens."""
        return len(self.prompt_ids) + len(self.completion_ids)

    def stamp(self, version: int) -> None:
        """Every completion token generated by policy ``version`` (the weights of a whole generation)."""
        self.versions = [version] * len(self.completion_ids)

    def check(self) -> None:
        """Raises ValueError where a per-token field does not cover the completion (``versions`` may be empty: not
        stamped yet), or the status and the failure disagree."""
        n = len(self.completion_ids)
        for name, value in (("logprobs", self.logprobs), ("loss_mask", self.loss_mask), ("versions", self.versions or None)):
            if value is not None and len(value) != n:
                raise ValueError(f"a sample's {name} has {len(value)} entries for {n} completion tokens")
        if self.failed != (self.failure is not None):
            raise ValueError(f"a {self.status.value} sample with failure {self.failure!r}")
