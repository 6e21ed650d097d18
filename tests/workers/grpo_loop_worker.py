"""The GRPO loop of `oumi train -c configs/tiny_cpu_grpo.yaml`, without Oumi (for the GPU image).

    python tests/workers/grpo_loop_worker.py WORK [--steps 80] [--tp 2 | --pp 2 | --packing] (torchrun for 2)

The demo config itself, read without Oumi (config/standalone.py), with this worker's options as overrides, and the
run assembled by the composition root (assembly.py ``build_trainer``), as `oumi train` assembles it; only the rows
(the demo's jsonl read directly) and the reward (the demo's function, passed by name) come from here instead of
Oumi's registries. Writes WORK/run/metrics.jsonl and WORK/result.json (rank 0).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def overrides(args: argparse.Namespace, work: Path, hf: Path) -> list[str]:
    """The worker's options as overrides of configs/tiny_cpu_grpo.yaml."""
    out = [f"model.model_name={hf}", f"model.torch_dtype_str={args.dtype}", f"training.output_dir={work / 'run'}",
           f"training.max_steps={args.steps}", "training.save_steps=0", "training.include_performance_metrics=false",
           f"megatron.tensor_model_parallel_size={args.tp}", f"megatron.pipeline_model_parallel_size={args.pp}",
           f"megatron.enable_sequence_packing={str(args.packing).lower()}"]
    if args.unfused:  # the engine before issue 12
        from oumi_megatron.engine.kernels.fusions import FUSIONS

        out += [f"megatron.transformer_config.{name}=false" for name in FUSIONS]
        out += ["megatron.logprob_chunk_tokens=0", "megatron.optimizer_config.fused_kernels=false"]
    if args.graphs:  # microbatches padded to max_prompt_length + max_completion_length
        out += ["megatron.transformer_config.cuda_graph_impl=local", "megatron.transformer_config.cuda_graph_seq_length=80"]
    if args.vllm_separate:
        method = "nccl" if torch.cuda.is_available() else "gloo"
        out += ["megatron.inference_backend=vllm", "megatron.rollout_placement=separate", f"megatron.weight_sync_method={method}"]
    if args.max_staleness:
        out += [f"grpo.max_staleness={args.max_staleness}", "grpo.off_policy_correction=tis"]
    if args.lora:  # as tests/test_grpo_trainer.py's LoRA run
        out += ["training.use_peft=true", "peft.lora_r=16", "peft.lora_alpha=32", "grpo.beta=0.04"]
    return out + args.set


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
    p.add_argument("--lora", action="store_true", help="training.use_peft: LoRA r 16 on every linear layer, grpo.beta 0.04 "
                   "(the tiny model built with init_std 0.2: at 0.02 its frozen tied output layer caps the logits)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="one more override of the config, after the worker's own (repeatable)")
    p.add_argument("--reward-log", default=None, help="a folder: each rank writes how many completions its reward "
                   "function was called with (rank{r}.json), to count the calls per sample")
    args = p.parse_args()

    import torch.distributed as dist

    from oumi_megatron.assembly import build_trainer
    from oumi_megatron.config.standalone import load_config
    from oumi_megatron.engine.parallel.layout import resolve_layout
    from oumi_megatron.examples.demo_task import char_class_reward, char_class_row
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = Path(args.work)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    hf = work / "tiny_qwen2"
    if int(os.environ.get("RANK", "0")) == 0 and not (hf / "config.json").is_file():
        build_tiny_model(hf, arch="qwen2", **({"init_std": 0.2} if args.lora else {}))
    while not (hf / "config.json").is_file():  # other ranks wait for rank 0's files
        time.sleep(0.2)
    time.sleep(0.5)

    config = load_config(REPO / "configs" / "tiny_cpu_grpo.yaml", overrides(args, work, hf), oumi=False)
    layout = resolve_layout(config, world).require()
    out = Path(config.training.output_dir)
    rows = [char_class_row(json.loads(line)) for line in (REPO / "data" / "char_class_train.jsonl").read_text().splitlines()]

    calls: list[int] = []

    def reward(completions: list[str], target: list[str], **kwargs: object) -> list[float]:
        calls.append(len(completions))
        return char_class_reward(completions, target)

    t0 = time.perf_counter()
    build_trainer(config, layout, rows, reward_functions={"char_class": reward}).train()
    if args.reward_log:
        Path(args.reward_log).mkdir(parents=True, exist_ok=True)
        (Path(args.reward_log) / f"rank{dist.get_rank()}.json").write_text(json.dumps(calls))
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward/mean"] for m in metrics]
        card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result = {
            "card": card, "world_size": world, "tp": args.tp, "pp": args.pp, "packing": args.packing,
            "variant": "unfused" if args.unfused else "LoRA r 16" if args.lora else "fast + CUDA graphs" if args.graphs else "fast",
            "steps": len(metrics), "seconds": seconds, "rewards": rewards,
            "first5": sum(rewards[:5]) / 5, "last5": sum(rewards[-5:]) / 5,
            "rollout_s": sum(m["time/rollout_s"] for m in metrics), "train_s": sum(m["time/train_s"] for m in metrics),
            "hf_model": (out / "hf_model" / "config.json").is_file() or (out / "hf_adapter" / "adapter_config.json").is_file(),
            "staleness_max": [m.get("rollout/staleness_max", 0.0) for m in metrics],
            "step_s": [m.get("time/train_s", 0.0) + m.get("time/rollout_wait_s", m["time/rollout_s"]) for m in metrics],
            "weight_sync_gbps": [m.get("weight_sync/gbps") for m in metrics],
        }
        (work / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
