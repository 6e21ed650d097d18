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
- ``eval/pass@1`` (with a reward that declares a ``passed`` metric, as ``code_tests`` does): the fraction of prompts
  whose completion passed every test; ``oumi-megatron eval --samples N`` samples N completions per prompt at
  ``grpo.temperature`` instead of one greedy one and reports ``pass@k`` for k in 1, 5, 10, ... up to N (the unbiased
  estimator of Chen et al. 2021, HumanEval's own);
- ``eval/samples`` (prompts) and ``eval/time_s``;
- each prompt is one greedy episode (environments/driver.py), scored as in training: one turn without an environment;
  with ``grpo.environment`` also ``eval/tool_call_rate`` (episodes that called a tool) and ``eval/turns_mean``, and an
  episode whose environment failed counts as wrong.

Each data-parallel replica generates its share of the prompts (``training.per_device_eval_batch_size``
per generate call); the sums are reduced over DP, so every rank returns the same numbers.
"""

from __future__ import annotations

import math
import re
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.data import prompt_token_ids
from oumi_megatron.engine.parallel.distributed import data_parallel
from oumi_megatron.environments.driver import RolloutDriver
from oumi_megatron.environments.episodes import EVAL_SUMS, eval_metrics, eval_sums
from oumi_megatron.rollout.sampling import sampling_for
from oumi_megatron.trainer.scoring import ReplicaScorer
from oumi_megatron.utils.options import option_value

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
PASS_AT_K = (1, 5, 10, 20, 50, 100)
"""The k of the pass@k an evaluation with samples reports (those up to its samples per prompt)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` of ``n`` samples, ``c`` of which passed, passes: 1 - C(n-c, k) / C(n, k),
    the unbiased estimator of Chen et al. (2021), HumanEval's."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
"""The answer format Oumi's (verl's) strict gsm8k reward extracts."""


def _count_correct(gsm8k: Any, completions: list[str], rows: list[dict[str, Any]]) -> int:
    return sum(_gsm8k_correct(gsm8k, c, r) for c, r in zip(completions, rows))


def _gsm8k_correct(gsm8k: Any, completion: str, row: dict[str, Any]) -> bool:
    """Oumi's gsm8k reward ``gsm8k`` with its defaults (strict format, 1 for the right answer) says right."""
    truth = (row.get("reward_model") or {}).get("ground_truth")
    return truth is not None and gsm8k("gsm8k", completion, str(truth), row.get("extra_info")) == 1.0


class Evaluator:
    """Greedy episodes of ``rows`` (Oumi GRPO dataset rows) through ``driver``; rewards as in training."""

    def __init__(self, rows: Any, tokenizer: Any, rewards: ReplicaScorer, driver: RolloutDriver, grpo: Any,
                 batch_size: int, device: torch.device, prefix: str = "eval", samples: int = 1) -> None:
        """``samples``: completions per prompt; 1 is greedy, more are sampled at ``grpo.temperature`` (pass@k)."""
        self.rows = rows
        self.prefix = prefix
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.driver = driver
        self.max_prompt_length = grpo.max_prompt_length
        self.batch_size = max(1, int(batch_size))
        self.device = device
        # the gsm8k reward function itself (Oumi's, or the one the trainer was given under that name)
        self.gsm8k = next((fn for name, _, _, fn in rewards.specs if name == "gsm8k"), None)
        self.check_format = self.gsm8k is not None
        # greedy: the model's best answer, the number a user compares; same length limit as training
        self.samples = max(1, int(samples))
        self.sampling = sampling_for(grpo, tokenizer, greedy=self.samples == 1)
        # a reward that says whether every test passed (code_tests' ``passed``): pass@k over the samples of a prompt
        self.passed = next((c for c in rewards.columns if c.endswith("/passed")), None)
        self.pass_ks = [k for k in PASS_AT_K if k <= self.samples] if self.passed else []

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
        names, n = self.rewards.columns, self.samples
        # prompts, completions, scored, reward, format, length, truncated, correct, per column, pass@k, the episodes'
        sums = torch.zeros(8 + len(names) + len(self.pass_ks) + EVAL_SUMS, dtype=torch.float64)
        at_k = 8 + len(names)
        for start in range(0, share, self.batch_size):
            rows = [self.rows[i] for i in mine[start:start + self.batch_size]]
            prompts = [prompt_token_ids(self.tokenizer, r["prompt"], self.max_prompt_length, self.driver.system_prompt)[0]
                       for r in rows]
            keep = max(0, min(len(rows), real - start))
            generated, episodes = self.driver.run(prompts, rows, self.sampling, n, seed=None if n == 1 else start)
            samples = [s for s in generated if s.group < keep]  # the copies that filled a short share are not scored
            completions = [self.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
            texts = [self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True) for s in samples]
            # collective (trainer/scoring.py): every rank, every batch, an empty share too; scored on one rank a replica
            scored = self.rewards.score(samples, texts, completions, rows)
            for k, sample in enumerate(samples):
                if sample.failed:  # a failed episode is scored as wrong
                    scored.valid[k], scored.total[k] = True, 0.0
                    for values in scored.per_function.values():
                        values[k] = 0.0
                    completions[k] = ""
            sample_rows = [rows[s.group] for s in samples]
            correct = self.rewards.once(partial(_count_correct, self.gsm8k, completions, sample_rows),
                                        "the gsm8k accuracy check") if self.check_format else 0
            if not samples:
                continue
            valid = scored.valid
            sums[0] += keep
            sums[1] += len(samples)
            sums[2] += float(valid.sum())
            sums[3] += float(scored.total[valid].sum())
            sums[4] += sum(bool(GSM8K_ANSWER.search(c)) for c in completions)
            sums[5] += sum(len(s.completion_ids) for s in samples)
            sums[6] += sum(not s.finished for s in samples)
            sums[7] += correct
            for j, name in enumerate(names):
                sums[8 + j] += float(scored.per_function[name][valid].sum())
            if self.passed:
                passed = (scored.per_function[self.passed] * valid).view(keep, n).sum(dim=1).tolist()
                for j, k in enumerate(self.pass_ks):
                    sums[at_k + j] += sum(pass_at_k(n, int(c), k) for c in passed)
            sums[at_k + len(self.pass_ks):] += torch.tensor(eval_sums(samples, episodes), dtype=torch.float64)
        if dp > 1:
            total = sums.to(self.device)
            dist.all_reduce(total, group=group)
            sums = total.cpu()
        prompts_n, completions_n, scored_n = max(float(sums[0]), 1.0), max(float(sums[1]), 1.0), max(float(sums[2]), 1.0)
        metrics = {
            "reward_mean": float(sums[3]) / scored_n,
            **{f"reward/{name}": float(sums[8 + j]) / scored_n for j, name in enumerate(names)},
            **({"accuracy": float(sums[7]) / completions_n, "format_rate": float(sums[4]) / completions_n}
               if self.check_format else {}),
            **{f"pass@{k}": float(sums[at_k + j]) / prompts_n for j, k in enumerate(self.pass_ks)},
            "completion_length/mean": float(sums[5]) / completions_n,
            "truncated_fraction": float(sums[6]) / completions_n,
            **eval_metrics(sums[at_k + len(self.pass_ks):].tolist(), completions_n, self.driver.multi_turn),
            "samples": int(sums[0]),
            **({"completions": int(sums[1])} if n > 1 else {}),
            "time_s": time.perf_counter() - started,
        }
        return {f"{self.prefix}/{k}": v for k, v in metrics.items()}

    def summary(self, metrics: dict[str, Any]) -> str:
        """One log line of this set's numbers in ``metrics``."""
        m = {k.removeprefix(f"{self.prefix}/"): v for k, v in metrics.items() if k.startswith(f"{self.prefix}/")}
        fmt = f", accuracy {m['accuracy']:.3f}, format {m['format_rate']:.3f}" if "accuracy" in m else ""
        return (f"{self.prefix}: reward {m['reward_mean']:.3f}{fmt} on {m['samples']} prompts, mean length "
                f"{m['completion_length/mean']:.1f} tokens ({m['time_s']:.1f} s)")


def build_evaluators(eval_sets: Any, tokenizer: Any, rewards: ReplicaScorer, driver: RolloutDriver, grpo: Any,
                     batch_size: int, device: torch.device, samples: int = 1) -> list[Evaluator]:
    """One ``Evaluator`` per eval set: ``eval_sets`` is ``{metric prefix: rows}`` (data.load_eval_sets), or rows
    alone (one set, ``eval``); ``samples`` completions per prompt (1: greedy)."""
    if not isinstance(eval_sets, dict):
        eval_sets = {"eval": eval_sets}
    return [Evaluator(rows, tokenizer, rewards, driver, grpo, batch_size, device, prefix=prefix, samples=samples)
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


def check_evaluation(config: Any, found: Findings) -> None:
    """``training.eval_strategy``'s fields, and ``grpo.eval_metric_prefixes`` against the validation datasets."""
    t = config.training
    strategy = option_value(t.eval_strategy, "no")
    if strategy == "steps" and not (isinstance(t.eval_steps, (int, float)) and t.eval_steps > 0):
        found.add("training.eval_steps", f"must be > 0 with eval_strategy 'steps' (GRPO steps between evaluations, or a "
                                         f"fraction of max_steps below 1), got {t.eval_steps!r}.")
    if strategy != "no" and t.per_device_eval_batch_size < 1:
        found.add("training.per_device_eval_batch_size", f"must be >= 1 (eval prompts per generate call), got "
                                                         f"{t.per_device_eval_batch_size!r}.")
    prefixes = list(config.grpo.eval_metric_prefixes)
    if not prefixes:
        return
    datasets = len(config.data.validation.datasets)
    if len(prefixes) != datasets:
        found.add("grpo.eval_metric_prefixes", f"has {len(prefixes)} entries and data.validation.datasets has {datasets}: "
                                               "give one prefix per validation dataset, in order "
                                               "(e.g. eval for the first, eval_unseen for the second).")
    for i, prefix in enumerate(prefixes):
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
            found.add(f"grpo.eval_metric_prefixes[{i}]", f"{prefix!r} is not a metric prefix: use letters, digits and _ "
                                                         "(e.g. eval_unseen), starting with a letter.")
