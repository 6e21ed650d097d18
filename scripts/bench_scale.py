"""GRPO at scale: a Llama-3.1-8B-shaped model, whole runs, against NeMo-RL's published throughput (issue 33).

    python scripts/bench_scale.py --model DIR --rows DIR --out DIR --gpus 8 [--paths sync,async] [--steps 4]
    python scripts/bench_scale.py ... --gpus 1 --tp 1 --layers 16 --paths sync      # what one GPU holds

The task is examples/scale_task.py's: random weights of Llama-3.1-8B's shape (``--layers`` fewer to fit fewer GPUs),
built into ``--model`` / ``--rows`` when they are missing, fixed-length completions (a random model does not stop),
a cheap reward. Throughput does not depend on what the weights know. Rows, one process tree each, one after another
(scripts/run_grpo.py under torchrun: the same trainer as ``oumi train``):
- ``sync``: configs/llama8b_grpo_8gpu.yaml, synchronous and colocated (the layout ``oumi-megatron plan --suggest``
  ranks first for 8 GPUs: TP 2 x DP 4, one vLLM engine per TP group, asleep while the trainer trains), on ``--gpus``;
- ``async``: configs/llama8b_grpo_8gpu_async.yaml, one step off policy: half the GPUs train (TP 2), the other half
  hold Ray fleet engines of one GPU each (``rollout_placement: ray``, ``ray_address: local``; needs ``ray``).

The configs' settings are NeMo-RL's Llama-3.1-8B GRPO recipe (4K tokens per sequence: 1,024 prompt + 3,072
completion at most, 32 completions per prompt, 4 optimizer steps per GRPO step). ``--prompts`` (64 there) sizes the
step to fit a device call; ``--max-new-tokens`` shortens completions for smoke tests.

Per row: tokens/s/GPU (prompt + completion tokens of the step's batch over the step time / GPUs, NeMo-RL's
definition; step 1, the warm-up, left out) against NeMo-RL's 1,581 (synchronous) and 2,478 (one step off policy)
on H100s, step time and its split, the allocator's peak on every rank against the memory plan's training peak, and
for ``async`` the trainer's idle share and the weight push against a plain NCCL broadcast over the same group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from bench_common import REPO, RowFailed, card_name, fmt, link_cell, mean_of, print_report, run_logged, run_rows, run_worker

PATHS = ("sync", "async")
CONFIGS = {"sync": REPO / "configs" / "llama8b_grpo_8gpu.yaml", "async": REPO / "configs" / "llama8b_grpo_8gpu_async.yaml"}
NEMO_RL = {"sync": 1581.0, "async": 2478.0}
"""NeMo-RL v0.5's Llama-3.1-8B GRPO tokens/s/GPU (16 x H100, 4K tokens, 64 x 32 samples per step)."""


def trainer_gpus(path: str, gpus: int) -> int:
    return gpus if path == "sync" else gpus // 2


def row_config(out: Path, args: argparse.Namespace, path: str) -> Path:
    """The row's config with this call's sizes: the step's prompts, the layers' parallelism, the trainer's GPUs."""
    raw = yaml.safe_load(CONFIGS[path].read_text())
    m, g = raw["megatron"], raw["grpo"]
    completions = args.prompts * g["num_generations"]
    raw["training"].update(max_steps=args.steps, save_steps=0, seed=42, eval_strategy="no", eval_steps=0,
                           per_device_eval_batch_size=1)
    m["global_batch_size"] = completions // g["num_mini_batches"]
    if args.tp is not None:
        m["tensor_model_parallel_size"] = args.tp
        m["sequence_parallel"] = args.tp > 1
    if args.vllm_memory is not None:
        m["vllm_gpu_memory_utilization"] = args.vllm_memory
    if path == "async":
        m["rollout_engines"] = args.gpus - trainer_gpus(path, args.gpus)
        if not args.cuda:
            m["weight_sync_method"] = "gloo"
    g["reward_functions"] = [{"name": "char_diversity"}]
    if args.max_new_tokens is not None:
        g["max_completion_length"] = args.max_new_tokens
    cfg = out / f"scale_{path}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def run_row(args: argparse.Namespace, out: Path, path: str) -> dict[str, Any]:
    gpus = trainer_gpus(path, args.gpus)
    if gpus < 1:
        raise RowFailed(f"{path} needs at least 2 GPUs (half train, half generate); --gpus is {args.gpus}")
    cfg = row_config(out, args, path)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
    flags = ["--no-eval", "--no-final-checkpoint", "--converted", str(out / f"scale_converted_tp{args.tp or 'cfg'}")]
    result, steady, columns = run_worker(out / f"scale_{path}", cfg, args, flags, launcher, args.gpus)
    raw = yaml.safe_load(cfg.read_text())
    return {
        "name": path, "card": result["card"], "gpus": args.gpus, "trainer_gpus": gpus,
        "tp": raw["megatron"].get("tensor_model_parallel_size", 1), "layers": result.get("num_layers"),
        **columns, "nemo_rl": NEMO_RL[path],
        "rollout_wait_s": mean_of(steady, "time/rollout_wait_s"),
        "wake_s": mean_of(steady, "time/wake_s"), "sleep_s": mean_of(steady, "time/sleep_s"),
        "push_s": mean_of(steady, "time/push_s"), "trainer_idle": mean_of(steady, "async/trainer_idle_fraction"),
        "sync_gbps": mean_of(steady, "weight_sync/gbps"), "raw_gbps": mean_of(steady, "weight_sync/raw_gbps"),
        "fraction_of_raw": mean_of(steady, "weight_sync/fraction_of_raw"),
        "completion_length": mean_of(steady, "completion_length/mean"), "tokens_per_step": mean_of(steady, "batch/real_tokens"),
        "peak_gib_by_rank": result.get("peak_gib_by_rank"), "plan_training_peak_gib": result.get("plan_training_peak_gib"),
        "train_seconds": result.get("train_seconds"),
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of docs/benchmarks.md: each row against NeMo-RL's published number for its mode."""
    lines = [f"| Llama-3.1-8B shape, {args.steps} steps of {args.prompts} x 32 | GPUs (trainer) | layers | TP | tokens/s/GPU "
             "| vs NeMo-RL | step s | rollout / logprobs / train s | sync / wake / sleep ms | completion tokens "
             "| peak GiB by rank (plan) | trainer idle | push GB/s (of raw) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ms = "/".join(f"{1e3 * r[k]:.0f}" if r.get(k) is not None else "-" for k in ("sync_s", "wake_s", "sleep_s"))
        peaks = ", ".join(f"{x:.1f}" for x in r["peak_gib_by_rank"] or [])
        lines.append(f"| {r['name']} | {r['gpus']} ({r['trainer_gpus']}) | {r['layers']} | {r['tp']} | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"| {r['tokens_per_s_per_gpu'] / r['nemo_rl']:.2f}x of {r['nemo_rl']:,.0f} | {r['step_s']:.1f} "
                     f"| {fmt(r.get('rollout_s'), '.1f')} / {fmt(r.get('logprob_s'), '.1f')} / {fmt(r.get('train_s'), '.1f')} "
                     f"| {ms} | {fmt(r.get('completion_length'), '.0f')} | {peaks} ({fmt(r.get('plan_training_peak_gib'), '.1f')}) "
                     f"| {fmt(r.get('trainer_idle'))} | {link_cell(r)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="HF folder; a random Llama-3.1-8B-shaped model is built there if missing")
    p.add_argument("--rows", required=True, help="folder of train.rows.jsonl; written if missing")
    p.add_argument("--out", required=True, help="work folders (checkpoints: keep them off what a device call returns)")
    p.add_argument("--results", default=None, help="where scale_result.json is rewritten after every row (default: --out)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64, help="prompts per GRPO step (x 32 completions)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="grpo.max_completion_length (default: the configs' 3072)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers of the built model (default: Llama-3.1-8B's 32)")
    p.add_argument("--tp", type=int, default=None, help="megatron.tensor_model_parallel_size (default: the configs' 2)")
    p.add_argument("--vllm-memory", type=float, default=None, help="megatron.vllm_gpu_memory_utilization (default: the configs')")
    args = p.parse_args()
    import torch

    args.cuda = torch.cuda.is_available()
    if args.cuda and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()}")
    from oumi_megatron.examples.scale_task import write_scale_rows

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(args.model) / "config.json").is_file():  # a folder already there is used as it is (smoke tests: small)
        # in a process of its own: this one must hold no GPU memory while the rows run
        layers = f", num_hidden_layers={args.layers}" if args.layers else ""
        run_logged([sys.executable, "-c", "from oumi_megatron.examples.scale_task import build_scale_model; "
                    f"build_scale_model({args.model!r}, shape='llama-3.1-8b'{layers})"], out / "scale_model.log")
    if not (Path(args.rows) / "train.rows.jsonl").is_file():
        write_scale_rows(args.rows)
    results = Path(args.results or args.out)
    rows, failed = run_rows(args.paths, PATHS, lambda path: run_row(args, out, path), results / "scale_result.json")
    print_report(f"{args.gpus} x {card_name()}, `python scripts/bench_scale.py {' '.join(sys.argv[1:])}`", table(rows, args), failed)


if __name__ == "__main__":
    main()
