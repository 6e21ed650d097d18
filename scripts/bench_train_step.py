"""Throughput, MFU and peak memory of one MegatronEngine training step for a ~0.9B dense model.

    python scripts/bench_train_step.py --out result.json                          # 1 GPU
    torchrun --nproc_per_node 2 scripts/bench_train_step.py --tp 2 --out r.json   # TP=2
    torchrun --nproc_per_node 2 scripts/bench_train_step.py --pp 2 --out r.json   # PP=2

Model (``--shape 0.8b``, default): Llama-style, 16 layers, hidden 2048, 16 heads (8 KV heads), SwiGLU 5632, vocab 32000, bf16,
random init (no weights read); ``--shape 8b`` has Llama-3-8B's dimensions (32 layers, hidden 4096,
SwiGLU 14336, 32 heads / 8 KV heads, vocab 128256). Batch: micro batch 2 x 8 microbatches x seq 2048 = 32,768 tokens/step.
FLOPs/token = 6 x (matmul parameters, output layer included) + 6 x layers x seq x hidden (causal
attention scores and values, forward + backward). MFU = achieved FLOP/s per GPU / peak dense bf16
(989 TFLOP/s for H100 SXM and H200: bench_common.CARDS). scripts/gpu_check.py runs all three; ``report`` prints
its table of the result files (docs/benchmarks.md).

    python scripts/bench_train_step.py --hf-reference --attention local   # + plain transformers, same call

``--set FIELD=VALUE`` sets a ``megatron.transformer_config`` field (e.g. ``apply_rope_fusion=false``)
or, with a section, another ``megatron:`` field (``optimizer_config.fused_kernels=false``),
``--logprob-chunk 0`` takes the full-logits path, ``--profile FILE`` writes one step's kernels (a markdown table:
calls, time, share; their sum against the step's time).

``--hf-reference`` first times transformers' LlamaForCausalLM on the same shape and batches (SDPA
attention, bf16 weights, fused AdamW, gradient accumulation over the same microbatches) and reports
the engine's tokens/s as a ratio of it. Memory for both: peak, state (allocated right after the
optimizer step: weights, gradients, optimizer state; Megatron keeps fp32 main grads and master
weights, HF's bf16 AdamW does not) and activations = peak - state.
"""

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

import bench_common


def layer_matmul_params(cfg) -> int:  # noqa: ANN001
    """Parameters of one transformer layer's linear layers that a token passes through (q, o, k, v and the
    SwiGLU MLP; MoE: the router and the experts each token is routed to)."""
    h = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = head_dim * cfg.num_attention_heads, head_dim * cfg.num_key_value_heads
    if getattr(cfg, "num_experts", 0):
        mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    return h * q * 2 + h * kv * 2 + mlp


def flops_per_token(cfg, seq: int) -> float:  # noqa: ANN001
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    matmul_params = layers * layer_matmul_params(cfg) + h * cfg.vocab_size
    return 6.0 * matmul_params + 6.0 * layers * seq * h


def hf_reference(cfg, batches: list[dict], args, peak_tflops: float) -> dict:  # noqa: ANN001
    """transformers' LlamaForCausalLM on the same shape and microbatches: SDPA attention, bf16 weights,
    fused AdamW, the microbatches' gradients accumulated into one optimizer step (median step time)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU (a CPU init of 0.8B parameters takes a while)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inputs = [b["input_ids"].cuda() for b in batches]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, state = [], 0.0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        for ids in inputs:
            (model(input_ids=ids, labels=ids).loss / len(inputs)).backward()
        optimizer.step()
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated() / 2**30  # weights, gradients, optimizer state
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = sum(ids.numel() for ids in inputs)
    tflops = flops_per_token(cfg, args.seq) * tokens / step_s / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30
    result = {"path": "transformers LlamaForCausalLM (sdpa, fused AdamW)", "step_s": round(step_s, 4),
              "tokens_per_s": round(tokens / step_s, 1), "tflops": round(tflops, 1), "mfu": round(tflops / peak_tflops, 4),
              "peak_mem_gib": round(peak, 2), "state_mem_gib": round(state, 2), "activation_mem_gib": round(peak - state, 2)}
    del model, optimizer, inputs
    gc.collect()
    torch.cuda.empty_cache()  # the engine's peak is measured on its own
    return result


def plan_and_overhead(cfg, params, layout, args) -> dict:  # noqa: ANN001
    """oumi_megatron.plan's estimate of each stage's peak for this run (to compare with peak_mem_gib_by_rank), and
    what the GPU holds outside PyTorch's allocator (CUDA context, NCCL, cuBLAS workspaces: the plan's overhead)."""
    import torch.distributed as dist

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.standalone import StandaloneConfig
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import estimate_memory

    shape = ModelShape.from_config_dict(cfg.to_dict(), args.shape)
    # the plan of a run whose sequences are this benchmark's: seq tokens each; it generates nothing, so no decoder
    # cache is kept beside training (rollout_cuda_graphs_kept: 0)
    planned = dataclasses.replace(params, rollout_cuda_graphs_kept=0)
    config = StandaloneConfig(megatron=planned, grpo=MegatronGrpoParams(max_prompt_length=args.seq, max_completion_length=0))
    plan = estimate_memory(config, shape, layout)
    free, total = torch.cuda.mem_get_info()
    outside = torch.tensor([(total - free - torch.cuda.memory_reserved()) / 2**30,
                            (torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()) / 2**30], device="cuda")
    dist.all_reduce(outside, op=dist.ReduceOp.MAX)
    return {"plan_peak_gib_by_stage": [round(x, 2) for x in plan.by_stage], "outside_allocator_gib": round(outside[0].item(), 2),
            "allocator_reserve_gib": round(outside[1].item(), 2)}


def profile_step(step, path: str, step_ms: float) -> None:  # noqa: ANN001
    """One more step under the profiler: its kernels by time, against the median step's ``step_ms``, to ``path``
    (a markdown table, bench_common.kernel_table)."""
    profiled = bench_common.kernel_profile(step, per=1, top=45)
    with open(path, "w") as f:
        f.write(bench_common.kernel_table(profiled, step_ms, "one training step: ") + "\n")


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="0.8b", choices=sorted(bench_common.TRAIN_SHAPES),
                   help="8b: Llama-3-8B dimensions (needs 2 x 141 GB GPUs, e.g. --tp 2)")
    p.add_argument("--layers", type=int, default=None, help="override the shape's number of layers")
    p.add_argument("--vocab", type=int, default=None, help="override the shape's vocabulary (e.g. 151936, Qwen2.5's)")
    p.add_argument("--grpo-loss", action="store_true",
                   help="the GRPO loss (grpo/loss.py, default grpo: settings) on policy with the entropy output, as the "
                        "loop's first update runs it: the last half of each row is the completion")
    p.add_argument("--module-queue", type=int, default=0, metavar="CHUNKS",
                   help="megatron.enable_module_queue with this many output-layer chunks (0: off)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="megatron.expert_model_parallel_size (--shape moe; DP = GPUs / (TP x PP x CP))")
    p.add_argument("--cp", type=int, default=1,
                   help="megatron.context_parallel_size (K/V all-gathered, engine/parallel/context_parallel.py)")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron.sequence_parallel (TP > 1)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb_h1"], help="megatron.pipeline_schedule (PP > 1)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "local"],
                   help="megatron.transformer_config.attention_backend")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a megatron.transformer_config field, e.g. gradient_accumulation_fusion=false, or "
                        "SECTION.FIELD=VALUE, e.g. optimizer_config.fused_kernels=false (repeatable)")
    p.add_argument("--logprob-chunk", type=int, default=None, help="megatron.logprob_chunk_tokens (0 = full logits)")
    p.add_argument("--compile-layers", action="store_true",
                   help="experiment: torch.compile each transformer layer (measured slower on an H200: more host time per step)")
    p.add_argument("--profile", default="", help="write one step's kernels to this file (markdown)")
    p.add_argument("--hf-reference", action="store_true", help="also time plain transformers (1 GPU)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.hf_reference and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--hf-reference times one GPU: run it without torchrun")

    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.kernels.fusions import FUSIONS
    from oumi_megatron.engine.optimizer import OptimSettings, torch_optimizers
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.parallel.schedules import SCHEDULES

    params = MegatronParams(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            context_parallel_size=args.cp, sequence_parallel=args.sequence_parallel,
                            expert_model_parallel_size=args.ep)
    params.transformer_config.recompute_granularity = None if args.recompute == "none" else args.recompute
    params.transformer_config.attention_backend = args.attention
    params.logprob_chunk_tokens = args.logprob_chunk
    params.pipeline_schedule = args.schedule
    params.enable_module_queue = args.module_queue > 0
    params.module_queue_num_chunks = max(args.module_queue, 1)
    for item in args.set:
        key, value = item.split("=", 1)
        parsed = {"true": True, "false": False, "null": None}.get(value.lower(), _number_or_text(value))
        *path, field = key.split(".")  # "x" is transformer_config.x (else megatron.x); "optimizer_config.x" its section
        target = params
        top_level = not path and not hasattr(params.transformer_config, field) and hasattr(params, field)
        for part in path or ([] if top_level else ["transformer_config"]):
            target = getattr(target, part)
        setattr(target, field, parsed)
    cfg = bench_common.hf_config(args.shape, args.seq, args.layers)
    if args.vocab:
        cfg.vocab_size = args.vocab
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, cfg.vocab_size, (args.mbs, args.seq), generator=g)} for _ in range(args.microbatches)]
    if args.grpo_loss:
        for b in batches:
            b["completion_mask"] = torch.zeros(args.mbs, args.seq)
            b["completion_mask"][:, args.seq // 2 - 1:-1] = 1.0  # position t scores token t + 1
            b["advantages"] = torch.randn(args.mbs, generator=g)
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (args.tp * args.pp * args.cp)  # each DP rank runs these microbatches
    tokens = args.mbs * args.microbatches * args.seq * dp
    name = bench_common.card_name()
    peak = bench_common.peak_bf16_tflops(name)
    hf = hf_reference(cfg, batches, args, peak) if args.hf_reference else None

    # the layout of these microbatches, resolved once (the engine takes it; the plan reads its batch sizes)
    params.micro_batch_size, params.global_batch_size = args.mbs, args.mbs * args.microbatches * dp
    layout = engine_layout(params)
    _, engine = build_engine_from_hf_config(cfg, layout, params, OptimSettings(lr=1e-5, total_steps=100), dtype=torch.bfloat16)

    def loss_fn(logprobs: torch.Tensor, batch: dict) -> tuple:
        return -logprobs.sum(), torch.tensor(logprobs.numel()), {}

    if args.grpo_loss:
        from oumi_megatron.config.grpo_params import MegatronGrpoParams
        from oumi_megatron.grpo.loss import make_grpo_loss_fn

        loss_fn = make_grpo_loss_fn(MegatronGrpoParams(max_completion_length=args.seq // 2))  # noqa: F811
    train_step = functools.partial(engine.train_step, with_entropy=args.grpo_loss)

    if args.compile_layers:
        from oumi_megatron.engine.wrappers import unwrap

        for chunk in engine.model:
            for layer in unwrap(chunk).decoder.layers:
                layer.compile()

    # The peak of the passes (forward/backward, ModuleQueue's step bracket) and of the optimizer step apart
    peaks = {"passes": 0.0, "optimizer": 0.0}
    optimizer_step = engine.optimizer.step

    def step_with_peaks():  # noqa: ANN202
        peaks["passes"] = max(peaks["passes"], torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        out = optimizer_step()
        peaks["optimizer"] = max(peaks["optimizer"], torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        return out

    engine.optimizer.step = step_with_peaks
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        r = train_step(batches, loss_fn)
        torch.cuda.synchronize()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if args.profile:
        profile_step(lambda: train_step(batches, loss_fn), args.profile, 1e3 * sorted(times)[len(times) // 2])
    phase_ms = None
    # one more (untimed) step with CUDA events around each F, B and W, per stage
    if SCHEDULES.get(layout.pipeline_schedule).defers_weight_gradients:
        from oumi_megatron.engine.parallel.zero_bubble import PhaseTimes

        PhaseTimes.enabled = True
        train_step(batches, loss_fn)
        PhaseTimes.enabled = False
        phase_ms = [None] * dist.get_world_size()
        dist.all_gather_object(phase_ms, {k: round(v, 2) for k, v in PhaseTimes.mean_ms().items()})
    world = dist.get_world_size()
    step_s = sorted(times)[len(times) // 2]
    tflops_per_gpu = flops_per_token(cfg, args.seq) * tokens / step_s / world / 1e12
    # state = what stays allocated after the step (weights, fp32 main grads, master weights, Adam moments)
    mem = torch.tensor([max(peaks.values(), default=0.0), torch.cuda.memory_allocated() / 2**30,
                        peaks["passes"], peaks["optimizer"]], device="cuda")
    mem_by_rank = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(mem_by_rank, mem)  # pipeline stages differ: the first holds the most microbatches, the last the logits
    mem = torch.stack(mem_by_rank).amax(0)
    from oumi_megatron.engine.kernels.attention import core_attention_name
    from oumi_megatron.engine.wrappers import unwrap

    core = core_attention_name(engine.model[0])
    config = unwrap(engine.model[0]).config
    fusions = [name for name in FUSIONS if getattr(config, name, False)]
    chunked = engine.chunks_logprobs(args.mbs * args.seq)
    if any(g.get("fused") for o in torch_optimizers(engine.optimizer) for g in o.param_groups):
        fusions.append("fused_adamw")
    result = {
        "layout": f"TP{args.tp} PP{args.pp}" + (f" CP{args.cp}" if args.cp > 1 else "") + (f" EP{args.ep}" if args.ep > 1 else "")
                  + (f" DP{dp}" if dp > 1 else "") + (" SP" if args.sequence_parallel else "")
                  + (f" ({args.shape})" if args.shape != "0.8b" else "")
                  + (f" ({cfg.num_hidden_layers} layers)" if args.layers else ""), "gpus": world,
        "schedule": engine.schedule, "deferred_wgrad_ops": r.deferred_wgrad_ops, "card": name, "seq": args.seq,
        "attention": core, "fusions": "+".join(fusions) or "none",
        "logprob_chunk_tokens": args.logprob_chunk, "logprobs": "chunked" if chunked else "full logits",
        "cuda_graphs": params.transformer_config.cuda_graph_impl, "tokens_per_step": tokens, "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1), "tokens_per_s_per_gpu": round(tokens / step_s / world, 1),
        "tflops_per_gpu": round(tflops_per_gpu, 1), "mfu": round(tflops_per_gpu / peak, 4),
        "peak_mem_gib": round(mem[0].item(), 2), "state_mem_gib": round(mem[1].item(), 2),
        "activation_mem_gib": round(mem[0].item() - mem[1].item(), 2),
        "peak_mem_gib_by_rank": [round(m[0].item(), 2) for m in mem_by_rank],
        "passes_peak_gib_by_rank": [round(m[2].item(), 2) for m in mem_by_rank],
        "optimizer_peak_gib_by_rank": [round(m[3].item(), 2) for m in mem_by_rank],
        "recompute": args.recompute, "final_loss": round(r.loss, 4),
        "params_b": round(flops_per_token(cfg, 0) / 6e9, 3),
    }
    result["settings"] = args.set
    result.update(vocab=cfg.vocab_size, loss="grpo (on policy, with entropy)" if args.grpo_loss else "sum of logprobs",
                  forward_backward_s=round(r.forward_backward_s, 4), optimizer_s=round(r.optimizer_s, 4))
    # ModuleQueue: chunks (0 = off), MiB released per step, and seed 000's estimate of its saving on the last
    # stage, N x layer_size - V x H / num_chunks (bf16)
    h, v = cfg.hidden_size, cfg.vocab_size
    layer_bytes = 2 * (layer_matmul_params(cfg) + 2 * h)  # bf16, the linear layers and the two norms
    result["module_queue_chunks"] = args.module_queue
    result["module_queue_offloaded_mib"] = round(r.module_queue_offloaded_mib, 1)
    result["seed_formula_saving_gib"] = round((cfg.num_hidden_layers // args.pp * layer_bytes
                                               - 2 * v * h / max(args.module_queue, 1)) / 2**30, 2)
    result.update(plan_and_overhead(cfg, params, layout, args))
    if phase_ms is not None:
        result["phase_ms_per_microbatch_by_rank"] = phase_ms  # F, B (input gradients), W (deferred weight gradients)
    if hf is not None:
        result["hf_reference"] = hf
        result["speedup_vs_hf"] = round(result["tokens_per_s"] / hf["tokens_per_s"], 3)
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the tables scripts/gpu_check.py prints last, from the result files of its runs ------------------------------------
def _layout_table(rows: list[dict]) -> list[str]:
    """Every run's row (and the HF reference's, where a run timed it), then each one-GPU run against HF."""
    lines = ["| layout | attention | fusions | GPUs | card | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | activations GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        hf = r.get("hf_reference")
        if hf:
            lines.append(f"| HF transformers | sdpa | - | 1 | {r['card']} | {hf['tokens_per_s']:.0f} | {hf['tokens_per_s']:.0f} "
                         f"| {hf['tflops']} | {100*hf['mfu']:.1f}% | {hf['peak_mem_gib']} | {hf['activation_mem_gib']} |")
        schedule = f" {r['schedule']}" if r.get("schedule") not in (None, "none") else ""
        fusions = (f"{r.get('fusions', '?')}{' + chunked logprobs' if r.get('logprobs') == 'chunked' else ''}"
                   f"{' + CUDA graphs' if r.get('cuda_graphs') == 'local' else ''}")
        lines.append(f"| {r['layout']} seq {r.get('seq', '?')}{schedule} | {r.get('attention', '?')} | {fusions} | {r['gpus']} "
                     f"| {r['card']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']} "
                     f"| {100*r['mfu']:.1f}% | {r['peak_mem_gib']} | {r.get('activation_mem_gib', '?')} |")
    hf = next((r["hf_reference"] for r in rows if r.get("hf_reference")), None)
    if hf:
        ratios = (f"{r['layout']} {r.get('fusions', '?')}: {r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" for r in rows if r["gpus"] == 1)
        lines.append("tokens/s vs HF (same call): " + ", ".join(ratios))
    return lines


def _schedule_table(rows: list[dict]) -> list[str]:
    """ZB-H1 against 1F1B: the median of each (layout, tokens per step, schedule), then the ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("schedule") in ("1f1b", "zb_h1"):
            groups.setdefault((r["layout"], r["tokens_per_step"], r["schedule"]), []).append(r)
    if not groups:
        return []
    lines = ["| layout | tokens/step | schedule | runs | tokens/s (median) | vs 1F1B | peak GiB by stage | deferred W/step "
             "| F / B / W ms per microbatch by stage |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (layout, tokens, sched), rs in sorted(groups.items()):
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        base = groups.get((layout, tokens, "1f1b"))
        ratio = tps / statistics.median(r["tokens_per_s"] for r in base) if base else float("nan")
        phases = "; ".join("/".join(str(p.get(k, "-")) for k in "FBW") for p in rs[-1].get("phase_ms_per_microbatch_by_rank") or [])
        stages = len(rs[0].get("peak_mem_gib_by_rank", [0]))
        peaks = " / ".join(str(max(r.get("peak_mem_gib_by_rank", [r["peak_mem_gib"]])[i] for r in rs)) for i in range(stages))
        lines.append(f"| {layout} | {tokens} | {sched} | {len(rs)} | {tps:.0f} | {ratio:.3f} | {peaks} | {rs[-1]['deferred_wgrad_ops']} "
                     f"| {phases or '-'} |")
    return lines


def _module_queue_table(mq: list[dict]) -> list[str]:
    """ModuleQueue: the last stage's peak and the step time against the run without it (same call, same settings)."""
    if not mq:
        return []
    lines = ["| layout | settings | card | ModuleQueue chunks | step s | vs off | last-stage peak GiB | vs off | saving GiB "
             "| seed formula GiB | released MiB/step | last stage: passes / optimizer peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def setting(r: dict) -> tuple:
        return r["layout"], r["tokens_per_step"], r.get("recompute"), r.get("settings", [])

    for r in sorted(mq, key=lambda r: (setting(r), r["module_queue_chunks"])):
        base = next((b for b in mq if not b["module_queue_chunks"] and setting(b) == setting(r)), None)
        last = r["peak_mem_gib_by_rank"][-1]
        b_last = base["peak_mem_gib_by_rank"][-1] if base else float("nan")
        lines.append(f"| {r['layout']} | {r['tokens_per_step'] // r['seq']} x {r['seq']} tokens, recompute {r.get('recompute')} "
                     f"{' '.join(r.get('settings') or [])} | {r['card']} | {r['module_queue_chunks'] or 'off'} | {r['step_s']} "
                     f"| {r['step_s'] / base['step_s'] if base else float('nan'):.3f} | {last} | {last / b_last:.3f} | {b_last - last:.2f} "
                     f"| {r['seed_formula_saving_gib'] if r['module_queue_chunks'] else '-'} | {r['module_queue_offloaded_mib']} "
                     f"| {r.get('passes_peak_gib_by_rank', ['-'])[-1]} / {r.get('optimizer_peak_gib_by_rank', ['-'])[-1]} |")
    return lines


def _plan_table(results_dir: Path) -> list[str]:
    """The memory plan (oumi_megatron/plan.py) against torch.cuda.max_memory_allocated of the same step: every result
    file that has the plan's figures (this script writes them into each of its runs)."""
    plans = [(p.stem, json.loads(p.read_text())) for p in sorted(results_dir.glob("*.json"))]
    plans = [(n, r) for n, r in plans if isinstance(r, dict) and r.get("plan_peak_gib_by_stage")]
    if not plans:
        return []
    lines = ["| run | card | measured peak GiB by rank | plan GiB by stage | plan / measured (max) | outside allocator GiB "
             "| allocator reserve GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in plans:
        measured, plan = r["peak_mem_gib_by_rank"], r["plan_peak_gib_by_stage"]
        lines.append(f"| {n} ({r['layout']}, seq {r['seq']}) | {r['card']} | {measured} | {plan} | {max(plan) / max(measured):.3f} "
                     f"| {r['outside_allocator_gib']} | {r['allocator_reserve_gib']} |")
    return lines


def report(results_dir: Path) -> str:
    """The markdown tables of this script's result files in ``results_dir`` (bench_*.json: every run, ZB-H1 against
    1F1B; mq_*.json: ModuleQueue; every file with plan figures: the plan against the measured peak)."""
    rows = [json.loads(p.read_text()) for p in sorted(results_dir.glob("bench_*.json"))]
    mq = [json.loads(p.read_text()) for p in sorted(results_dir.glob("mq_*.json"))]
    # the layout table's header comes even when no run wrote a row (as gpu_check has always printed it)
    tables = [_layout_table(rows), _schedule_table(rows), _module_queue_table(mq), _plan_table(results_dir)]
    return "\n\n".join("\n".join(t) for t in tables if t)


if __name__ == "__main__":
    main()
