"""TRL's GRPOTrainer on the settings of configs/smollm2_arithmetic_gpu.yaml: the TRL rows of issue 31's comparison.

    python scripts/bench_grpo_trl.py --model HF_DIR --rows ROWS_DIR --steps 20 --out trl.json [--vllm]

Groundwork for ``scripts/bench_grpo.py`` (issue 31, in progress): the same model, rows (Oumi's gsm8k-transformed
rows, scripts/prepare_gpu_real_model.py), reward (Oumi's ``gsm8k`` with ``format_score`` 0.1), 16 prompts x 8
completions per GRPO step in two optimizer steps of 64, temperature 0.7, 128 new tokens, lr 1e-5 constant, no KL,
token-mean loss (TRL's ``dapo``), group-scaled advantages, no gradient checkpointing (ours runs without recompute),
bf16 on CUDA. TRL counts optimizer steps, so ``max_steps`` is 2 x ``--steps``. ``--vllm``: TRL's
``use_vllm=True, vllm_mode="colocate"`` with TRL's default ``vllm_enable_sleep_mode=False`` (``--vllm-sleep`` turns
it on; with vLLM 0.26 TRL then generates from the base model, see below).

Per GRPO step: wall time, the time in TRL's generate-and-score, prompt + completion tokens processed (TRL's
``num_tokens``), reward, mean completion length; peak memory; written to ``--out``. ``--task scale``: the
random-weight Qwen2.5-1.5B-shaped model of examples/scale_task.py and its cheap reward.
The model loads in fp32 and trains under bf16 autocast (TRL's default: mixed precision, as this project's fp32 main
weights); colocated vLLM gets this project's memory fraction (0.4) and maximum length (max prompt length + new tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import bench_common


def load_rows(rows_dir: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Oumi's gsm8k rows as TRL dataset rows: the chat prompt and the reward's columns."""
    out = []
    for line in (rows_dir / "train.rows.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append({"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                        "data_source": r["data_source"]})
    return out[:limit] if limit else out


def gsm8k_reward_for_trl(rows_dir: Path, format_score: float) -> Any:
    """Oumi's gsm8k reward (its own source, as scripts/run_grpo.py loads it) in TRL's signature."""
    from run_grpo import oumi_gsm8k_reward

    score = oumi_gsm8k_reward(rows_dir / "oumi_gsm8k_reward.py")

    def gsm8k(prompts: list, completions: list, ground_truth: list[str], data_source: list[str], **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score(d, t, g, None, format_score=format_score)) for d, t, g in zip(data_source, texts, ground_truth)]

    return gsm8k


def scale_reward() -> Any:
    """The scale task's cheap reward (examples/scale_task.py), the same function this project's run scores with."""
    from oumi_megatron.examples.scale_task import char_diversity

    return char_diversity


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--steps", type=int, default=20, help="GRPO steps (16 prompts x 8 completions each)")
    p.add_argument("--out", required=True)
    p.add_argument("--vllm", action="store_true", help="TRL's colocated vLLM rollouts")
    p.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--task", default="real", choices=("real", "scale"),
                   help="real: Oumi's gsm8k reward; scale: the random-weight model's cheap reward (examples/scale_task.py)")
    p.add_argument("--max-prompt-length", type=int, default=256, help="the config's grpo.max_prompt_length: with "
                   "--max-new-tokens, colocated vLLM's maximum length, as this project's engine has it")
    p.add_argument("--vllm-sleep", action="store_true", help="TRL's vllm_enable_sleep_mode (off by default: see the "
                   "GRPOConfig below for why its rollouts then come from the base model)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.4, help="this project's default, for parity")
    p.add_argument("--micro-batch", type=int, default=None, help="per_device_train_batch_size (default prompts x "
                   "generations / 4: two micro-batches per optimizer step); must divide the optimizer step's half")
    args = p.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows_dir = Path(args.rows)
    completions = args.prompts * args.generations
    micro = args.micro_batch or completions // 4  # 32: two micro-batches per optimizer step of 64
    if (completions // 2) % micro:
        raise SystemExit(f"--micro-batch {micro} does not divide the optimizer step's {completions // 2} completions")
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "_trl_run",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // 2 // micro,
        steps_per_generation=completions // micro,  # one generation of 128 completions feeds two optimizer steps
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=0.7,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=2 * args.steps,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=42,
        use_vllm=args.vllm,
        vllm_mode="colocate",
        # TRL's default (off). With sleep mode on, TRL 1.6's generate() wakes the engine and calls vLLM's
        # reload_weights() with no path (a workaround for vllm#29341), which in vLLM 0.26 reloads the model's files
        # from disk over the weights sync_weights() just loaded: every rollout then comes from the base model (the
        # real task's reward stayed at 0.010 over 20 steps, docs/benchmarks.md) and each step pays a reload.
        vllm_enable_sleep_mode=args.vllm_sleep and cuda,  # vLLM has no sleep mode on CPU
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_max_model_length=args.max_prompt_length + args.max_new_tokens,
    )
    dataset = Dataset.from_list(load_rows(rows_dir, limit=args.prompts * (args.steps + 1)))
    reward = gsm8k_reward_for_trl(rows_dir, 0.1) if args.task == "real" else scale_reward()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset)

    # generation time: TRL's own generate-and-score, timed around the bound method
    generation_s: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        generation_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]

    generation_logs: list[dict[str, float]] = []
    step_ends: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "reward" in logs:  # once per generation (GRPO step): its reward, cumulative num_tokens, lengths
                generation_logs.append(dict(logs))

    trainer.add_callback(Record())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    # per GRPO step = two optimizer steps
    ends = [started, *step_ends]
    step_s = [ends[i + 2] - ends[i] for i in range(0, len(ends) - 2, 2)]
    seen = [0.0] + [float(g["num_tokens"]) for g in generation_logs]
    tokens = [b - a for a, b in zip(seen, seen[1:])]  # prompt + completion tokens of each GRPO step
    rewards = [float(g["reward"]) for g in generation_logs]
    steady = slice(1, None) if len(step_s) > 1 else slice(None)  # step 1 warms up (compilation, allocator)
    result = {
        "name": "trl_vllm_colocate" if args.vllm else "trl_hf_generate",
        "card": bench_common.card_name(),
        "date": time.strftime("%Y-%m-%d"),
        "trl": __import__("trl").__version__,
        "grpo_steps": len(step_s),
        "step_s": step_s,
        "generation_s": generation_s,
        "tokens": tokens,
        "tokens_per_s_per_gpu": sum(tokens[steady]) / sum(step_s[steady]),
        "reward": rewards,
        "completion_length": [float(g.get("completions/mean_length", float("nan"))) for g in generation_logs],
        "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
        "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "settings": {k: getattr(config, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                       "steps_per_generation", "num_generations", "max_completion_length",
                                                       "temperature", "loss_type", "scale_rewards", "learning_rate",
                                                       "use_vllm", "vllm_mode", "gradient_checkpointing")},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("step_s", "generation_s", "tokens", "reward", "completion_length")}, indent=1))


if __name__ == "__main__":
    main()
