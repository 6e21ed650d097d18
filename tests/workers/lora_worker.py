"""LoRA on the engine under several layouts in one 2-rank world (torchrun, gloo, fp32), recorded for tests/test_lora.py.

    torchrun --nproc_per_node 2 tests/workers/lora_worker.py WORK
    python tests/workers/lora_worker.py WORK --gpu     # one rank, bf16 on the GPU (tests/test_gpu.py)

Builds a tiny Qwen2 model (WORK/hf) and converts it once. Then:
- ``dp2`` (the reference: TP 1, DP 2, the distributed optimizer): LoRA on every linear layer (r 8, alpha 16), the
  adapters set to seeded random values (Bridge starts B at zero, which would hide a wrong adapter); saved as a
  checkpoint of the adapters alone (WORK/adapters) and exported three ways (WORK/dp2_<mode>: peft_save_mode
  adapter_only, adapter_and_base_model, merged); the logprobs of a fixed batch with the adapters on and switched off;
  one Adam step, after which every base weight must be bit-identical and the optimizer must hold the adapters alone;
  and, before the step, the adapter output in one GEMM (engine/peft.py) against Bridge's own forward (``one_gemm``).
- ``tp2``, ``tp2_sp``, ``pp2``, ``pp2_vpp2``: the same adapters loaded from WORK/adapters (resharded by
  Megatron-Core's distributed checkpointing); their logprobs, their adapter export, and one Adam step on the same
  full batch (DP 1 in each: the loss and the updated adapters must agree across these layouts).
- ``canonical``: LoRA on q_proj and v_proj alone (PEFT's default for Llama), Bridge's canonical form (an adapter per
  HF projection), exported for PEFT; and the same adapters under TP 2 (``canonical_tp2``).
- In every layout, ``merged``: the logprobs with the adapters merged into the base (``adapters_merged``, the embedded
  backend's rollouts under ``lora_sync: merged``) and the base restored after; in ``dp2`` also the embedded backend's
  greedy rollouts under ``lora_sync`` merged and adapter.
With ``--gpu`` (one rank, bf16, CUDA): the reference on one rank (``dp1``) and ``canonical``, no other layout.
Rank 0 writes WORK/result.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

IDS = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(11))


def nll(logprobs: torch.Tensor, batch: dict) -> tuple:
    lp = logprobs[:, :-1]
    return -lp.sum(), torch.tensor(lp.numel(), dtype=torch.int), {}


def one_gemm_against_bridge(engine) -> dict:  # noqa: ANN001
    """The engine's LoRA forward (the adapter output in one ``addmm``, engine/peft.py) against Megatron-Bridge's own
    on the same model and batch: the largest logit and adapter-gradient differences, the gradients' size, and the
    aten ops each forward dispatches (the fused one must drop the multiply and the add of every adapted layer)."""
    from megatron.bridge.peft.lora_layers import LoRALinear
    from torch.utils._python_dispatch import TorchDispatchMode

    from oumi_megatron.engine.wrappers import unwrap

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    model = unwrap(engine.model[0])
    adapters = [p for p in model.parameters() if p.requires_grad]
    ids = IDS[:2].to(engine.device)
    position = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def run() -> tuple:
        logits = model(input_ids=ids, position_ids=position, attention_mask=None)
        grads = torch.autograd.grad(logits.float().logsumexp(-1).mean(), adapters)
        with torch.no_grad(), Ops() as ops:
            model(input_ids=ids, position_ids=position, attention_mask=None)
        return logits.detach(), grads, ops.names

    model.eval()  # no dropout either way (there is none: LoRA dropout 0)
    fused = LoRALinear.forward
    one = run()
    LoRALinear.forward = LoRALinear._oumi_unfused_forward
    try:
        bridge = run()
    finally:
        LoRALinear.forward = fused
    adapted = sum(isinstance(m, LoRALinear) for m in model.modules())
    return {"adapted_layers": adapted, "logit_diff": (one[0] - bridge[0]).abs().max().item(),
            "logit_scale": bridge[0].abs().max().item(),
            "grad_diff": max((a - b).abs().max().item() for a, b in zip(one[1], bridge[1], strict=True)),
            "grad_scale": max(b.abs().max().item() for b in bridge[1]),
            "ops": {name: {op: names.count(op) for op in ("addmm", "mul", "add", "mm")} | {"all": len(names)}
                    for name, names in (("one_gemm", one[2]), ("bridge", bridge[2]))}}


def merged_against_adapters(engine, logprobs, rollouts: bool = False) -> dict:  # noqa: ANN001
    """Inside ``adapters_merged`` (the embedded backend's rollouts under ``lora_sync: merged``): the logprobs (to equal
    the adapters' own), the bytes kept aside, how far the base moved, and whether every base weight came back
    bit-identical. With ``rollouts``: greedy completions of the embedded backend under ``lora_sync`` merged and adapter,
    and whether the merged one restored the base."""
    from oumi_megatron.engine.peft import adapters_merged
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    def base() -> dict:  # keyed by chunk too: virtual pipeline stages repeat the names
        return {(i, n): p.detach().clone() for i, c in enumerate(engine.model) for n, p in c.named_parameters()
                if not p.requires_grad}

    before = base()
    with adapters_merged(engine.peft, engine.model) as kept:
        out = {"logprobs": logprobs(engine), "kept_bytes": kept,
               "base_moved": max((p - before[n]).abs().max().item() for n, p in base().items())}
    out["restored"] = all(torch.equal(p, before[n]) for n, p in base().items())
    out["adapted_bytes"] = sum(p.numel() * p.element_size() for (_, n), p in before.items()
                               if n.endswith("to_wrap.weight"))
    if rollouts:
        backend = MegatronRolloutBackend(engine, 300, path="static")
        prompts = [IDS[0, :6].tolist(), IDS[1, :9].tolist()]
        params = SamplingParams(max_new_tokens=8, greedy=True)
        for mode in ("merged", "adapter"):
            engine.params.lora_sync = mode
            got = backend.generate(prompts, params, 2, seed=0)
            out[f"rollout_{mode}"] = [[r.completion_ids, r.logprobs] for group in got for r in group]
        engine.params.lora_sync = "merged"
        out["restored_after_rollouts"] = all(torch.equal(p, before[n]) for n, p in base().items())
    return out


def main() -> None:
    import torch.distributed as dist

    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import init_distributed
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.peft import adapters_off
    from oumi_megatron.engine.state.checkpoint_io import load_model, save_model
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron, load_bridge_for_checkpoint
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter, save_policy
    from oumi_megatron.engine.wrappers import unwrap
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = Path(sys.argv[1])
    dtype = torch.bfloat16 if "--gpu" in sys.argv[2:] else torch.float32
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_name = f"dp{world}"
    if rank == 0:
        build_tiny_model(work / "hf", arch="qwen2")
    dist.barrier()
    time.sleep(0.2)

    def params_for(tp: int = 1, pp: int = 1, vpp: int | None = None, sp: bool = False) -> MegatronParams:
        p = MegatronParams()
        p.transformer_config.recompute_granularity = None
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
        p.virtual_pipeline_model_parallel_size, p.sequence_parallel = vpp, sp
        p.micro_batch_size = 2
        return p

    dp2 = params_for()
    ckpt = convert_hf_to_megatron(work / "hf", work / "mc", engine_layout(dp2, world_size=world), dp2, dtype=dtype)
    every = LoraSettings(8, 16.0, 0.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), False, "adapter_only")
    result: dict = {}

    def build(params: MegatronParams, lora: LoraSettings):  # noqa: ANN202
        layout = engine_layout(params, world_size=world)
        _, engine = build_engine(ckpt, layout, params, OptimSettings(lr=1e-2, total_steps=10), dtype, lora=lora)
        bridge = load_bridge_for_checkpoint(ckpt)
        return engine, HFWeightExporter(bridge, engine.model, ckpt / "hf", peft=engine.peft, base_model=str(work / "hf"))

    def randomize(engine) -> None:  # noqa: ANN001
        with torch.no_grad():
            for c in engine.model:
                for name, p in unwrap(c).named_parameters():
                    if p.requires_grad:
                        g = torch.Generator().manual_seed(sum(map(ord, name)))
                        p.copy_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))

    def logprobs(engine) -> list:  # noqa: ANN001
        batch = [{"input_ids": IDS[:2]}, {"input_ids": IDS[2:]}]
        return torch.cat(engine.compute_logprobs(batch))[:, :-1].float().tolist()

    def adapter_tensors(weights) -> dict:  # noqa: ANN001
        return {k: v.float().tolist() for k, v in weights.adapters().tensors.items()}

    def save_adapters(engine, name: str) -> None:  # noqa: ANN001 - a checkpoint of the adapters alone, WORK/name
        if rank == 0:
            (work / name).mkdir()
        dist.barrier()
        save_model(engine.model, work / name, adapters_only=True)

    def save_all(weights, name: str) -> None:  # noqa: ANN001
        for mode in ("adapter_only", "adapter_and_base_model", "merged"):
            save_policy(weights, work / f"{name}_{mode}", mode)

    # -- the reference: TP 1 x DP 2 -------------------------------------------------------------------------------
    engine, weights = build(dp2, every)
    randomize(engine)
    save_adapters(engine, "adapters")
    save_all(weights, ref_name)
    base_before = {n: p.detach().clone() for c in engine.model for n, p in c.named_parameters() if not p.requires_grad}
    trainable = [p for c in engine.model for p in c.parameters() if p.requires_grad]
    ref = {"logprobs": logprobs(engine), "one_gemm": one_gemm_against_bridge(engine)}
    with adapters_off(engine.peft, engine.model):
        ref["logprobs_adapters_off"] = logprobs(engine)
    ref["merged"] = merged_against_adapters(engine, logprobs, rollouts=True)
    ref["logprobs_back_on"] = logprobs(engine)
    engine.train_step([{"input_ids": IDS[2 * rank:2 * rank + 2]}], nll)  # each DP rank its half
    held = torch.tensor([sum(p.numel() for g in engine.optimizer.optimizer.param_groups for p in g["params"])],
                        dtype=torch.float64, device=engine.device)  # NCCL reduces device tensors alone
    dist.all_reduce(held)  # the distributed optimizer's fp32 shards over DP
    changed = [n for c in engine.model for n, p in c.named_parameters()
               if not p.requires_grad and not torch.equal(p, base_before[n])]
    ref.update({"base_params": sum(t.numel() for t in base_before.values()),
                "adapter_params": sum(p.numel() for p in trainable),
                "optimizer_params": float(held.item()), "base_changed": changed,
                "base_with_grad": [n for c in engine.model for n, p in c.named_parameters()
                                   if not p.requires_grad and (p.grad is not None or hasattr(p, "main_grad"))],
                "adapters_after_step": adapter_tensors(weights)})
    result[ref_name] = ref

    # -- the same adapters under other layouts -----------------------------------------------------------------
    layouts = {"tp2": params_for(tp=2), "tp2_sp": params_for(tp=2, sp=True), "pp2": params_for(pp=2),
               "pp2_vpp2": params_for(pp=2, vpp=2)}
    for name, params in layouts.items() if world == 2 else ():
        engine, weights = build(params, every)
        load_model(engine.model, work / "adapters", adapters_only=True)
        entry = {"logprobs": logprobs(engine), "adapters": adapter_tensors(weights),
                 "rank_adapter_params": sum(p.numel() for c in engine.model for p in c.parameters() if p.requires_grad)}
        with adapters_off(engine.peft, engine.model):
            entry["logprobs_adapters_off"] = logprobs(engine)
        entry["merged"] = merged_against_adapters(engine, logprobs)
        if name == "tp2":
            save_all(weights, name)
        r = engine.train_step([{"input_ids": IDS[:2]}, {"input_ids": IDS[2:]}], nll)
        entry["loss"] = float(r.loss)
        entry["adapters_after_step"] = adapter_tensors(weights)
        result[name] = entry

    # -- canonical LoRA: q_proj and v_proj alone ---------------------------------------------------------------
    canonical = LoraSettings(4, 8.0, 0.0, ("linear_q", "linear_v"), True, "adapter_only")
    engine, weights = build(dp2, canonical)
    randomize(engine)
    save_adapters(engine, "canonical_adapters")
    save_all(weights, "canonical")
    result["canonical"] = {"logprobs": logprobs(engine), "merged": merged_against_adapters(engine, logprobs),
                           "trainable": sorted({n.split("layers.0.")[-1] for c in engine.model
                                                for n, p in c.named_parameters() if p.requires_grad and "layers.0." in n})}
    if world == 2:
        engine, weights = build(params_for(tp=2), canonical)  # each rank holds half of the heads
        load_model(engine.model, work / "canonical_adapters", adapters_only=True)
        result["canonical_tp2"] = {"logprobs": logprobs(engine), "adapters": adapter_tensors(weights),
                                   "merged": merged_against_adapters(engine, logprobs)}
    if rank == 0:
        (work / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
