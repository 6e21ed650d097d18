"""ModuleQueue against the plain last stage in one torchrun (gloo, PP = world size), fp32 on the CPU:

    torchrun --nproc_per_node 2 tests/workers/module_queue_worker.py CKPT OUT --chunks 3

Builds the engine from CKPT (with the distributed optimizer if asked: ModuleQueue then detaches the
parameters from DDP's contiguous buffer for each step): plain, then with ModuleQueue (saving a checkpoint after step 2),
then with ModuleQueue resumed from that checkpoint. Each trains 3 optimizer steps on 4 microbatches (the engine worker's data and loss)
and, after every step, compares on every rank each parameter's main_grad and value with the plain run's.
During the ModuleQueue run a probe before the final norm records how many bytes of the last stage's layer
weights are still on the device (0 when ModuleQueue released them all). Exports both trained models to
HF (OUT/hf_plain, OUT/hf_mq) and writes OUT/result.json (rank 0).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_worker import global_batch, masked_microbatches, parameter_state, token_mean_nll


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--distributed-optimizer", action="store_true", help="megatron.ddp_config.use_distributed_optimizer")
    p.add_argument("--recompute", default=None, metavar="METHOD:LAYERS",
                   help="full recompute, e.g. uniform:1 or block:2 (recompute_method:recompute_num_layers)")
    p.add_argument("--logprob-chunk", type=int, default=None, help="megatron.logprob_chunk_tokens (the chunked output path)")
    args = p.parse_args()
    ckpt, out = Path(args.ckpt), Path(args.out)
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.checkpointing import load_checkpoint, save_checkpoint
    from oumi_megatron.engine.state.conversion import save_hf
    from oumi_megatron.engine.wrappers import unwrap

    def engine_for(module_queue: bool):  # noqa: ANN202
        params = MegatronParams(pipeline_model_parallel_size=int(os.environ["WORLD_SIZE"]),
                                enable_module_queue=module_queue, module_queue_num_chunks=args.chunks)
        params.ddp_config.use_distributed_optimizer = args.distributed_optimizer
        params.transformer_config.recompute_granularity = None
        if args.recompute:
            method, layers = args.recompute.split(":")
            params.transformer_config.recompute_granularity = "full"
            params.transformer_config.recompute_method, params.transformer_config.recompute_num_layers = method, int(layers)
        params.logprob_chunk_tokens = args.logprob_chunk
        settings = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0, total_steps=3)
        return build_engine(ckpt, engine_layout(params), params, settings, dtype=torch.float32)

    def microbatches(step: int) -> list[dict]:
        return masked_microbatches(step, 2)  # 4 microbatches

    def max_diff(now: dict, ref: dict) -> torch.Tensor:
        assert set(now) == set(ref)
        d = torch.tensor([max((now[n][0] - ref[n][0]).abs().max().item() for n in ref),
                          max((now[n][1] - ref[n][1]).abs().max().item() for n in ref)],
                         device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        return d

    def gather(value):  # noqa: ANN001, ANN202
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    runs: dict[str, dict] = {}
    reference = []
    for name in ("plain", "module_queue"):
        bridge, engine = engine_for(name == "module_queue")
        model = unwrap(engine.model[-1])
        run = runs[name] = {"loss": [], "grad_norm": [], "active": [], "offloaded_mib": [], "grad_max_abs_diff": [],
                            "value_max_abs_diff": []}
        run["class_by_rank"] = gather(type(model).__name__)
        constructed = None
        if name == "module_queue" and model.post_process:  # the seed's constructor: GPTModel's, config-driven
            from megatron.core.models.gpt import GPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            from oumi_megatron.engine.parallel.module_queue import ModuleQueue

            built = ModuleQueue(config=model.config, transformer_layer_spec=get_gpt_layer_local_spec(),
                                vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
                                pre_process=model.pre_process, post_process=True)
            constructed = {"is_gpt_model": isinstance(built, GPTModel), "_module_queue_enabled": built._module_queue_enabled,
                           "num_chunks": built.num_chunks, "num_layers": built.num_layers}
            del built
        run["constructed"] = gather(constructed)[-1]
        run["attributes_by_rank"] = gather({k: getattr(model, k, None) for k in ("_module_queue_enabled", "num_chunks", "num_layers")})
        def resident_bytes(params) -> int:  # noqa: ANN001  (a view counts where its storage still holds it)
            return sum(p.numel() * p.element_size() for p in params
                       if p.untyped_storage().nbytes() >= (p.storage_offset() + p.numel()) * p.element_size())

        probe: list[int] = []
        if model.post_process:  # bytes of layer weights on the device when the final norm runs (training passes)
            def count(*_: object, probe: list[int] = probe, model: Any = model) -> None:  # this run's probe and model
                if torch.is_grad_enabled():
                    probe.append(resident_bytes(model.decoder.layers.parameters()))
            model.decoder.final_layernorm.register_forward_pre_hook(count)
        for step in range(3):
            r = engine.train_step(microbatches(step), token_mean_nll)
            run["loss"].append(r.loss)
            run["grad_norm"].append(r.grad_norm)
            run["active"].append(r.module_queue_active)
            run["offloaded_mib"].append(r.module_queue_offloaded_mib)
            now = parameter_state(engine)
            if name == "plain":
                reference.append(now)
            else:
                d = max_diff(now, reference[step])
                run["grad_max_abs_diff"].append(d[0].item())
                run["value_max_abs_diff"].append(d[1].item())
            if name == "module_queue" and step == 1:
                saved = save_checkpoint(engine, out / "checkpoints", 2, {"step": 2}, ckpt / "hf")
        run["layer_bytes_on_device_at_final_norm_by_rank"] = gather(sorted(set(probe)))
        run["layer_bytes_by_rank"] = gather(sum(p.numel() * p.element_size() for p in model.decoder.layers.parameters()))
        run["output_bytes_by_rank"] = gather(model.output_layer.weight.numel() * model.output_layer.weight.element_size()
                                             if model.post_process else 0)
        run["all_resident_after_step"] = all(gather(resident_bytes(model.parameters()) ==
                                                    sum(p.numel() * p.element_size() for p in model.parameters())))
        probe_ids = global_batch(99)[:4]
        lp = engine.compute_logprobs([{"input_ids": probe_ids[:2]}, {"input_ids": probe_ids[2:]}])
        run["logprobs"] = torch.cat(lp).tolist()
        save_hf(bridge, engine.model, ckpt / "hf", out / f"hf_{'mq' if name == 'module_queue' else 'plain'}")
        del engine, bridge
    _, engine = engine_for(True)
    load_checkpoint(engine, saved)
    resumed = engine.train_step(microbatches(2), token_mean_nll)
    runs["module_queue_resumed"] = {"loss": [resumed.loss], "active": [resumed.module_queue_active]}
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(runs, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
