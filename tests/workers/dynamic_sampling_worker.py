"""DAPO dynamic sampling in the real trainer: the tiny model, the embedded backend, DP=2 on 2 gloo ranks.

    torchrun --nproc_per_node 2 tests/workers/dynamic_sampling_worker.py HF_MODEL WORK [megatron | vllm]

The reward is the demo's char_class for "digits" prompts and a constant 0.5 for "letters" prompts, so every
letters group has identical rewards and must be dropped. Three steps with up to 4 rounds each, then two with
one round (the batch must be filled with dropped groups, not trained on). For every step this records, from
what the score/filter phase handed to the update: the targets of the kept and the filler groups, whether
each kept group's rewards differ, whether this rank's sequences are the prompts of its share of the batch
(the shares are redistributed over DP after filtering), the prompts the step consumed, and the metrics.
Writes WORK/result_rank{r}.json.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    hf, work = Path(sys.argv[1]), Path(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "megatron"  # vllm: an engine colocated in each rank
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from oumi_megatron.config.grpo_params import MegatronGrpoParams, RewardFunctionParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.data import prompt_token_ids
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.state.conversion import ensure_converted
    from oumi_megatron.examples.demo_task import char_class_reward, char_class_row
    from oumi_megatron.layout import ParallelLayout
    from oumi_megatron.trainer.grpo_trainer import OumiMegatronGrpoTrainer

    def reward(completions: list[str], target: list[str], **kwargs: object) -> list[float]:
        scores = char_class_reward(completions, target)
        return [s if t == "digits" else 0.5 for s, t in zip(scores, target)]

    params = MegatronParams(micro_batch_size=8, global_batch_size=32, inference_backend=backend,
                            rollout_placement="colocated")
    params.transformer_config.recompute_granularity = None
    grpo = MegatronGrpoParams(num_generations=8, temperature=1.0, max_prompt_length=64, max_completion_length=16,
                              reward_functions=[RewardFunctionParams(name="half_constant")],
                              dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    out = work / "run"
    training = SimpleNamespace(output_dir=str(out), seed=7, max_steps=5, save_steps=0, enable_tensorboard=False,
                               save_final_model=False, try_resume_from_last_checkpoint=False)
    model = SimpleNamespace(model_name=str(hf), torch_dtype=torch.float32, trust_remote_code=False)
    config = SimpleNamespace(model=model, training=training, megatron=params, grpo=grpo)
    layout = ParallelLayout(world_size=2, tensor_parallel=1, pipeline_parallel=1, context_parallel=1, expert_parallel=1,
                            data_parallel=2, virtual_pipeline=None, sequence_parallel=False, micro_batch_size=8,
                            global_batch_size=32, pipeline_schedule="none", num_generations=8, num_mini_batches=1)
    checkpoint = ensure_converted(hf, work / "megatron_checkpoint", params, torch.float32)
    bridge, engine = build_engine(checkpoint, params, OptimSettings(lr=3e-3, total_steps=5), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    rows = [char_class_row(json.loads(line)) for line in (REPO / "data" / "char_class_train.jsonl").read_text().splitlines()]
    trainer = OumiMegatronGrpoTrainer(config, engine, bridge, checkpoint, layout, tokenizer, rows,
                                      reward_functions={"half_constant": reward})
    rank, G = dist.get_rank(), grpo.num_generations
    steps = []
    collector = trainer.collector
    collect = collector.collect

    def recorded(step: int) -> object:  # what the score/filter phase hands to the update, kept for the checks below
        start = collector.data_position
        batch = collect(step)
        consumed = [collector.dataset[collector.order[i % len(rows)]]["target"] for i in range(start, collector.data_position)]
        groups = len(batch.group_rows)
        filler = batch.filler.view(groups, G)[:, 0].tolist()
        share = len(batch.rollouts)
        first = rank * share
        expected_prompts = [prompt_token_ids(tokenizer, batch.group_rows[(first + i) // G]["prompt"], 64)[0]
                            for i in range(share)]
        totals = batch.scores.total.view(groups, G)
        steps.append({
            "consumed_targets": consumed,
            "kept_targets": [row["target"] for row, f in zip(batch.group_rows, filler) if not f],
            "filler_targets": [row["target"] for row, f in zip(batch.group_rows, filler) if f],
            "kept_rewards_differ": [bool(t.max() > t.min()) for t, f in zip(totals, filler) if not f],
            "filler_rewards_equal": [bool(t.max() == t.min()) for t, f in zip(totals, filler) if f],
            "share_matches_prompts": [r.prompt_ids for r in batch.rollouts] == expected_prompts,
            "batch_samples": len(batch.scores),
            "rounds": batch.rounds,
        })
        return batch

    collector.collect = recorded
    metrics = []
    for step in range(5):
        if step == 3:
            trainer.grpo.dynamic_sampling_max_rounds = 1
        metrics.append({k: v for k, v in trainer.grpo_step().items() if isinstance(v, (int, float, str))})
    (work / f"result_rank{rank}.json").write_text(json.dumps({"steps": steps, "metrics": metrics}, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
