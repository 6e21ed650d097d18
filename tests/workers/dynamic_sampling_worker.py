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
import pickle
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    hf, work = Path(sys.argv[1]), Path(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "megatron"  # vllm: an engine colocated in each rank
    import torch.distributed as dist

    from oumi_megatron.assembly import build_trainer
    from oumi_megatron.config.standalone import load_config
    from oumi_megatron.data import prompt_token_ids
    from oumi_megatron.engine.parallel.layout import resolve_layout
    from oumi_megatron.examples.demo_task import char_class_reward, char_class_row

    def reward(completions: list[str], target: list[str], **kwargs: object) -> list[float]:
        scores = char_class_reward(completions, target)
        return [s if t == "digits" else 0.5 for s, t in zip(scores, target)]

    # the demo config, read as the GPU image reads it (no Oumi), with this test's settings
    overrides = [f"model.model_name={hf}", f"training.output_dir={work / 'run'}", "training.seed=7", "training.max_steps=5",
                 "training.save_steps=0", "training.enable_tensorboard=false", "training.save_final_model=false",
                 f"megatron.inference_backend={backend}", "megatron.rollout_placement=colocated",
                 "grpo.reward_functions=[{name: half_constant}]", "grpo.dynamic_sampling=true",
                 "grpo.dynamic_sampling_max_rounds=4"]
    config = load_config(REPO / "configs" / "tiny_cpu_grpo.yaml", overrides, oumi=False)
    grpo = config.grpo
    layout = resolve_layout(config, 2).require()
    rows = [char_class_row(json.loads(line)) for line in (REPO / "data" / "char_class_train.jsonl").read_text().splitlines()]
    trainer = build_trainer(config, layout, rows, reward_functions={"half_constant": reward}).trainer
    tokenizer = trainer.collector.tokenizer
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
        share = len(batch.samples)
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
            "share_matches_prompts": [s.prompt_ids for s in batch.samples] == expected_prompts,
            "batch_samples": len(batch.scores),
            # the redistribution's bytes against this rank's share alone: each rank receives its share, not the batch
            "collation_bytes": collector.last_collation_bytes,
            "share_bytes": len(pickle.dumps(batch.samples, protocol=pickle.HIGHEST_PROTOCOL)),
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
