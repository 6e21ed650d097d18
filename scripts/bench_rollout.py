"""Rollout generation on one GPU: the embedded backend's paths against transformers ``generate``, same call.

    python scripts/bench_rollout.py --shape smollm2-135m --batch 128x128 --out result.json

Shapes (random weights, bf16): SmolLM2-135M (Llama, 30 layers, hidden 576, 3 KV heads, vocab 49,152) and
Qwen2.5-1.5B (28 layers, hidden 1536, 2 KV heads, QKV bias, vocab 151,936). Batches ``ROWSxNEW``: ROWS / 8
prompts of 64 random tokens, 8 completions each (a GRPO group shares its prompt), NEW new tokens, no EOS
(every row runs to the end), temperature 1.

Paths (``--paths``):
- ``graphs``: the static-cache decoder with CUDA-graph decode steps (rollout/decoding/, the default on CUDA);
- ``graphs_attention``: ``graphs`` with the decode attention kernel as well (``megatron.rollout_decode_kernels: true``:
  attention over the slots each row has reached, in place of SDPA over every slot);
- ``graphs_torch``: ``graphs`` without the decode step's own kernels (``megatron.rollout_decode_kernels: false``:
  torch's sampling ops, SDPA over every cache slot);
- ``static``: the same decoder, eager decode steps (``megatron.rollout_cuda_graphs: false``);
- ``schedule``: the embedded backend before issue 30 (Megatron-Core's forward-only schedule per token);
- ``hf``: ``transformers`` ``generate`` (plain, SDPA attention) on an HF model of the same shape.

For each: generated tokens/s (wall time of the call, capture included), decode ms per step, prefill s, peak
memory above the model, and the fraction of the HBM roofline: (weights + the KV cache a step must read) /
bandwidth over the measured decode step. Greedy parity (bf16): the static paths' greedy tokens against the
schedule path's on the same prompts, the first position where a row differs and the logprob gap there. With both
``graphs`` and ``graphs_torch``: the sampled logprobs of ``graphs``, ``graphs_attention`` and ``graphs_torch`` against
the trainer's recomputation (``trainer_gaps``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

import bench_common


def bandwidth() -> float | None:
    return bench_common.hbm_bandwidth(bench_common.card_name())


def measure(fn: Any) -> tuple[Any, float, float]:
    """(result, seconds, peak GiB above what was allocated before)."""
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) / 2**30


def engine_paths(cfg: Any, prompts: list[list[int]], n: int, new: int, paths: list[str], repeat: int,
                 profile: bool = False) -> tuple[dict, dict]:
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import kv_cache_bytes_per_token
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    params = MegatronParams()
    params.transformer_config.recompute_granularity = None
    _, engine = build_engine_from_hf_config(
        cfg, engine_layout(params), params, OptimSettings(lr=1e-5, total_steps=10), dtype=torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for c in engine.model for p in c.parameters())
    shape = ModelShape.from_config_dict(cfg.to_dict(), "bench_rollout")
    kv_token = kv_cache_bytes_per_token(shape, shape.num_layers)
    rows, width = len(prompts) * n, len(prompts[0])
    # a decode step must read every weight once and each row's keys/values so far (mean over the steps)
    step_bytes = weight_bytes + rows * kv_token * (width + new / 2)
    bw = bandwidth()
    sampling = SamplingParams(max_new_tokens=new, pad_token_id=0, temperature=1.0)
    results: dict[str, dict] = {}
    backends = {"graphs": ("static", "true", "auto"), "graphs_attention": ("static", "true", "true"),
                "graphs_torch": ("static", "true", "false"),
                "static": ("static", "false", "auto"), "schedule": ("schedule", "false", "auto")}
    for name in [p for p in paths if p in backends]:
        path, graphs, kernels = backends[name]
        backend = MegatronRolloutBackend(engine, cfg.vocab_size, seed=0, path=path, cuda_graphs=graphs,
                                         decode_kernels=kernels)
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4, pad_token_id=0), n)  # warm-up (kernels, allocator)
        best = None
        for _ in range(repeat):
            groups, seconds, peak = measure(lambda b=backend: b.generate(prompts, sampling, n, seed=1))
            tokens = sum(len(r.completion_ids) for g in groups for r in g)
            stats = backend.last_stats
            assert stats is not None
            row = {"tokens_per_s": tokens / seconds, "seconds": seconds, "decode_ms_per_step": stats.decode_ms_per_step,
                   "prefill_s": stats.prefill_s, "peak_gib": peak, "kv_cache_gib": stats.kv_cache_bytes / 2**30,
                   "capture_s": stats.capture_s, "path": stats.path}
            if bw:
                row["hbm_roofline_fraction"] = step_bytes / bw / (stats.decode_ms_per_step / 1e3)
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
        results[name] = best  # type: ignore[assignment]
    profiled = profile_decode(engine, cfg, prompts, n) if profile else None
    parity = greedy_parity(engine, cfg, prompts, n, min(new, 64)) if {"graphs", "schedule"} <= set(paths) else {}
    if {"graphs", "graphs_torch"} <= set(paths):
        parity.update(trainer_gaps(engine, cfg, prompts, min(new, 64)))
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    extra = {**parity, "weight_gib": weight_bytes / 2**30, "step_bytes_gib": step_bytes / 2**30}
    if profiled is not None:
        extra["decode_profile"] = profiled
    return results, extra


def profile_decode(engine: Any, cfg: Any, prompts: list[list[int]], n: int, steps: int = 16) -> dict[str, Any]:
    """The kernels of one decode step after the prompts' prefill (bench_common.kernel_profile): ``steps`` eager steps, and
    on a GPU as many replays of the step's CUDA graph with their measured time (every slot attended, as a graph does)."""
    from oumi_megatron.rollout.decoding.generation_mode import generation_mode
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    decoder = MegatronRolloutBackend(engine, cfg.vocab_size, path="static", cuda_graphs="auto", cuda_graphs_kept=0).decoder
    assert decoder is not None, "the static-cache decoder covers the benchmark's shapes"
    # room for the eager steps, the capture's eager step and the replays: no step writes past the cache's last slot
    sampling = SamplingParams(max_new_tokens=2 * steps + 4, pad_token_id=0)
    generator = torch.Generator(device=engine.device).manual_seed(0)
    out: dict[str, Any] = {}
    with generation_mode(engine):
        run, _ = decoder.prepare(prompts, n, sampling, generator)
        run.prefill()
        run.synchronize()
        with run.stages.generating(run.cache):
            def eager() -> None:
                for _ in range(steps):
                    run.decode_step(None)

            out["eager"] = bench_common.kernel_profile(eager, per=steps)
            if torch.cuda.is_available():
                graph = run._capture()  # a decode step over the whole cache
                assert graph is not None, "the decode step's CUDA graph could not be captured"
                def replays(graph: torch.cuda.CUDAGraph = graph) -> None:
                    for _ in range(steps // 2):
                        graph.replay()

                started = time.perf_counter()
                replays()
                torch.cuda.synchronize()
                out["graph_step_ms"] = 1e3 * (time.perf_counter() - started) / (steps // 2)
                out["graph"] = bench_common.kernel_profile(replays, per=steps // 2)
    return out


def greedy_parity(engine: Any, cfg: Any, prompts: list[list[int]], n: int, new: int) -> dict:
    """The CUDA-graph path's greedy tokens against the schedule path's (one completion per prompt, bf16)."""
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    greedy = SamplingParams(max_new_tokens=new, pad_token_id=0, greedy=True)
    ref = [g[0] for g in MegatronRolloutBackend(engine, cfg.vocab_size, path="schedule").generate(prompts, greedy, 1)]
    got = [g[0] for g in MegatronRolloutBackend(engine, cfg.vocab_size, path="static", cuda_graphs="true").generate(prompts, greedy, 1)]
    first, gaps = [], []
    for a, b in zip(got, ref):
        d = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y), None)
        if d is not None:
            first.append(d)
            assert a.logprobs is not None and b.logprobs is not None
            gaps.append(abs(a.logprobs[d] - b.logprobs[d]))
    return {"parity_rows": len(ref), "parity_rows_identical": len(ref) - len(first), "parity_new_tokens": new,
            "parity_first_difference": min(first) if first else None,
            "parity_logprob_gap_at_difference": max(gaps) if gaps else None}


def trainer_gaps(engine: Any, cfg: Any, prompts: list[list[int]], new: int, graphs: str = "true") -> dict:
    """Each path's sampled logprobs against the trainer's recomputation of the same sequences (``compute_logprobs``: the
    gap GRPO's mismatch metrics see), the decode kernels on and off: in bf16 with random weights greedy tokens flip on
    any rounding change, so this is the check of the kernels' numbers at scale (one completion per prompt)."""
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    sampling = SamplingParams(max_new_tokens=new, pad_token_id=0, temperature=1.0)
    out = {}
    for name, kernels in (("graphs", "auto"), ("graphs_attention", "true"), ("graphs_torch", "false")):
        backend = MegatronRolloutBackend(engine, cfg.vocab_size, seed=0, path="static", cuda_graphs=graphs,
                                         decode_kernels=kernels)
        done = [g[0] for g in backend.generate(prompts, sampling, 1, seed=3)]
        rows = [{"input_ids": torch.tensor([p + r.completion_ids])} for p, r in zip(prompts, done, strict=True)]
        recomputed = engine.compute_logprobs(rows)
        # logprobs[i] is token i's: the trainer's at position len(prompt) + i - 1 (its next-token target)
        gaps = [abs(recomputed[k][0, len(p) + i - 1].item() - lp)
                for k, (p, r) in enumerate(zip(prompts, done, strict=True)) for i, lp in enumerate(r.logprobs or [])]
        out[f"trainer_logprob_gap_{name}"] = {"max": max(gaps), "mean": sum(gaps) / len(gaps), "tokens": len(gaps)}
    return out


def hf_generate(cfg: Any, prompts: list[list[int]], n: int, new: int, repeat: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    ids = torch.tensor([p for p in prompts for _ in range(n)], device="cuda")

    def run(tokens: int, model: Any = model) -> Any:
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)

    run(4)
    best = None
    for _ in range(repeat):
        out, seconds, peak = measure(lambda: run(new))
        tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        if best is None or tokens / seconds > best["tokens_per_s"]:
            best = {"tokens_per_s": tokens / seconds, "seconds": seconds, "decode_ms_per_step": 1e3 * seconds / new,
                    "peak_gib": peak, "path": "transformers generate (sdpa)"}
    model = None  # freed below (run holds it as a default argument: deleted with this frame)
    gc.collect()
    torch.cuda.empty_cache()
    return best  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", default="128x128", help="ROWSxNEW_TOKENS")
    p.add_argument("--paths", default="graphs,static,schedule,hf")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--profile", action="store_true",
                   help="a decode step's kernels: eager steps, and on a GPU the CUDA graph's replays (tables after the results)")
    args = p.parse_args()
    rows, new = (int(x) for x in args.batch.split("x"))
    if args.shape not in bench_common.ROLLOUT_SHAPES:
        raise SystemExit(f"--shape: {' or '.join(bench_common.ROLLOUT_SHAPES)}, not {args.shape}")
    cfg = bench_common.hf_config(args.shape)
    n = 8
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, cfg.vocab_size, (rows // n, 64), generator=g).tolist()
    paths = args.paths.split(",")
    results, extra = engine_paths(cfg, prompts, n, new, paths, args.repeat, args.profile)
    if "hf" in paths:
        results["hf"] = hf_generate(cfg, prompts, n, new, args.repeat)
    out = {"card": bench_common.card_name(), "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
           "batch": args.batch, "results": results, **extra}
    for r in results.values():
        rel = {f"x_{ref}": r["tokens_per_s"] / results[ref]["tokens_per_s"] for ref in ("schedule", "hf") if ref in results}
        r.update(rel)
    print(json.dumps(out, indent=1))
    print(f"\n| {args.shape} {args.batch} | tok/s | decode ms/step | prefill s | peak GiB | roofline | vs schedule | vs HF |")
    for name, r in results.items():
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} | {r.get('prefill_s', float('nan')):.3f} | "
              f"{r['peak_gib']:.2f} | {r.get('hbm_roofline_fraction', float('nan')):.2f} | {r.get('x_schedule', float('nan')):.2f} | "
              f"{r.get('x_hf', float('nan')):.2f} |")
    profiled = extra.get("decode_profile")
    if profiled:
        print(f"\nA decode step's kernels ({args.shape}, {rows} rows, the prompts' {len(prompts[0])} slots + "
              f"{2 * profiled['eager']['steps'] + 4} new)")
        for kind in ("eager", "graph"):
            if kind in profiled:
                ms = profiled.get("graph_step_ms") if kind == "graph" else None
                print("\n" + bench_common.kernel_table(profiled[kind], ms, f"{kind}: "))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
