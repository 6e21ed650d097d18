"""Token logprobs at a 152k vocabulary: full logits vs chunked (engine/kernels/chunked_logprobs.py), same call.

    python scripts/bench_logprobs.py --out result.json          # 1 GPU

Model: Llama-style, 4 layers, hidden 2048, 16 heads (8 KV heads), SwiGLU 5632, vocab 152,064 (Qwen2.5's),
bf16, random init. Batch: 4 microbatches x 2 sequences x 4096 tokens. For each path
(``megatron.logprob_chunk_tokens: 0`` = full logits, ``null`` = chunked, auto-sized) it times
``compute_logprobs`` (forward only: old/reference logprobs in GRPO) and ``train_step`` with a GRPO-like
per-token loss, and reports each one's peak memory above the model's state (weights, fp32 main grads,
optimizer state), so the numbers are the logits' and activations' share. ``report`` prints the table of logprobs.json
(scripts/gpu_check.py).
"""

import argparse
import functools
import gc
import json
import time
from pathlib import Path

import torch

import bench_common


def run(chunk: int | None, batches: list[dict], cfg, args) -> dict:  # noqa: ANN001
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout

    params = MegatronParams()
    params.transformer_config.recompute_granularity = "selective"
    params.logprob_chunk_tokens = chunk
    _, engine = build_engine_from_hf_config(
        cfg, engine_layout(params), params, OptimSettings(lr=1e-5, total_steps=100), dtype=torch.bfloat16)

    def loss_fn(logprobs: torch.Tensor, batch: dict) -> tuple:
        return -logprobs.sum(), torch.tensor(logprobs.numel()), {}

    def timed(fn) -> tuple[float, float]:  # noqa: ANN001
        fn()  # warm-up (allocator, kernels)
        torch.cuda.synchronize()
        gc.collect()
        state = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2], (torch.cuda.max_memory_allocated() - state) / 2**30

    engine.train_step(batches, loss_fn)  # optimizer state exists from here on
    # partial, not a lambda: ``del engine`` below ends the name's binding
    fwd_s, fwd_gib = timed(functools.partial(engine.compute_logprobs, batches))
    train_s, train_gib = timed(functools.partial(engine.train_step, batches, loss_fn))
    logprobs = torch.cat(engine.compute_logprobs(batches[:1])).float().cpu()
    result = {"logprob_chunk_tokens": chunk, "forward_s": round(fwd_s, 4), "forward_peak_above_state_gib": round(fwd_gib, 2),
              "train_step_s": round(train_s, 4), "train_peak_above_state_gib": round(train_gib, 2)}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return result, logprobs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    cfg = bench_common.hf_config("logprobs-152k", args.seq)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, cfg.vocab_size, (args.mbs, args.seq), generator=g)} for _ in range(args.microbatches)]
    full, lp_full = run(0, batches, cfg, args)
    chunked, lp_chunked = run(None, batches, cfg, args)
    result = {
        "card": bench_common.card_name(), "vocab": cfg.vocab_size, "seq": args.seq, "mbs": args.mbs,
        "microbatches": args.microbatches, "tokens_per_microbatch": args.mbs * args.seq,
        "full_logits": full, "chunked": chunked,
        "logprobs_max_abs_diff": (lp_full[:, :-1] - lp_chunked[:, :-1]).abs().max().item(),
    }
    print("BENCH " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


def report(results_dir: Path) -> str:
    """The markdown table of ``results_dir``/logprobs.json (this script's ``--out`` in scripts/gpu_check.py), or ""."""
    path = results_dir / "logprobs.json"
    if not path.is_file():
        return ""
    r = json.loads(path.read_text())
    lines = [f"| logprobs, vocab {r['vocab']}, {r['tokens_per_microbatch']} tokens/microbatch | card | forward s "
             "| forward peak above state GiB | train step s | train peak above state GiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in ("full_logits", "chunked"):
        x = r[name]
        lines.append(f"| {name} | {r['card']} | {x['forward_s']} | {x['forward_peak_above_state_gib']} | {x['train_step_s']} "
                     f"| {x['train_peak_above_state_gib']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
