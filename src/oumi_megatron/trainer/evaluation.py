"""Held-out evaluation: greedy completions of the eval prompts, scored with the training rewards.

Used by the trainer (``training.eval_strategy`` / ``eval_steps``: at step 0, every ``eval_steps`` and at
the end, as TRL and verl users expect) and by ``oumi-megatron eval`` (any HF folder: the base model, an
exported ``hf_model``), so both print the same numbers for the same weights.

Metrics (``eval/`` prefix in metrics.jsonl, TensorBoard and the plots; each eval set its own prefix, from
``grpo.eval_metric_prefixes``, e.g. ``eval_unseen/accuracy``):
- ``eval/reward_mean``: mean weighted reward over the scored eval prompts (for Oumi's ``gsm8k`` reward,
  the accuracy: 1 for the right number after "####", else 0); ``eval/reward/<name>`` per function;
- ``eval/accuracy`` and ``eval/format_rate`` (when a ``gsm8k`` reward is used): the fraction of prompts
  whose completion has the right number after "####" (Oumi's gsm8k reward with its default arguments,
  so it stays an accuracy when training shapes the reward, e.g. ``format_score: 0.1``), and of those with
  an answer in gsm8k's format, "#### N", right or wrong (it separates "learned the format" from
  "learned the arithmetic");
- ``eval/completion_length/mean`` (tokens) and ``eval/truncated_fraction`` (cut at max_completion_length);
- ``eval/samples`` and ``eval/time_s``;
- with ``grpo.environment``: each prompt is one greedy episode (environments/episodes.py) scored as in training, and
  ``eval/tool_call_rate`` (episodes that called a tool) and ``eval/turns_mean``; an episode whose environment failed
  counts as wrong.

Each data-parallel replica generates its share of the prompts (``training.per_device_eval_batch_size``
per generate call); the sums are reduced over DP, so every rank returns the same numbers.
"""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.data import prompt_token_ids
from oumi_megatron.engine.parallel.distributed import data_parallel
from oumi_megatron.environments.episodes import EpisodeStats, run_episodes
from oumi_megatron.environments.runner import EnvironmentRunner
from oumi_megatron.rollout.base import RolloutBackend
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.trainer.scoring import ReplicaScorer
from oumi_megatron.utils.options import option_value

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
"""The answer format Oumi's (verl's) strict gsm8k reward extracts."""


def _count_correct(gsm8k: Any, completions: list[str], rows: list[dict[str, Any]]) -> int:
    return sum(_gsm8k_correct(gsm8k, c, r) for c, r in zip(completions, rows))


def _gsm8k_correct(gsm8k: Any, completion: str, row: dict[str, Any]) -> bool:
    """Oumi's gsm8k reward ``gsm8k`` with its defaults (strict format, 1 for the right answer) says right."""
    truth = (row.get("reward_model") or {}).get("ground_truth")
    return truth is not None and gsm8k("gsm8k", completion, str(truth), row.get("extra_info")) == 1.0


class Evaluator:
    """Greedy generation on ``rows`` (Oumi GRPO dataset rows) with ``backend``; rewards as in training."""

    def __init__(self, rows: Any, tokenizer: Any, rewards: ReplicaScorer, backend: RolloutBackend, grpo: Any,
                 batch_size: int, device: torch.device, prefix: str = "eval",
                 environment: EnvironmentRunner | None = None) -> None:
        self.rows = rows
        self.environment = environment
        self.max_turns, self.max_observation_tokens = grpo.max_turns, grpo.max_observation_tokens
        self.max_turn_tokens = grpo.max_turn_tokens
        self.prefix = prefix
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.backend = backend
        self.max_prompt_length = grpo.max_prompt_length
        self.batch_size = max(1, int(batch_size))
        self.device = device
        # the gsm8k reward function itself (Oumi's, or the one the trainer was given under that name)
        self.gsm8k = next((fn for name, _, _, fn in rewards.specs if name == "gsm8k"), None)
        self.check_format = self.gsm8k is not None
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # greedy: the model's best answer, the number a user compares; same length limit as training
        self.sampling = SamplingParams(temperature=1.0, max_new_tokens=grpo.max_completion_length,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, greedy=True)

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        """Collective over all ranks. Returns the ``<prefix>/`` metrics (the same on every rank)."""
        started = time.perf_counter()
        dp, dp_rank, group = data_parallel()
        mine = list(range(dp_rank, len(self.rows), dp))
        # Every DP replica generates as many prompts in as many calls: under expert parallelism its expert
        # peers (other replicas) pair with each of its forwards. A short share is filled with copies of a row,
        # generated and not scored.
        share, real = -(-len(self.rows) // dp), len(mine)
        mine += [mine[0] if mine else 0] * (share - real)
        names = [name for name, *_ in self.rewards.specs]
        # scored, reward, format, length, truncated, n, correct, episodes with a tool call, turns, per function
        sums = torch.zeros(9 + len(names), dtype=torch.float64)
        for start in range(0, share, self.batch_size):
            rows = [self.rows[i] for i in mine[start:start + self.batch_size]]
            system = self.environment.system_prompt if self.environment is not None else None
            prompts = [prompt_token_ids(self.tokenizer, r["prompt"], self.max_prompt_length, system)[0] for r in rows]
            keep = max(0, min(len(rows), real - start))
            grouped, episodes = self._generate(prompts, rows)
            rows, rollouts = rows[:keep], [group[0] for group in grouped][:keep]
            completions = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
            texts = [self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in rollouts]
            scored_rows = rows if episodes is None else episodes.reward_rows(rows)
            # collective (trainer/scoring.py): every rank, every batch, an empty share too; scored on one rank a replica
            scored = self.rewards(texts, completions, scored_rows)
            if episodes is not None:  # a failed episode is scored as wrong
                for k in episodes.failed:
                    if k < len(rows):
                        scored.valid[k], scored.total[k] = True, 0.0
                        for values in scored.per_function.values():
                            values[k] = 0.0
                        completions[k] = ""
            correct = self.rewards.once(partial(_count_correct, self.gsm8k, completions, rows),
                                        "the gsm8k accuracy check") if self.check_format else 0
            if not rows:
                continue
            valid = scored.valid
            sums[0] += float(valid.sum())
            sums[1] += float(scored.total[valid].sum())
            sums[2] += sum(bool(GSM8K_ANSWER.search(c)) for c in completions)
            sums[3] += sum(len(r.completion_ids) for r in rollouts)
            sums[4] += sum(not r.finished for r in rollouts)
            sums[5] += len(rows)
            sums[6] += correct
            if episodes is not None:
                sums[7] += sum(c > 0 for c in episodes.calls[:keep])
                sums[8] += sum(episodes.turns[:keep])
            for j, name in enumerate(names):
                sums[9 + j] += float(scored.per_function[name][valid].sum())
        if dp > 1:
            total = sums.to(self.device)
            dist.all_reduce(total, group=group)
            sums = total.cpu()
        scored_n, n = max(float(sums[0]), 1.0), max(float(sums[5]), 1.0)
        metrics = {
            "reward_mean": float(sums[1]) / scored_n,
            **{f"reward/{name}": float(sums[9 + j]) / scored_n for j, name in enumerate(names)},
            **({"accuracy": float(sums[6]) / n, "format_rate": float(sums[2]) / n} if self.check_format else {}),
            "completion_length/mean": float(sums[3]) / n,
            "truncated_fraction": float(sums[4]) / n,
            **({"tool_call_rate": float(sums[7]) / n, "turns_mean": float(sums[8]) / n} if self.environment else {}),
            "samples": int(sums[5]),
            "time_s": time.perf_counter() - started,
        }
        return {f"{self.prefix}/{k}": v for k, v in metrics.items()}

    def _generate(self, prompts: list[list[int]], rows: list[dict[str, Any]]) -> tuple[list[list[Any]], EpisodeStats | None]:
        """One greedy completion per prompt, or one greedy episode under ``grpo.environment``."""
        if self.environment is None:
            return self.backend.generate(prompts, self.sampling, 1), None
        return run_episodes(self.backend, self.tokenizer, self.environment, prompts, rows, self.sampling, 1,
                            self.max_turns, self.max_observation_tokens, max_turn_tokens=self.max_turn_tokens)

    def summary(self, metrics: dict[str, Any]) -> str:
        """One log line of this set's numbers in ``metrics``."""
        m = {k.removeprefix(f"{self.prefix}/"): v for k, v in metrics.items() if k.startswith(f"{self.prefix}/")}
        fmt = f", accuracy {m['accuracy']:.3f}, format {m['format_rate']:.3f}" if "accuracy" in m else ""
        return (f"{self.prefix}: reward {m['reward_mean']:.3f}{fmt} on {m['samples']} prompts, mean length "
                f"{m['completion_length/mean']:.1f} tokens ({m['time_s']:.1f} s)")


def build_evaluators(eval_sets: Any, tokenizer: Any, rewards: ReplicaScorer, backend: RolloutBackend, grpo: Any,
                     batch_size: int, device: torch.device, environment: EnvironmentRunner | None = None) -> list[Evaluator]:
    """One ``Evaluator`` per eval set: ``eval_sets`` is ``{metric prefix: rows}`` (data.load_eval_sets), or rows
    alone (one set, ``eval``)."""
    if not isinstance(eval_sets, dict):
        eval_sets = {"eval": eval_sets}
    return [Evaluator(rows, tokenizer, rewards, backend, grpo, batch_size, device, prefix=prefix, environment=environment)
            for prefix, rows in eval_sets.items()]


def eval_schedule(training: Any, max_steps: int, steps_per_epoch: int) -> set[int]:
    """The GRPO steps after which to evaluate (0 = before training), from Oumi's ``eval_strategy`` /
    ``eval_steps``: ``steps`` every eval_steps (an int, or a fraction of max_steps as in HF/TRL),
    ``epoch`` every epoch; both at step 0 and at the end. ``no``: never."""
    strategy = option_value(training.eval_strategy, "no")
    # YAML 1.1 reads an unquoted `no` as false (Oumi then keeps the string "False"): the user meant "no"
    if strategy in ("no", "False", "false"):
        return set()
    if strategy == "epoch":
        every = max(1, steps_per_epoch)
    else:
        every = training.eval_steps
        every = max(1, int(-(-every * max_steps // 1))) if isinstance(every, float) and every < 1 else max(1, int(every))
    return {0, *range(every, max_steps, every), max_steps}
