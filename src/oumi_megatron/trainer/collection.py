"""Rollout collection: the collect and score/filter phases of a GRPO step (``RolloutCollector.collect``).

- Data order: a permutation of the dataset seeded by ``training.seed``, walked from ``data_position``, which
  the checkpoint keeps, so a resumed run reads the prompts the uninterrupted one would have read.
- A generation round: the next ``prompts_per_rollout`` prompts, rendered with the tokenizer's chat template and
  left-truncated to ``grpo.max_prompt_length``. Each data-parallel rank generates its share of their
  ``num_generations`` completions: the backend receives distinct prompts and how many completions each, so
  an engine that samples n per prompt (vLLM) shares the prompt's prefill. The replica's first rank scores its share
  with the reward functions (trainer/scoring.py: once per sample); the round's scores are gathered over DP, so group
  advantages see whole groups.
- Every sample is an episode (environments/driver.py): one turn without an environment; under ``grpo.environment``
  the policy's turns and the environment's observations, the rewards reading the whole episode's text and the info
  its end gave (``env_info``); an episode whose environment failed is out of the loss and the group statistics.
- Dynamic sampling (DAPO, ``grpo.dynamic_sampling``): groups whose rewards are all equal carry no signal;
  they are dropped and further rounds refill the batch (up to ``dynamic_sampling_max_rounds``; groups without
  signal fill what is left, untrained).

Every draw is a function of (seed, step, DP rank, round), so a resumed run samples what the uninterrupted run
sampled, and DP ranks sample differently.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.data import prompt_token_ids
from oumi_megatron.environments.driver import FinishedGroup, RolloutDriver
from oumi_megatron.environments.episodes import EpisodeStats, episode_maxima, episode_metrics, episode_sums, merge_stats
from oumi_megatron.grpo.algorithm import groups_with_signal, overlong_penalty
from oumi_megatron.rollout.base import AsyncRolloutBackend, StreamingEpisodeBackend
from oumi_megatron.rollout.sample import Sample, SampleStatus
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.trainer.dp import dp_size_and_rank, exchange_objects_dp, max_dp_values, sum_dp
from oumi_megatron.trainer.rollout_batch import BatchScores, StepBatch, choose_groups
from oumi_megatron.trainer.rollout_dump import RolloutDump
from oumi_megatron.trainer.scoring import ReplicaScorer
from oumi_megatron.trainer.step_profile import StepProfile
from oumi_megatron.utils.ranks import global_rank

if TYPE_CHECKING:
    from oumi_megatron.config.grpo_params import MegatronGrpoParams

logger = logging.getLogger("oumi")


@dataclass
class PendingRound:
    """A round whose prompts are read and whose generation is asked for: what scoring it needs."""

    step: int
    rows: list[dict[str, Any]]
    prompts: list[list[int]]
    """The distinct prompts this rank asked for (token ids), ``n`` completions each."""
    groups: list[int]
    """Which of ``rows`` each prompt is."""
    n: int
    truncated: int
    seed: int
    data_position: int
    """The data position before its prompts were read: where a resumed run reads them again."""
    round: int = 0
    """Dynamic sampling's generation round (0: the step's first)."""
    positions: list[int] = field(default_factory=list)
    """Each row's data position (``grpo.streaming_groups``: its group's key)."""
    cut: list[bool] = field(default_factory=list)
    """Each row's prompt was longer than ``grpo.max_prompt_length``."""


@dataclass
class StreamedGroup:
    """A group in the stream (``grpo.streaming_groups``): its key (its row's data position), prompt ids, row, whether
    its prompt was cut, and how many times it was generated."""

    key: int
    prompt: list[int]
    row: dict[str, Any]
    cut: bool
    attempts: int = 1


@dataclass
class _Round:
    """One round of generation: its prompts' rows (every rank), this rank's samples (scored), the round's scores over
    every rank."""

    rows: list[dict[str, Any]]
    samples: list[Sample]
    scores: BatchScores
    truncated: int
    errors: list[str]
    sample: dict[str, Any] | None
    episodes: EpisodeStats
    generation_s: float = 0.0
    decode_ms_per_step: float | None = None


def _reward_or_zero(sample: Sample) -> float:
    return sample.reward if sample.reward is not None else 0.0


def share_as_groups(first: int, count: int, group_size: int) -> tuple[list[int], int]:
    """A DP rank's samples ``first .. first + count - 1`` (sample i is a completion of prompt i // group_size)
    as generate's groups: the prompt index of each group, and the completions per group. Whole GRPO groups
    when the share holds whole groups; a share that splits groups (more DP ranks than prompts, or shares
    that are no multiple of a group) in the largest equal runs that stay within one prompt."""
    n = math.gcd(group_size, count)  # shares start at multiples of count, groups at multiples of group_size
    return [i // group_size for i in range(first, first + count, n)], n


class RolloutCollector:
    """Walks the dataset, generates and scores rollouts, and applies dynamic sampling; the trainer owns one.

    ``seed``: ``training.seed`` (data order and rollout seeds). ``device``: where DP collectives run."""

    def __init__(self, dataset: Any, tokenizer: Any, driver: RolloutDriver, rewards: ReplicaScorer,
                 grpo: MegatronGrpoParams, sampling: SamplingParams, prompts_per_rollout: int, seed: int,
                 device: torch.device, dump: RolloutDump | None = None) -> None:
        """``dump``: where every ``grpo.rollout_dump_steps``-th step's samples are written (None: nowhere)."""
        self.dataset = dataset
        self.dump = dump
        self.tokenizer = tokenizer
        self.driver = driver
        self.rewards = rewards
        self.grpo = grpo
        self.sampling = sampling
        self.prompts_per_rollout = prompts_per_rollout
        self.seed = seed
        self.device = device
        self.logged_episode = False
        self.last_collation_bytes = 0
        """Bytes this rank received when dynamic sampling last redistributed the filtered batch over DP."""
        self.order = list(range(len(dataset)))
        random.Random(seed).shuffle(self.order)
        self.data_position = 0
        """Prompts read so far (checkpointed)."""
        self.skip_positions: set[int] = set()
        """Positions ahead of ``data_position`` whose prompts were trained on already (``grpo.streaming_groups`` trains
        groups out of order; a resumed run passes over them)."""
        self.warned_truncation = False
        self.profile = StepProfile()
        """The phases of this step's collection (trainer/step_profile.py): a new one for each ``collect``, and for each
        step of the asynchronous loop (its submissions, then its batch's scoring)."""

    def collect(self, step: int) -> StepBatch:
        """The batch of GRPO step ``step + 1``: one round of generation; under ``grpo.dynamic_sampling``, rounds
        until the batch is full of groups whose rewards differ (or ``dynamic_sampling_max_rounds`` ran out: the
        rest is filler, not trained on)."""
        self.profile = StepProfile()
        rounds = [self._generate_round(step, 0)]
        if self.grpo.dynamic_sampling:
            chosen = self._dynamic_sampling(step, rounds)
        else:
            first = rounds[0]
            chosen = {"samples": first.samples, "scores": first.scores, "group_rows": first.rows,
                      "filler": torch.zeros(len(first.scores), dtype=torch.bool)}
        self._write_dump(step)
        return StepBatch(**chosen, generated=BatchScores.cat([r.scores for r in rounds]),
                         prompts_truncated=sum(r.truncated for r in rounds),
                         prompts_used=sum(len(r.rows) for r in rounds), rounds=len(rounds),
                         reward_errors=[e for r in rounds for e in r.errors][:5], sample=rounds[0].sample,
                         generation_s=sum(r.generation_s for r in rounds),
                         decode_ms_per_step=rounds[-1].decode_ms_per_step, episode_metrics=self._episode_metrics(rounds),
                         profile=self.profile.metrics())

    def _episode_metrics(self, rounds: list[_Round]) -> dict[str, float]:
        """The step's ``rollout/*`` and (multi-turn) ``env/*`` episode metrics over every DP rank (collective)."""
        stats = merge_stats([r.episodes for r in rounds])
        samples = [s for r in rounds for s in r.samples]
        return episode_metrics(sum_dp(episode_sums(samples, stats), self.device),
                               max_dp_values(episode_maxima(samples, stats), self.device), stats.multi_turn)

    def _write_dump(self, step: int) -> None:
        if self.dump is not None:
            self.dump.write(step, dp_size_and_rank()[1])

    # -- data order -------------------------------------------------------------------------------------------------
    def _next_rows(self, n: int) -> tuple[list[dict[str, Any]], list[int]]:
        """The next ``n`` rows of the data order and their positions (passing over ``skip_positions``)."""
        rows: list[dict[str, Any]] = []
        positions: list[int] = []
        while len(rows) < n:
            if self.data_position in self.skip_positions:
                self.skip_positions.discard(self.data_position)
            else:
                rows.append(self.dataset[self.order[self.data_position % len(self.order)]])
                positions.append(self.data_position)
            self.data_position += 1
        return rows, positions

    def _note_truncation(self, lengths: list[int], cut: int) -> None:
        """Cutting a prompt's start can drop the question; say so (once) instead of training on it silently."""
        if cut and not self.warned_truncation and global_rank() == 0:
            self.warned_truncation = True
            logger.warning(f"{cut} of {len(lengths)} prompts this step are longer than grpo.max_prompt_length "
                           f"({self.grpo.max_prompt_length} tokens; longest {max(lengths)}) and lose their beginning. "
                           "Raise grpo.max_prompt_length (metric prompt/truncated_fraction counts them every step).")

    def rollout_seed(self, step: int, dp_rank: int, round_index: int = 0) -> int:
        """Sampling seed of one step (and dynamic-sampling round) on one DP rank: a function of (seed, step, rank,
        round), so a resumed run draws what the uninterrupted one drew, and DP ranks draw different samples."""
        key = f"{self.seed}/{step}/{dp_rank}" + (f"/{round_index}" if round_index else "")
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")

    # -- one round --------------------------------------------------------------------------------------------------
    def _generate_round(self, step: int, index: int) -> _Round:
        """The next ``prompts_per_rollout`` prompts: this rank's share of their completions, scored; the round's
        scores gathered over DP (sample i belongs to prompt i // num_generations)."""
        pending = self._prepare_round(step, index)
        before = self.driver.decode_profile()
        started = time.perf_counter()
        samples, episodes = self.driver.run(pending.prompts, [pending.rows[p] for p in pending.groups], self.sampling,
                                            pending.n, pending.seed, groups=pending.groups, version=step)
        generation_s = time.perf_counter() - started
        self.profile.add("generate", generation_s)
        after = self.driver.decode_profile()
        for key, seconds in after.seconds.items():  # the embedded decoder's loops (step_profile.py)
            self.profile.add(key, seconds - before.seconds.get(key, 0.0))
        return self._score_round(pending, samples, episodes, generation_s, after.decode_ms_per_step)

    def _prepare_round(self, step: int, index: int) -> PendingRound:
        """A round's prompts (read from the data order), rendered, and this rank's share of their completions."""
        g, G = self.grpo, self.grpo.num_generations
        dp, dp_rank = dp_size_and_rank()
        position = self.data_position
        system = self.driver.system_prompt
        with self.profile.phase("prompts"):
            rows, positions = self._next_rows(self.prompts_per_rollout)
            rendered = [prompt_token_ids(self.tokenizer, r["prompt"], g.max_prompt_length, system) for r in rows]
        full_lengths = [n for _, n in rendered]
        cut = [n > g.max_prompt_length for n in full_lengths]
        self._note_truncation(full_lengths, sum(cut))
        per_rank = len(rows) * G // dp
        groups, n = share_as_groups(dp_rank * per_rank, per_rank, G)
        return PendingRound(step, rows, [rendered[p][0] for p in groups], groups, n, sum(cut),
                            self.rollout_seed(step, dp_rank, index), position, index, positions, cut)

    def _score_round(self, pending: PendingRound, samples: list[Sample], episodes: EpisodeStats,
                     generation_s: float, decode_ms_per_step: float | None) -> _Round:
        """The round's samples scored (their rewards and overlong penalty filled), dumped, and the round's scores
        gathered over DP."""
        with self.profile.phase("detokenize"):  # each distinct prompt once: a group's completions share it
            completions = self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
            texts = dict(zip(pending.groups, self.tokenizer.batch_decode(pending.prompts, skip_special_tokens=True)))
            prompts = [texts[s.group] for s in samples]
        for s in samples:
            s.round = pending.round
        with self.profile.phase("reward"):
            rewards = self.rewards.score(samples, prompts, completions, pending.rows)
        self._drop_failed_episodes(pending.step, samples, prompts)
        self._overlong_penalty(samples)
        if self.dump is not None:
            self.dump.add(pending.step, self.tokenizer, samples)
        logged = {"prompt": prompts[0], "completion": completions[0], "reward": _reward_or_zero(samples[0])} if samples else None
        if logged is not None and episodes.transcript:
            logged["episode"] = episodes.transcript
            self._log_episode(pending.step, prompts[0], episodes.transcript, logged["reward"])
        with self.profile.phase("score_gather"):
            scores = BatchScores.gather(samples, list(rewards.per_function), self.device)
        return _Round(pending.rows, samples, scores, pending.truncated, rewards.errors, logged, episodes, generation_s,
                      decode_ms_per_step)

    def _overlong_penalty(self, samples: list[Sample]) -> None:
        """DAPO's overlong punishment (``grpo.overlong_buffer_length``) on each scored sample."""
        g = self.grpo
        scored = [s for s in samples if s.valid]
        if not g.overlong_buffer_length or not scored:
            return
        lengths = torch.tensor([float(len(s.completion_ids)) for s in scored], dtype=torch.float64)
        penalties = overlong_penalty(lengths, g.max_completion_length, g.overlong_buffer_length, g.overlong_penalty_factor)
        for s, penalty in zip(scored, penalties.tolist(), strict=True):
            s.overlong_penalty = penalty

    def _drop_failed_episodes(self, step: int, samples: list[Sample], prompts: list[str]) -> None:
        """Episodes whose environment raised or timed out: no reward (out of the loss and the group statistics, as a
        skipped reward is), each named in the log with its prompt by the replica's first rank; the run goes on."""
        failed = [(k, s) for k, s in enumerate(samples) if s.status is SampleStatus.FAILED]
        for _, s in failed:
            s.reward = None
        if not self.rewards.is_scorer:
            return
        for k, s in failed[:5]:
            logger.warning(f"GRPO step {step + 1}, rank {global_rank()}: the environment failed in episode {k} "
                           f"(prompt {prompts[k][-120:]!r}): {s.failure}. The episode is left out of the loss.")

    def _log_episode(self, step: int, prompt: str, turns: list[dict[str, Any]], reward: float) -> None:
        """One episode with its turns, in the log at the first step (every step under ``grpo.log_completions``)."""
        if global_rank() != 0 or (self.logged_episode and not self.grpo.log_completions):
            return
        self.logged_episode = True
        lines = [f"  {kind}: {text!r}" for part in turns for kind, text in part.items()]
        logger.info("GRPO step %d, a sample episode (reward %.3f) of prompt %r:\n%s", step + 1, reward, prompt[-200:],
                    "\n".join(lines) or "  (no turn answered)")

    # -- asynchronous GRPO: a step's generation submitted ahead, collected when the trainer gets to it -----------------
    def submit(self, step: int, backend: AsyncRolloutBackend) -> PendingRound:
        """Read GRPO step ``step + 1``'s prompts and queue their episodes on ``backend`` (no waiting)."""
        pending = self._prepare_round(step, 0)
        self.driver.submit(backend, pending.prompts, [pending.rows[p] for p in pending.groups], self.sampling, pending.n,
                           pending.seed, groups=pending.groups)
        return pending

    def finish(self, pending: PendingRound, backend: AsyncRolloutBackend) -> tuple[StepBatch, int, float]:
        """``pending``'s generation (waiting for it), scored: the step's batch, the policy version that generated it,
        and the engine's seconds on it."""
        started = time.perf_counter()
        samples, episodes, tagged = self.driver.collect(backend)
        batch = self._scored_batch(pending, samples, episodes, time.perf_counter() - started, tagged.engine_seconds)
        return batch, tagged.version, tagged.engine_seconds

    def _scored_batch(self, pending: PendingRound, samples: list[Sample], episodes: EpisodeStats, wait_s: float,
                      engine_seconds: float) -> StepBatch:
        """An asynchronous step's batch: ``pending``'s samples scored (``wait_s``: the wait for them), dumped."""
        r = self._score_round(pending, samples, episodes, wait_s, None)
        self._write_dump(pending.step)
        return StepBatch(samples=r.samples, scores=r.scores, group_rows=r.rows,
                         filler=torch.zeros(len(r.scores), dtype=torch.bool), generated=r.scores,
                         prompts_truncated=r.truncated, prompts_used=len(r.rows), rounds=1,
                         reward_errors=r.errors[:5], sample=r.sample, generation_s=engine_seconds,
                         episode_metrics=self._episode_metrics([r]), profile=self.profile.metrics())

    # -- grpo.streaming_groups: groups submitted to one stream, a step's batch made of the first that finish ------------
    def submit_groups(self, step: int, backend: StreamingEpisodeBackend) -> list[StreamedGroup]:
        """Read GRPO step ``step + 1``'s prompts and let this rank's groups join the stream (no waiting); the groups."""
        pending = self._prepare_round(step, 0)
        assert pending.n == self.grpo.num_generations, "streaming groups: each DP rank generates whole groups"
        mine = [StreamedGroup(pending.positions[p], pending.prompts[i], pending.rows[p], pending.cut[p])
                for i, p in enumerate(pending.groups)]
        self.resubmit(backend, mine)
        return mine

    def resubmit(self, backend: StreamingEpisodeBackend, groups: list[StreamedGroup]) -> None:
        """``groups`` join the stream (again: fresh episodes)."""
        self.driver.submit_groups(backend, [g.prompt for g in groups], [g.row for g in groups], [g.key for g in groups],
                                  self.sampling, self.grpo.num_generations)

    def groups_batch(self, step: int, finished: list[tuple[FinishedGroup, StreamedGroup]], wait_s: float) -> StepBatch:
        """GRPO step ``step + 1``'s batch from the groups the stream finished (each group's samples adjacent, in the
        order they finished), scored."""
        samples: list[Sample] = []
        for j, (done, _) in enumerate(finished):
            for sample in done.samples:
                sample.group = j
            samples += done.samples
        groups = [g for _, g in finished]
        pending = PendingRound(step, [g.row for g in groups], [g.prompt for g in groups], list(range(len(groups))),
                               self.grpo.num_generations, sum(g.cut for g in groups), 0, -1)
        stats = merge_stats([d.stats for d, _ in finished])
        stats.critical_path_tokens = max((d.stats.critical_path_tokens for d, _ in finished), default=0)  # side by side
        return self._scored_batch(pending, samples, stats, wait_s, sum(d.engine_seconds for d, _ in finished))

    # -- dynamic sampling -------------------------------------------------------------------------------------------
    def _dynamic_sampling(self, step: int, rounds: list[_Round]) -> dict[str, Any]:
        """DAPO: further rounds (appended to ``rounds``) until ``prompts_per_rollout`` groups have reward variance;
        the chosen groups' samples redistributed over DP (this rank's share), their scores, rows and filler mask."""
        g, G, wanted = self.grpo, self.grpo.num_generations, self.prompts_per_rollout
        signals = [groups_with_signal(rounds[0].scores.total, rounds[0].scores.valid, G)]
        while sum(int(s.sum()) for s in signals) < wanted and len(rounds) < g.dynamic_sampling_max_rounds:
            rounds.append(self._generate_round(step, len(rounds)))
            signals.append(groups_with_signal(rounds[-1].scores.total, rounds[-1].scores.valid, G))
        kept, filled = choose_groups(signals, wanted)
        chosen = kept + filled
        mine = self._redistribute([r.samples for r in rounds], [(r, i) for r, grp in chosen for i in range(grp * G, (grp + 1) * G)])
        if filled and global_rank() == 0:
            logger.warning(f"GRPO step {step + 1}: dynamic sampling found {len(kept)} of {wanted} groups with "
                           f"reward variance in {len(rounds)} rounds (grpo.dynamic_sampling_max_rounds); "
                           f"{len(filled)} groups without it fill the batch and are not trained on.")
        return {
            "samples": mine,
            "scores": BatchScores.cat([rounds[r].scores.take(list(range(grp * G, (grp + 1) * G))) for r, grp in chosen]),
            "group_rows": [rounds[r].rows[grp] for r, grp in chosen],
            "filler": torch.tensor([False] * len(kept) + [True] * len(filled)).repeat_interleave(G),
            "groups_dropped": sum(len(s) - int(s.sum()) for s in signals),
            "groups_filled": len(filled),
        }

    def _redistribute(self, local: list[list[Sample]], chosen: list[tuple[int, int]]) -> list[Sample]:
        """This rank's share of the filtered batch: ``chosen`` lists (round, sample) in batch order, and DP rank k
        trains on the k-th slice. Sample i of a round lives on DP rank i // (its share of the round), so each rank
        sends every other rank just the samples of that rank's slice it holds, and receives only its own slice (bytes
        per rank O(its share), not the whole batch)."""
        dp, dp_rank = dp_size_and_rank()
        per_rank = len(chosen) // dp
        outgoing: list[list[tuple[int, Sample]]] = [[] for _ in range(dp)]
        for position, (r, i) in enumerate(chosen):
            owner, at = divmod(i, len(local[r]))
            if owner == dp_rank:
                outgoing[position // per_rank].append((position, local[r][at]))
        incoming, self.last_collation_bytes = exchange_objects_dp(outgoing, self.device)
        return [sample for _, sample in sorted((pair for part in incoming for pair in part), key=lambda p: p[0])]
