"""ZB-H1 against 1F1B in one torchrun (gloo, PP = world size), fp32 on the CPU:

    torchrun --nproc_per_node 2 tests/workers/schedule_worker.py CKPT OUT

Builds the engine from CKPT three times with gradient accumulation fusion on (the path ZB-H1 defers):
1F1B, then ZB-H1 (saving a checkpoint after step 2), then ZB-H1 again resumed from that checkpoint.
Each trains 3 optimizer steps on 8 microbatches (the engine worker's data and loss). After every step it
compares, on every rank, each parameter's main_grad and value with the 1F1B run's. Writes OUT/result.json
(rank 0): losses, schedules, deferred-W counts, the largest relative differences (max over ranks).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_worker import masked_microbatches, parameter_state, token_mean_nll


def main() -> None:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.checkpointing import load_checkpoint, save_checkpoint

    def engine_for(schedule: str):  # noqa: ANN202
        params = MegatronParams(pipeline_model_parallel_size=int(os.environ["WORLD_SIZE"]), pipeline_schedule=schedule)
        params.transformer_config.recompute_granularity = None
        params.transformer_config.gradient_accumulation_fusion = True
        settings = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0, total_steps=3)
        return build_engine(ckpt, engine_layout(params), params, settings, dtype=torch.float32)[1]

    def microbatches(step: int) -> list[dict]:
        return masked_microbatches(step, 1)  # 8 microbatches

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    runs: dict[str, dict] = {}
    reference_states = []
    for name, schedule in (("1f1b", "1f1b"), ("zb_h1", "zb_h1")):
        engine = engine_for(schedule)
        run = runs[name] = {"loss": [], "schedule": [], "deferred_wgrad_ops": [], "grad_max_rel_diff": [],
                            "value_max_rel_diff": [], "params": 0}
        for step in range(3):
            r = engine.train_step(microbatches(step), token_mean_nll)
            run["loss"].append(r.loss)
            run["schedule"].append(r.schedule)
            run["deferred_wgrad_ops"].append(r.deferred_wgrad_ops)
            now = parameter_state(engine)
            if name == "1f1b":
                reference_states.append(now)
            else:
                ref = reference_states[step]
                assert set(now) == set(ref)
                diffs = torch.tensor([max(rel(now[n][0], ref[n][0]) for n in ref), max(rel(now[n][1], ref[n][1]) for n in ref)])
                dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
                run["grad_max_rel_diff"].append(diffs[0].item())
                run["value_max_rel_diff"].append(diffs[1].item())
            run["params"] = len(now)
            if name == "zb_h1" and step == 1:
                saved = save_checkpoint(engine, out / "checkpoints", 2, {"step": 2}, ckpt / "hf")
        del engine
    engine = engine_for("zb_h1")
    load_checkpoint(engine, saved)
    resumed = engine.train_step(microbatches(2), token_mean_nll)
    runs["zb_h1_resumed"] = {"loss": [resumed.loss], "deferred_wgrad_ops": [resumed.deferred_wgrad_ops]}
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(runs, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
