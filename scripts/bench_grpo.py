"""Whole GRPO runs, this project against TRL, same task and settings, one GPU, one call (issue 31).

    python scripts/bench_grpo.py --model HF_DIR --rows ROWS_DIR --steps 20 --out DIR [--paths embedded,vllm,trl,trl_vllm]
    python scripts/bench_grpo.py --task scale --model DIR --rows DIR --out DIR   # builds the model and rows if missing

Tasks:
- ``real``: configs/smollm2_arithmetic_gpu.yaml's model (SmolLM2-135M-Instruct), rows and reward (Oumi's gsm8k);
- ``scale``: a random-weight Qwen2.5-1.5B-shaped model with fixed-length completions and a cheap reward
  (examples/scale_task.py), built into ``--model`` / ``--rows`` when they are missing.

Rows (each in its own process, one after another), all at the real task's settings (16 prompts x 8 completions per
GRPO step in two optimizer steps of 64, temperature 0.7, 128 new tokens, lr 1e-5 constant, no KL, bf16):
- ``embedded``: this project with the embedded backend (scripts/run_grpo.py --no-eval: the same
  trainer as ``oumi train``); ``embedded_capture``: the same with ``megatron.rollout_cuda_graphs_kept: 0`` (the decode
  step's CUDA graph captured in every generation, as before issue 47);
- ``vllm``: the same with ``megatron.inference_backend: vllm`` (colocated, sleep/wake, in-memory weight sync);
- ``vllm_kv``: ``vllm`` with the engine's KV cache sized to the step's rollouts (``megatron.vllm_kv_cache_gib``: the
  completions x (max_prompt_length + new tokens) slots, x 1.25) instead of most of ``vllm_gpu_memory_utilization``: what a wake maps;
- ``vllm_awake``: ``vllm_kv`` with ``megatron.vllm_sleep: false`` (the engine stays resident: no wake or sleep);
- ``sglang``: the same with ``megatron.inference_backend: sglang`` (a colocated engine, released while training);
- ``trl``: TRL's GRPOTrainer with HF ``generate`` rollouts (scripts/bench_grpo_trl.py, the settings written there);
- ``trl_vllm``: TRL with ``use_vllm=True, vllm_mode="colocate"``.

Per row: tokens/s/GPU (prompt + completion tokens of the step's batch over the step time, NeMo-RL's definition;
step 1, the warm-up, left out), step time and its split (ours: weight sync, wake, rollout, sleep, logprobs, train;
TRL: generate-and-score, which includes its old-logprob pass, and the rest), peak memory (PyTorch's allocator: a
vLLM engine's own pool is not in it), mean completion length, reward at the first and last 10 steps.
``--prompts/--generations/--max-new-tokens`` shrink the run (CPU smoke tests). ``--profile`` adds the step profile of
our rows: each ``time/*`` phase of trainer/step_profile.py, ms per step (mean over the steps that count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from bench_common import (
    REAL_CONFIG,
    REPO,
    apply_settings,
    card_name,
    fmt,
    mean_of,
    print_report,
    real_max_prompt_length,
    rollout_kv_cache_gib,
    run_logged,
    run_rows,
    run_worker,
)

PATHS = ("embedded", "embedded_capture", "vllm", "vllm_kv", "vllm_awake", "sglang", "trl", "trl_vllm")


def ours_config(out: Path, args: argparse.Namespace, backend: str, tag: str, kv_cache_gib: float = 0.0,
                sleep: bool = True, graphs_kept: int | None = None) -> Path:
    """configs/smollm2_arithmetic_gpu.yaml for a throughput run: ``steps`` steps, no checkpoints until the end;
    written as TASK_TAG.yaml (``tag``: the row's, see ``run_ours``)."""
    raw = yaml.safe_load(REAL_CONFIG.read_text())
    completions = args.prompts * args.generations
    raw["training"].update(max_steps=args.steps, save_steps=0)
    raw["megatron"].update(inference_backend=backend, global_batch_size=completions // 2,
                           micro_batch_size=args.micro_batch or completions // 4,
                           vllm_kv_cache_gib=kv_cache_gib, vllm_sleep=sleep)
    if graphs_kept is not None:
        raw["megatron"]["rollout_cuda_graphs_kept"] = graphs_kept
    raw["grpo"].update(num_generations=args.generations, max_completion_length=args.max_new_tokens)
    if args.task == "scale":
        raw["grpo"]["reward_functions"] = [{"name": "char_diversity"}]
    apply_settings(raw, args.set)  # after the bench's own settings
    path = out / f"{args.task}_{tag}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_ours(args: argparse.Namespace, out: Path, backend: str, sized_kv: bool = False, sleep: bool = True,
             graphs_kept: int | None = None) -> dict[str, Any]:
    completions, max_len = args.prompts * args.generations, real_max_prompt_length() + args.max_new_tokens
    kv = rollout_kv_cache_gib(args.model, completions, max_len) if sized_kv else 0.0
    tag = (f"{backend}_kv" if sized_kv else backend) + ("" if sleep else "_awake") + ("_capture" if graphs_kept == 0 else "")
    if args.micro_batch:
        tag += f"_mb{args.micro_batch}"
    if args.set:  # a work folder (and config) of its own: a run never resumes another setting's checkpoint
        tag += "_" + hashlib.sha1("\n".join(args.set).encode()).hexdigest()[:8]
    work = out / f"{args.task}_ours_{tag}"
    cfg = ours_config(out, args, backend, tag, kv, sleep, graphs_kept)
    # no final checkpoint: not what is measured, and at the 1.5B shape ~21 GB a row
    result, steady, columns = run_worker(work, cfg, args, ["--no-eval", "--no-final-checkpoint", "--converted",
                                                           str(out / f"{args.task}_converted")], sglang=backend == "sglang")
    train = result["train"]
    return {
        "name": f"oumi-megatron ({backend}" + (f", KV cache {kv:.3g} GiB" if kv else "") + ("" if sleep else ", awake")
                + (", graphs captured per call" if graphs_kept == 0 else "")
                + (f", micro batch {args.micro_batch}" if args.micro_batch else "") + "".join(f", {s}" for s in args.set) + ")",
        "processed_tokens": mean_of(train, "batch/processed_tokens"),
        "padding_fraction": mean_of(train, "batch/padding_fraction"),
        **columns,
        "wake_s": mean_of(steady, "time/wake_s"), "sleep_s": mean_of(steady, "time/sleep_s"),
        "sync_export_s": mean_of(steady, "weight_sync/export_s"),  # of sync_s, the exporter's share
        # the engine's sampling logprobs against the trainer's (NeMo-RL's token_mult_prob_error; 1 = equal)
        "mismatch": mean_of(steady, "mismatch/token_mult_prob_error"),
        "rollout_s_per_step": [t["time/rollout_s"] for t in steady],
        "decode_ms_per_step": mean_of(steady, "rollout/decode_ms_per_step"), "rollout_path": result.get("rollout_path"),
        "vllm_imported": result.get("vllm_imported"), "cudnn_sdp_enabled": result.get("cudnn_sdp_enabled"),
        "peak_gib": max((t["perf/peak_gpu_memory_gib"] or 0) for t in train),
        "completion_length": mean_of(train, "completion_length/mean"),
        "completion_length_per_step": [t["completion_length/mean"] for t in train],
        "profile": {k: mean_of(steady, k) for k in sorted({k for t in steady for k in t if k.startswith("time/")})},
    }


def run_trl(args: argparse.Namespace, out: Path, vllm: bool) -> dict[str, Any]:
    name = (f"{args.task}_trl_vllm" if vllm else f"{args.task}_trl") + (f"_mb{args.micro_batch}" if args.micro_batch else "")
    result = out / f"{name}.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_grpo_trl.py"), "--model", args.model, "--rows", args.rows,
           "--steps", str(args.steps), "--out", str(result), "--prompts", str(args.prompts), "--generations",
           str(args.generations), "--max-new-tokens", str(args.max_new_tokens), "--task", args.task,
           "--max-prompt-length", str(real_max_prompt_length()),
           *(["--vllm"] if vllm else []), *(["--micro-batch", str(args.micro_batch)] if args.micro_batch else [])]
    run_logged(cmd, out / f"{name}.log")
    r = json.loads(result.read_text())
    steady = slice(1, None) if len(r["step_s"]) > 1 else slice(None)
    gen, step_s = r["generation_s"][steady], r["step_s"][steady]
    lengths = [x for x in r.get("completion_length", []) if x == x]
    return {
        "name": f"TRL {r['trl']} ({'vLLM colocate' if vllm else 'HF generate'}"
                + (f", micro batch {args.micro_batch}" if args.micro_batch else "") + ")",
        "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
        "step_s": sum(step_s) / len(step_s),
        "rollout_s": sum(gen) / max(len(gen), 1),
        "train_s": (sum(step_s) - sum(gen)) / len(step_s),  # the two optimizer steps and TRL's bookkeeping
        "peak_gib": r["peak_gib"], "reward_first10": r["reward_first10"], "reward_last10": r["reward_last10"],
        "completion_length": sum(lengths) / len(lengths) if lengths else None,
        "reward_per_step": r["reward"], "completion_length_per_step": r.get("completion_length", []),
        "step_s_per_step": step_s, "steps": r["grpo_steps"],
    }


def prepare_scale(args: argparse.Namespace) -> None:
    """The scale task's model and rows, built where they are missing (examples/scale_task.py)."""
    from oumi_megatron.examples.scale_task import build_scale_model, write_scale_rows

    if not (Path(args.model) / "config.json").is_file():  # a folder already there is used as it is (smoke tests: small)
        build_scale_model(args.model)
    if not (Path(args.rows) / "train.rows.jsonl").is_file():
        write_scale_rows(args.rows)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of docs/benchmarks.md, with each row's ratio to TRL's best mode (tokens/s/GPU)."""
    trl = [r["tokens_per_s_per_gpu"] for r in rows if r["name"].startswith("TRL")]
    best_trl = max(trl) if trl else None
    lines = [f"| {args.task}: {args.steps} GRPO steps of {args.prompts} x {args.generations}, {args.max_new_tokens} new tokens "
             "| tokens/s/GPU | vs TRL's best | step s | sync (export) / wake / sleep ms | rollout s | logprobs s | train s "
             "| peak GiB | completion tokens | reward first 10 -> last 10 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ms = {k: f"{1e3 * r[k]:.0f}" if r.get(k) is not None else "-" for k in ("sync_s", "sync_export_s", "wake_s", "sleep_s")}
        engine = f"{ms['sync_s']} ({ms['sync_export_s']}) / {ms['wake_s']} / {ms['sleep_s']}" if (r.get("sync_s") or 0) > 1e-4 else "-"
        ratio = f"{r['tokens_per_s_per_gpu'] / best_trl:.2f}x" if best_trl else "-"
        lines.append(f"| {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} | {ratio} | {r['step_s']:.2f} | "
                     f"{engine} | {fmt(r.get('rollout_s'))} | "
                     f"{fmt(r.get('logprob_s'))} | {fmt(r.get('train_s'))} | {fmt(r.get('peak_gib'), '.1f')} | "
                     f"{fmt(r.get('completion_length'), '.0f')} | {r['reward_first10']:.3f} -> {r['reward_last10']:.3f} |")
    return "\n".join(lines)


PROFILE = ("rollout", "prompts", "generate", "decode", "prefill", "graph_capture", "detokenize", "reward", "score_gather",
           "rollout_host", "sync", "wake", "sleep", "batch_build", "logprob", "train",
           "train_forward_backward", "train_optimizer")


def profile_table(rows: list[dict[str, Any]]) -> str:
    """Our rows' step profile: ms per step of each phase (trainer/step_profile.py), '-' where a path has none."""
    ours = [r for r in rows if r.get("profile")]
    lines = ["| step profile, ms per step | " + " | ".join(PROFILE) + " |", "| --- |" + " --- |" * len(PROFILE)]
    for r in ours:
        cells = [fmt(None if r["profile"].get(f"time/{k}_s") is None else 1e3 * r["profile"][f"time/{k}_s"], ".0f")
                 for k in PROFILE]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="real", choices=("real", "scale"))
    p.add_argument("--model", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True, help="work folders (checkpoints: keep them off what a device call returns)")
    p.add_argument("--results", default=None, help="where TASK_result.json is rewritten after every row (default: --out)")
    p.add_argument("--paths", default="embedded,trl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=None, help="the micro batch of both sides (ours: "
                   "megatron.micro_batch_size; TRL: per_device_train_batch_size); default prompts x generations / 4")
    p.add_argument("--profile", action="store_true", help="also print our rows' step profile (time/* phases)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting of our runs' config (YAML value), e.g. megatron.enable_sequence_packing=true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results or args.out)
    if args.task == "scale":
        prepare_scale(args)

    def run_path(path: str) -> dict[str, Any]:
        if path == "sglang":
            return run_ours(args, out, "sglang")
        if path in ("embedded", "embedded_capture", "vllm", "vllm_kv", "vllm_awake"):
            return run_ours(args, out, "megatron" if path.startswith("embedded") else "vllm",
                            sized_kv=path in ("vllm_kv", "vllm_awake"), sleep=path != "vllm_awake",
                            graphs_kept=0 if path == "embedded_capture" else None)
        return run_trl(args, out, vllm=path == "trl_vllm")

    rows, failed = run_rows(args.paths, PATHS, run_path, results / f"{args.task}_result.json")
    text = table(rows, args) + ("\n\n" + profile_table(rows) if args.profile else "")
    print_report(f"{card_name()}, `python scripts/bench_grpo.py {' '.join(sys.argv[1:])}`", text, failed)


if __name__ == "__main__":
    main()
