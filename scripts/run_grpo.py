"""A whole GRPO run as ``oumi train`` assembles it, on machines without Oumi's data pipeline (the lent GPU image).

    python scripts/run_grpo.py CONFIG.yaml WORK --rows DIR [--max-steps N] [--eval-base] [--set key=value ...]
    torchrun --nproc-per-node 2 scripts/run_grpo.py ...   # data-parallel over the ranks

The config is the YAML plus dotted overrides (config/standalone.py ``load_config``: Oumi's loading where Oumi is
installed), the layout is resolved by engine/parallel/layout.py and the run is built by the composition root
(assembly.py ``build_trainer``, ``evaluate_model``): the same start plan, conversion, engine, rollout mode, trainer
and evaluator as ``oumi train`` and ``oumi-megatron eval``. What Oumi provides is replaced by what it produced on a
machine that has it (scripts/prepare_gpu_real_model.py): the data rows as Oumi's ``openai/gsm8k`` dataset class
transformed them (DIR/train.rows.jsonl, DIR/<eval set prefix>.rows.jsonl) and the source of Oumi's ``gsm8k`` reward
(DIR/oumi_gsm8k_reward.py, executed here with its two registry imports stubbed). Writes WORK/result.json (rank 0):
the eval curves (every eval set), the base model's and the exported model's held-out numbers. Every whole-run
benchmark (bench_grpo.py, bench_async.py, bench_async_episodes.py, bench_scale.py, bench_scale_laws.py --gpu) runs this
script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

OUMI_GSM8K_REWARD_SHA256 = "b7e5b2f4b97b1173764456432391dbc354cc18bfc07a8211a71e04db27ece975"
"""The sha256 of oumi 0.9's oumi/datasets/grpo/rewards/gsm8k_reward.py (the lock's): the one file this script runs."""


def oumi_gsm8k_reward(source: Path) -> Callable[..., list[float]]:
    """Oumi's gsm8k reward function, from its source file (the registry decorator made a no-op). Only Oumi's own file
    runs: a file of other bytes beside the rows is refused, never executed."""
    code = source.read_bytes()
    if hashlib.sha256(code).hexdigest() != OUMI_GSM8K_REWARD_SHA256:
        raise SystemExit(f"{source} is not oumi 0.9's gsm8k reward (its sha256 differs): refusing to run it. "
                         "Write the rows again with scripts/prepare_gpu_real_model.py.")
    registry = types.ModuleType("oumi.core.registry")
    registry.RegistryType = SimpleNamespace(REWARD_FUNCTION="reward_function")  # type: ignore[attr-defined]
    registry.register = lambda name, kind: (lambda fn: fn)  # type: ignore[attr-defined]
    for name in ("oumi", "oumi.core"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["oumi.core.registry"] = registry
    namespace: dict = {"__name__": "oumi_gsm8k_reward"}
    exec(compile(code, str(source), "exec"), namespace)  # noqa: S102 - Oumi's own file, checked above
    for name in ("oumi.core.registry", "oumi.core", "oumi"):
        sys.modules.pop(name, None)  # nothing else may mistake the stub for Oumi
    return namespace["gsm8k_reward"]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The command line as ``oumi train`` overrides of the YAML."""
    out = [f"training.output_dir={Path(args.work) / 'run'}", "training.try_resume_from_last_checkpoint=true",
           "training.enable_wandb=false"]
    if args.model:
        out.append(f"model.model_name={args.model}")
    if args.max_steps:
        out.append(f"training.max_steps={args.max_steps}")
    if args.save_steps:
        out.append(f"training.save_steps={args.save_steps}")
    if args.no_eval:
        out.append("training.eval_strategy=no")
    if args.no_eval or args.no_export_eval:
        out.append(f"training.save_final_model={str(bool(args.export)).lower()}")
    if args.inference_backend:
        out.append(f"megatron.inference_backend={args.inference_backend}")
    if args.vllm_kv_cache_gib is not None:
        out.append(f"megatron.vllm_kv_cache_gib={args.vllm_kv_cache_gib}")
    return out + list(args.set)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("work")
    p.add_argument("--rows", required=True)
    p.add_argument("--model", default=None, help="HF folder (default: model.model_name)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--save-steps", type=int, default=None, help="checkpoint interval (default: the config's): a run "
                   "cut off by a device call's time limit resumes from its last checkpoint")
    p.add_argument("--eval-base", action="store_true", help="also evaluate the base model with `eval`'s path")
    p.add_argument("--no-eval", action="store_true", help="throughput runs (scripts/bench_grpo.py): no held-out "
                   "evaluation during training, no exported model")
    p.add_argument("--no-export-eval", action="store_true", help="the held-out evaluations during training only, not "
                   "the exported model's again (scripts/bench_async.py)")
    p.add_argument("--no-final-checkpoint", action="store_true", help="throughput runs at scale (scripts/bench_scale.py): "
                   "no resumable state at the end (a Llama-8B-shaped run's is ~110 GB of weights and Adam moments, and "
                   "its writing is not what is measured)")
    p.add_argument("--export", action="store_true", help="write the final HF export even with --no-eval "
                   "(scripts/bench_scale_laws.py --gpu measures it)")
    p.add_argument("--inference-backend", default=None, help="megatron.inference_backend instead of the config's")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=None, help="megatron.vllm_kv_cache_gib instead of the "
                   "config's (a colocated engine maps and unmaps this much at each wake and sleep)")
    p.add_argument("--converted", default=None, help="where the converted Megatron-Core checkpoint lives (default: "
                   "under WORK): runs of one model share it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more overrides of the YAML, as `oumi train` takes them (megatron.micro_batch_size=8)")
    args = p.parse_args()

    import torch.distributed as dist

    from oumi_megatron.assembly import build_trainer, evaluate_model
    from oumi_megatron.config.standalone import load_config
    from oumi_megatron.engine.parallel.layout import resolve_layout
    from oumi_megatron.examples.scale_task import char_diversity
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import estimate_memory

    config = load_config(args.config, overrides_of(args))
    work, rows_dir = Path(args.work), Path(args.rows)
    hf = Path(config.model.model_name)
    out = Path(config.training.output_dir)
    # the real task's reward (Oumi's gsm8k) where its source came with the rows; the scale task's cheap one; this
    # package's own (code_tests) resolve by name without Oumi (grpo/rewards.py)
    reward: dict[str, Any] = {"char_diversity": char_diversity}
    if (rows_dir / "oumi_gsm8k_reward.py").is_file():
        reward["gsm8k"] = oumi_gsm8k_reward(rows_dir / "oumi_gsm8k_reward.py")
    train_rows = _rows(rows_dir / "train.rows.jsonl")
    eval_sets = {} if args.no_eval else {prefix: _rows(rows_dir / f"{prefix}.rows.jsonl")
                                         for prefix in dict.fromkeys(config.grpo.eval_metric_prefixes or ["eval"])}
    # the config's parallel sizes over torchrun's ranks (data parallel over the rest), resolved as `oumi train` does
    layout = resolve_layout(config, int(os.environ.get("WORLD_SIZE", "1"))).require()
    shape = ModelShape.from_file(hf / "config.json")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"card": card, "config": args.config, "max_steps": config.training.max_steps}
    if args.eval_base:
        result["base_eval"] = evaluate_model(config, layout, eval_sets, hf, reward_functions=reward)

    t0 = time.perf_counter()
    run = build_trainer(config, layout, train_rows, eval_dataset=eval_sets or None, reward_functions=reward,
                        shape=shape, converted_dir=args.converted)
    trainer = run.trainer
    if args.no_final_checkpoint:
        trainer.save_state = lambda: None  # type: ignore[method-assign]
    run.train()
    result["train_seconds"] = time.perf_counter() - t0
    # the allocator's peak on every rank, and what the memory plan expects of a training step (scripts/bench_scale.py)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    plan = estimate_memory(config, shape, layout)
    result.update(peak_gib_by_rank=[round(x.item(), 2) for x in peaks], plan_training_peak_gib=round(plan.training_peak, 2),
                  num_layers=shape.num_layers)
    if dist.get_rank() == 0:
        metrics = _rows(out / "metrics.jsonl")
        result["eval_curve"] = [{k: m[k] for k in m if k == "step" or k.split("/")[0] in eval_sets}
                                for m in metrics if "eval/reward_mean" in m]
        result["train"] = [{k: m.get(k) for k in ("step", "reward/mean", "completion_length/mean", "time/rollout_s",
                                                   "time/train_s", "time/logprob_s", "time/sync_s", "time/wake_s",
                                                   "time/sleep_s", "weight_sync/seconds", "tokens_per_s",
                                                   "perf/step_s", "perf/train_tokens_per_s", "perf/peak_gpu_memory_gib",
                                                   "batch/real_tokens", "rollout/tokens_per_s", "rollout/decode_ms_per_step",
                                                   "mismatch/mean_abs_diff", "mismatch/max_abs_diff",
                                                   "mismatch/token_mult_prob_error", "weight_sync/export_s",
                                                   # asynchronous GRPO (scripts/bench_async.py)
                                                   "rollout/staleness_max", "rollout/policy_version",
                                                   "async/trainer_idle_fraction", "async/engine_idle_fraction",
                                                   "time/rollout_wait_s", "time/push_s", "weight_sync/transfer_s",
                                                   "weight_sync/gbps", "weight_sync/raw_gbps",
                                                   "weight_sync/fraction_of_raw", "tis/mean_weight")}
                           | {k: v for k, v in m.items() if k.startswith("time/")}  # the step profile (--profile)
                           for m in metrics if "reward/mean" in m]
        # which generation path ran (e.g. whether the embedded decoder's CUDA graphs were captured)
        result["rollout_path"] = trainer.backend.decode_profile().path
        # vLLM, once imported (Megatron-Bridge's ModelOpt plugin imports it where it is installed), turns cuDNN SDPA off
        # process-wide; the engine's attention names its kernels per call (engine/kernels/attention.sdpa)
        result["vllm_imported"], result["cudnn_sdp_enabled"] = "vllm" in sys.modules, torch.backends.cuda.cudnn_sdp_enabled()
    if args.no_eval or args.no_export_eval:
        if dist.get_rank() == 0:
            (work / "result.json").write_text(json.dumps(result, indent=1))
        return
    result["hf_model_eval"] = evaluate_model(config, layout, eval_sets, out / "hf_model", reward_functions=reward)
    if dist.get_rank() == 0:
        (work / "result.json").write_text(json.dumps(result, indent=1))
        curve = result["eval_curve"]
        for prefix in eval_sets:  # gsm8k's accuracy, or code_tests' pass@1 (the code task, HumanEval)
            name = next(m for m in ("accuracy", "pass@1", "reward_mean") if f"{prefix}/{m}" in curve[0])
            print(f"{prefix} {name}: step {curve[0]['step']} {curve[0][f'{prefix}/{name}']:.3f} -> step "
                  f"{curve[-1]['step']} {curve[-1][f'{prefix}/{name}']:.3f}; exported hf_model "
                  f"{result['hf_model_eval'][f'{prefix}/{name}']:.3f}")


if __name__ == "__main__":
    main()
