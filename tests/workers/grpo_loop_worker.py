"""The GRPO loop of `oumi train -c configs/tiny_cpu_grpo.yaml`, without Oumi (for the GPU image).

    python tests/workers/grpo_loop_worker.py WORK [--steps 80] [--tp 2 | --pp 2 | --packing] (torchrun for 2)

Same trainer class, engine, rollout backend, rewards and hyper-parameters as the demo config; only
what Oumi provides (YAML loading, dataset registry, tokenizer builder) is replaced by its plain
equivalents: the config sections are built in Python, the demo's jsonl is read directly and the
tokenizer loaded with transformers. Writes WORK/run/metrics.jsonl and WORK/result.json (rank 0).
"""

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--unfused", action="store_true",
                   help="fusions, chunked logprobs and fused optimizer kernels off (the engine before issue 12)")
    p.add_argument("--graphs", action="store_true", help="cuda_graph_impl: local, microbatches padded to prompt + completion")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--vllm-separate", action="store_true",
                   help="inference_backend: vllm, rollout_placement: separate (the engine on the GPU after the trainer's)")
    p.add_argument("--max-staleness", type=int, default=0, help="grpo.max_staleness (with --vllm-separate)")
    args = p.parse_args()

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from oumi_megatron.config.grpo_params import MegatronGrpoParams, RewardFunctionParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.examples.demo_task import char_class_reward, char_class_row
    from oumi_megatron.examples.tiny_models import build_tiny_model
    from oumi_megatron.layout import ParallelLayout
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

    work = Path(args.work)
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = getattr(torch, args.dtype)
    hf = work / "tiny_qwen2"
    if int(os.environ.get("RANK", "0")) == 0 and not (hf / "config.json").is_file():
        build_tiny_model(hf, arch="qwen2")
    while not (hf / "config.json").is_file():  # other ranks wait for rank 0's files
        time.sleep(0.2)
    time.sleep(0.5)

    # configs/tiny_cpu_grpo.yaml, in Python
    params = MegatronParams(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            micro_batch_size=8, global_batch_size=32, enable_sequence_packing=args.packing)
    params.transformer_config.recompute_granularity = None
    if args.unfused:
        from oumi_megatron.engine.kernels.fusions import FUSIONS

        for name in FUSIONS:
            setattr(params.transformer_config, name, False)
        params.logprob_chunk_tokens = 0
        params.optimizer_config.fused_kernels = False
    if args.graphs:
        params.transformer_config.cuda_graph_impl = "local"
        params.transformer_config.cuda_graph_seq_length = 64 + 16  # max_prompt_length + max_completion_length
    if args.vllm_separate:
        params.inference_backend, params.rollout_placement = "vllm", "separate"
        params.weight_sync_method = "nccl" if torch.cuda.is_available() else "gloo"
    grpo = MegatronGrpoParams(num_generations=8, temperature=1.0, max_prompt_length=64, max_completion_length=16,
                              reward_functions=[RewardFunctionParams(name="char_class")], max_staleness=args.max_staleness,
                              off_policy_correction="tis" if args.max_staleness else None)
    out = work / "run"
    training = SimpleNamespace(output_dir=str(out), seed=42, max_steps=args.steps, save_steps=0,
                               enable_tensorboard=True, save_final_model=True, try_resume_from_last_checkpoint=False,
                               include_performance_metrics=False, enable_wandb=False, run_name=None)
    model = SimpleNamespace(model_name=str(hf), torch_dtype=dtype, trust_remote_code=False)  # the trainer builds its backend from it
    config = SimpleNamespace(model=model, training=training, megatron=params, grpo=grpo)
    dp = world // (args.tp * args.pp)
    layout = ParallelLayout(world_size=world, tensor_parallel=args.tp, pipeline_parallel=args.pp, context_parallel=1,
                            expert_parallel=1, data_parallel=dp, virtual_pipeline=None, sequence_parallel=False,
                            micro_batch_size=8, global_batch_size=32, pipeline_schedule="1f1b" if args.pp > 1 else "none",
                            num_generations=8, num_mini_batches=1)

    t0 = time.perf_counter()
    checkpoint = ensure_converted(hf, out / "megatron_checkpoint", params, dtype)
    bridge, engine = build_engine(checkpoint, params, OptimSettings(lr=3e-3, total_steps=args.steps), dtype)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    rows = [char_class_row(json.loads(line)) for line in (REPO / "data" / "char_class_train.jsonl").read_text().splitlines()]
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, tokenizer, rows,
                                      reward_functions={"char_class": char_class_reward})
    trainer.train()
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward/mean"] for m in metrics]
        card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result = {
            "card": card, "world_size": world, "tp": args.tp, "pp": args.pp, "packing": args.packing,
            "variant": "unfused" if args.unfused else "fast + CUDA graphs" if args.graphs else "fast",
            "steps": len(metrics), "seconds": seconds, "rewards": rewards,
            "first5": sum(rewards[:5]) / 5, "last5": sum(rewards[-5:]) / 5,
            "rollout_s": sum(m["time/rollout_s"] for m in metrics), "train_s": sum(m["time/train_s"] for m in metrics),
            "hf_model": (out / "hf_model" / "config.json").is_file(),
            "staleness_max": [m.get("rollout/staleness_max", 0.0) for m in metrics],
            "step_s": [m.get("time/train_s", 0.0) + m.get("time/rollout_wait_s", m["time/rollout_s"]) for m in metrics],
            "weight_sync_gbps": [m.get("weight_sync/gbps") for m in metrics],
        }
        (work / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
