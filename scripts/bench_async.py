"""Asynchronous GRPO against the best synchronous use of the same 2 GPUs, the real task, one call (issue 32).

    python scripts/bench_async.py --model HF_DIR --rows ROWS_DIR --steps 120 --out DIR [--paths sync_dp2,sync_separate,async]

The real task: configs/smollm2_arithmetic_gpu.yaml's model (SmolLM2-135M-Instruct), rows and reward (Oumi's gsm8k), at its
settings (16 prompts x 8 completions per GRPO step in two optimizer steps, temperature 0.7, 128 new tokens, lr 1e-5
constant, no KL, bf16), held-out evaluation (both sets) at step 0 and at the last step. Rows, one process tree each, one
after another (scripts/run_grpo.py: the same trainer as ``oumi train``):
- ``sync_dp2``: the synchronous loop, data-parallel over both GPUs (torchrun, 2 ranks), each with a colocated vLLM
  engine that stays resident (``vllm_sleep: false``, KV cache sized to the step's rollouts): issue 31's fastest
  synchronous setting, on both GPUs;
- ``sync_separate``: 1 trainer GPU + 1 engine GPU (``rollout_placement: separate``, NCCL pushes), ``max_staleness: 0``:
  the same placement as ``async`` without the overlap;
- ``async``: the same, ``max_staleness: 1``, ``off_policy_correction: tis`` (one step off policy).

Per row: tokens/s/GPU over both GPUs (prompt + completion tokens of the step's batch over the step time / 2, NeMo-RL's
definition; step 1 left out), step time, the trainer's idle share, the weight push's bandwidth against a plain
broadcast over the same GPUs (``weight_sync/fraction_of_raw``), held-out accuracy at the last step (both sets), and
reward at the first and last 10 steps. On CPU (``--prompts/--generations/--max-new-tokens`` shrink the run) the pushes
go over gloo: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from bench_common import (
    REAL_CONFIG,
    card_name,
    fmt,
    link_cell,
    mean_of,
    print_report,
    real_max_prompt_length,
    rollout_kv_cache_gib,
    run_rows,
    run_worker,
)

PATHS = ("sync_dp2", "sync_separate", "async")
GPUS = 2


def row_config(out: Path, args: argparse.Namespace, path: str, cuda: bool) -> Path:
    """configs/smollm2_arithmetic_gpu.yaml for one row, written as async_PATH.yaml."""
    raw = yaml.safe_load(REAL_CONFIG.read_text())
    completions = args.prompts * args.generations
    dp = GPUS if path == "sync_dp2" else 1
    raw["training"].update(max_steps=args.steps, save_steps=0, eval_steps=args.steps)  # evaluations at 0 and the end
    raw["megatron"].update(inference_backend="vllm", global_batch_size=completions // 2,
                           micro_batch_size=max(completions // 4, 1))  # 2 optimizer steps; DP=2: one microbatch each
    raw["grpo"].update(num_generations=args.generations, max_completion_length=args.max_new_tokens)
    if path == "sync_dp2":
        max_len = real_max_prompt_length() + args.max_new_tokens
        kv = rollout_kv_cache_gib(args.model, completions // dp, max_len) if cuda else 0.0
        raw["megatron"].update(rollout_placement="colocated", vllm_sleep=False, vllm_kv_cache_gib=kv)
    else:
        # the engine has its GPU to itself: most of it for its KV cache
        raw["megatron"].update(rollout_placement="separate", weight_sync_method="nccl" if cuda else "gloo",
                               vllm_gpu_memory_utilization=0.85)
        raw["grpo"]["max_staleness"] = 1 if path == "async" else 0
        if path == "async":
            raw["grpo"]["off_policy_correction"] = "tis"
    cfg = out / f"async_{path}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def run_row(args: argparse.Namespace, out: Path, path: str, cuda: bool) -> dict[str, Any]:
    cfg = row_config(out, args, path, cuda)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(GPUS)] if path == "sync_dp2" else None
    result, steady, columns = run_worker(out / f"async_{path}", cfg, args,
                                         ["--no-export-eval", "--converted", str(out / "async_converted")], launcher, GPUS)
    last_eval = result["eval_curve"][-1] if result.get("eval_curve") else {}
    first_eval = result["eval_curve"][0] if result.get("eval_curve") else {}
    return {
        "name": path, "card": result["card"], "gpus": GPUS, **columns,
        "rollout_wait_s": mean_of(steady, "time/rollout_wait_s"), "push_s": mean_of(steady, "time/push_s"),
        "trainer_idle": mean_of(steady, "async/trainer_idle_fraction"),
        "engine_idle": mean_of(steady, "async/engine_idle_fraction"),
        "staleness_max": max((t.get("rollout/staleness_max") or 0.0) for t in result["train"]),
        "sync_gbps": mean_of(steady, "weight_sync/gbps"), "raw_gbps": mean_of(steady, "weight_sync/raw_gbps"),
        "fraction_of_raw": mean_of(steady, "weight_sync/fraction_of_raw"),
        "eval_step": last_eval.get("step"), "eval_accuracy": last_eval.get("eval/accuracy"),
        "eval_unseen_accuracy": last_eval.get("eval_unseen/accuracy"), "eval_accuracy_base": first_eval.get("eval/accuracy"),
        "train_seconds": result.get("train_seconds"),
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of docs/benchmarks.md, each row's tokens/s/GPU against ``sync_dp2``'s."""
    base = next((r["tokens_per_s_per_gpu"] for r in rows if r["name"] == "sync_dp2"), None)
    lines = [f"| real task, {args.steps} steps of {args.prompts} x {args.generations}, {args.max_new_tokens} new tokens, 2 GPUs "
             "| tokens/s/GPU | vs sync DP=2 | step s | trainer idle | rollout wait s | push ms | sync GB/s (of raw) "
             "| staleness max | eval acc (seen / unseen) at last step | reward first 10 -> last 10 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['tokens_per_s_per_gpu'] / base:.2f}x" if base else "-"
        push = f"{1e3 * r['push_s']:.0f}" if r.get("push_s") is not None else "-"
        acc = (f"{r['eval_accuracy']:.3f} / {r['eval_unseen_accuracy']:.3f}" if r.get("eval_accuracy") is not None else "-")
        lines.append(f"| {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} | {ratio} | {r['step_s']:.3f} | {fmt(r.get('trainer_idle'))} "
                     f"| {fmt(r.get('rollout_wait_s'), '.3f')} | {push} | {link_cell(r)} | {r['staleness_max']:.0f} | {acc} "
                     f"| {r['reward_first10']:.3f} -> {r['reward_last10']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", required=True, help="work folders (checkpoints: keep them off what a device call returns)")
    p.add_argument("--results", default=None, help="where async_result.json is rewritten after every row (default: --out)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < GPUS:
        raise SystemExit(f"bench_async needs {GPUS} GPUs; this machine has {torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results or args.out)
    rows, failed = run_rows(args.paths, PATHS, lambda path: run_row(args, out, path, cuda), results / "async_result.json")
    print_report(f"{GPUS} x {card_name()}, `python scripts/bench_async.py {' '.join(sys.argv[1:])}`", table(rows, args), failed)


if __name__ == "__main__":
    main()
