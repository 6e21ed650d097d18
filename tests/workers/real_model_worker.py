"""`oumi train -c configs/smollm2_arithmetic_gpu.yaml` and `oumi-megatron eval` of its hf_model, without Oumi.

    python tests/workers/real_model_worker.py CONFIG.yaml WORK --rows DIR [--max-steps N] [--eval-base]
    torchrun --nproc-per-node 2 tests/workers/real_model_worker.py ...   # data-parallel over the ranks

The lent GPU image has no Oumi (its dependencies do not fit a call), so what Oumi provides is replaced
by what it produced on a machine that has it (scripts/prepare_gpu_real_model.py): the data rows as Oumi's
``openai/gsm8k`` dataset class transformed them (DIR/train.rows.jsonl, DIR/<eval set prefix>.rows.jsonl) and the source of Oumi's
``gsm8k`` reward (DIR/oumi_gsm8k_reward.py, executed here with its two registry imports stubbed). The
YAML's megatron:/grpo: sections are read into the same dataclasses; the training section's fields are
read as they are. Same trainer, engine, rollout backend and evaluator as ``oumi train``. Writes
WORK/result.json (rank 0): the eval curves (every eval set), the base model's and the exported model's held-out numbers.
"""

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml


def oumi_gsm8k_reward(source: Path):  # noqa: ANN201
    """Oumi's gsm8k reward function, from its source file (the registry decorator made a no-op)."""
    registry = types.ModuleType("oumi.core.registry")
    registry.RegistryType = SimpleNamespace(REWARD_FUNCTION="reward_function")
    registry.register = lambda name, kind: (lambda fn: fn)
    for name in ("oumi", "oumi.core"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["oumi.core.registry"] = registry
    namespace: dict = {"__name__": "oumi_gsm8k_reward"}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # noqa: S102 - Oumi's own file
    for name in ("oumi.core.registry", "oumi.core", "oumi"):
        sys.modules.pop(name, None)  # nothing else may mistake the stub for Oumi
    return namespace["gsm8k_reward"]


def load_sections(path: Path):  # noqa: ANN201
    from omegaconf import OmegaConf

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.megatron_params import MegatronParams

    raw = yaml.safe_load(path.read_text())
    megatron = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MegatronParams), raw.get("megatron", {})))
    grpo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MegatronGrpoParams), raw.get("grpo", {})))
    return raw, megatron, grpo


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
    args = p.parse_args()

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from oumi_megatron.engine.builder import build_engine, build_inference_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.examples.scale_task import char_diversity
    from oumi_megatron.grpo.rewards import RewardComputer
    from oumi_megatron.layout import resolve_layout
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.trainer.evaluation import build_evaluators
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

    raw, params, grpo = load_sections(Path(args.config))
    if args.inference_backend:
        params.inference_backend = args.inference_backend
    if args.vllm_kv_cache_gib is not None:
        params.vllm_kv_cache_gib = args.vllm_kv_cache_gib
    t = raw["training"]
    work, rows_dir = Path(args.work), Path(args.rows)
    hf = Path(args.model or raw["model"]["model_name"])
    dtype = getattr(torch, raw["model"].get("torch_dtype_str", "bfloat16"))
    # the real task's reward (Oumi's gsm8k) where its source came with the rows; the scale task's cheap one
    reward = {"char_diversity": char_diversity}
    if (rows_dir / "oumi_gsm8k_reward.py").is_file():
        reward["gsm8k"] = oumi_gsm8k_reward(rows_dir / "oumi_gsm8k_reward.py")
    train_rows = [json.loads(line) for line in (rows_dir / "train.rows.jsonl").read_text().splitlines()]
    eval_sets = {} if args.no_eval else {
        prefix: [json.loads(line) for line in (rows_dir / f"{prefix}.rows.jsonl").read_text().splitlines()]
        for prefix in dict.fromkeys(grpo.eval_metric_prefixes or ["eval"])}
    max_steps = args.max_steps or t["max_steps"]
    out = work / "run"
    training = SimpleNamespace(
        output_dir=str(out), seed=t["seed"], max_steps=max_steps, save_steps=args.save_steps or t["save_steps"],
        enable_tensorboard=True, save_final_model=args.export or not (args.no_eval or args.no_export_eval),
        try_resume_from_last_checkpoint=True,
        eval_strategy="no" if args.no_eval else t["eval_strategy"], eval_steps=t["eval_steps"],
        per_device_eval_batch_size=t["per_device_eval_batch_size"],
        include_performance_metrics=t.get("include_performance_metrics", False), enable_wandb=False, run_name=None,
    )
    model = SimpleNamespace(model_name=str(hf), torch_dtype=dtype, trust_remote_code=False)  # the trainer builds its backend from it
    config = SimpleNamespace(model=model, training=training, megatron=params, grpo=grpo)
    # the config's parallel sizes over torchrun's ranks (data parallel over the rest), resolved as `oumi train` does
    resolution = resolve_layout(SimpleNamespace(megatron=params, grpo=grpo, training=SimpleNamespace()),
                                int(os.environ.get("WORLD_SIZE", "1")))
    if resolution.layout is None or resolution.problems:
        raise SystemExit("the config's layout: " + "; ".join(map(str, resolution.problems)))
    layout = resolution.layout
    tokenizer = AutoTokenizer.from_pretrained(hf)
    # torchrun's rank i on GPU i, as the engine builder places it
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")

    def held_out(model_dir: Path) -> dict:
        """`oumi-megatron eval`'s path: the HF folder's weights in memory, greedy, the same evaluator."""
        _, engine = build_inference_engine(model_dir, params, dtype)
        backend = MegatronRolloutBackend(engine, vocab_size=len(tokenizer), seed=t["seed"])
        rewards = RewardComputer(grpo.reward_functions, grpo.on_reward_error, reward)
        metrics: dict = {}
        for evaluator in build_evaluators(eval_sets, tokenizer, rewards, backend, grpo, t["per_device_eval_batch_size"], device):
            metrics.update(evaluator.run())
        return metrics

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"card": card, "config": args.config, "max_steps": max_steps}
    if args.eval_base:
        result["base_eval"] = held_out(hf)

    t0 = time.perf_counter()
    checkpoint = ensure_converted(hf, Path(args.converted) if args.converted else out / "megatron_checkpoint", params, dtype)
    updates = grpo.ppo_epochs * grpo.num_mini_batches
    settings = OptimSettings(lr=t["learning_rate"], total_steps=max_steps * updates)
    bridge, engine = build_engine(checkpoint, params, settings, dtype)
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, tokenizer, train_rows,
                                      reward_functions=reward, eval_dataset=eval_sets or None)
    if args.no_final_checkpoint:
        trainer.save_state = lambda: None  # type: ignore[method-assign]
    trainer.train()
    result["train_seconds"] = time.perf_counter() - t0
    # the allocator's peak on every rank, and what the memory plan expects of a training step (scripts/bench_scale.py)
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import estimate_memory

    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    shape = ModelShape.from_file(hf / "config.json")
    plan = estimate_memory(SimpleNamespace(megatron=params, grpo=grpo), shape, layout)
    result.update(peak_gib_by_rank=[round(x.item(), 2) for x in peaks], plan_training_peak_gib=round(plan.training_peak, 2),
                  num_layers=shape.num_layers)
    if dist.get_rank() == 0:
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
                           for m in metrics if "reward/mean" in m]
        # which generation path ran (e.g. whether the embedded decoder's CUDA graphs were captured)
        last = getattr(trainer.backend, "last_stats", None)
        result["rollout_path"] = last.path if last is not None else type(trainer.backend).__name__
        # vLLM, once imported (Megatron-Bridge's ModelOpt plugin imports it where it is installed), turns cuDNN SDPA off
        # process-wide; the engine's attention names its kernels per call (engine/kernels/attention.sdpa)
        result["vllm_imported"], result["cudnn_sdp_enabled"] = "vllm" in sys.modules, torch.backends.cuda.cudnn_sdp_enabled()
    if args.no_eval or args.no_export_eval:
        if dist.get_rank() == 0:
            (work / "result.json").write_text(json.dumps(result, indent=1))
        return
    result["hf_model_eval"] = held_out(out / "hf_model")
    if dist.get_rank() == 0:
        (work / "result.json").write_text(json.dumps(result, indent=1))
        curve = result["eval_curve"]
        for prefix in eval_sets:
            print(f"{prefix} accuracy: step {curve[0]['step']} {curve[0][f'{prefix}/accuracy']:.3f} -> step "
                  f"{curve[-1]['step']} {curve[-1][f'{prefix}/accuracy']:.3f}; exported hf_model "
                  f"{result['hf_model_eval'][f'{prefix}/accuracy']:.3f}")


if __name__ == "__main__":
    main()
