"""LoRA's adapter output in one GEMM (engine/peft.py) against Megatron-Bridge's own forward: same call, same device.

    python scripts/bench_lora_layer.py [--layers 2] [--seq 256] [--mbs 2] [--microbatches 2] [--rows 128] [--out r.json]

The Qwen2.5-1.5B shape's layers (hidden 1536, fc1 2 x 8,960, 12 heads / 2 KV heads; ``--layers`` of them) with a
small vocabulary (the output layer is frozen and unadapted either way, and would only dilute the ratio), random
weights, LoRA r 16 / alpha 32 on every linear layer, bf16, one rank (GPU if there is one, else CPU). Times, the two
forwards alternating (one, Bridge, one, Bridge, ...) so drift falls on both, medians of ``--repeats``:
- ``train``: the forward + backward of one ``engine.train_step`` over ``--microbatches`` microbatches of ``--mbs`` rows
  of ``--seq`` tokens;
- ``decode``: a no-grad forward of ``--rows`` rows of one token each (a decode step's shape; eager: the kernels a
  CUDA graph would replay).
It also checks that the two forwards give the same logits (within bf16 rounding) once the adapters are non-zero.
And ``output_layer``: the chunked logprobs' forward + backward (engine/kernels/chunked_logprobs.py) over
``--output-tokens`` hidden states at Qwen2.5's vocabulary, with the output weight trainable (full fine-tuning) and
frozen (LoRA: no weight gradient), alternating the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import bench_common


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256, help="tokens per training row")
    p.add_argument("--mbs", type=int, default=2, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--rows", type=int, default=128, help="rows of the decode-shaped forward")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-tokens", type=int, default=1024)
    p.add_argument("--output-vocab", type=int, default=151936)
    p.add_argument("--out", default="")
    args = p.parse_args()

    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.wrappers import unwrap

    cfg = bench_common.hf_config("qwen2.5-1.5b", seq=args.seq, layers=args.layers)
    cfg.vocab_size = args.vocab
    params = MegatronParams()
    params.transformer_config.recompute_granularity = None
    params.micro_batch_size, params.global_batch_size = args.mbs, args.mbs * args.microbatches
    lora = LoraSettings(args.rank, args.alpha, 0.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), False,
                        "adapter_only")
    _, engine = build_engine_from_hf_config(cfg, engine_layout(params), params, OptimSettings(lr=1e-5, total_steps=100),
                                            dtype=torch.bfloat16, lora=lora)
    from megatron.bridge.peft.lora_layers import LoRALinear  # after the engine: Bridge imports through bridge_utils

    device = engine.device
    model = unwrap(engine.model[0])
    with torch.no_grad():  # Bridge starts B at zero: random adapters, so the parity below compares something
        g = torch.Generator().manual_seed(0)
        for p_ in model.parameters():
            if p_.requires_grad:
                p_.copy_(0.02 * torch.randn(p_.shape, generator=g).to(p_.dtype))
    one_gemm, bridge = LoRALinear.forward, LoRALinear._oumi_unfused_forward
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g)}
               for _ in range(args.microbatches)]
    rows = torch.randint(0, args.vocab, (args.rows, 1), generator=g).to(device)
    position = torch.zeros_like(rows)

    def loss_fn(logprobs: torch.Tensor, batch: dict) -> tuple:
        return -logprobs.sum(), torch.tensor(logprobs.numel()), {}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def train() -> float:
        return engine.train_step(batches, loss_fn).forward_backward_s

    def decode() -> float:
        model.eval()
        with torch.no_grad():
            sync()
            started = time.perf_counter()
            for _ in range(8):
                model(input_ids=rows, position_ids=position, attention_mask=None)
            sync()
        return (time.perf_counter() - started) / 8

    def logits() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(input_ids=rows, position_ids=position, attention_mask=None).float()

    times: dict[str, dict[str, list[float]]] = {"one_gemm": {"train": [], "decode": []}, "bridge": {"train": [], "decode": []}}
    ref = {}
    for name, forward in (("one_gemm", one_gemm), ("bridge", bridge)):  # before a step: the optimizer's master
        LoRALinear.forward = forward                                      # weights still hold Bridge's B = 0
        ref[name] = logits()
    for i in range(args.repeats + 1):  # the first round warms up both
        for name, forward in (("one_gemm", one_gemm), ("bridge", bridge)):
            LoRALinear.forward = forward
            for what, fn in (("train", train), ("decode", decode)):
                t = fn()
                if i > 0:
                    times[name][what].append(t)
    LoRALinear.forward = one_gemm
    output_layer = time_output_layer(args, device, sync)
    med = {name: {what: statistics.median(v) for what, v in d.items()} for name, d in times.items()}
    result = {
        "card": bench_common.card_name(), "layers": args.layers, "tokens_per_step": args.seq * args.mbs * args.microbatches,
        "decode_rows": args.rows, "lora_rank": args.rank,
        "train_fwd_bwd_ms": {k: round(v["train"] * 1e3, 2) for k, v in med.items()},
        "decode_forward_ms": {k: round(v["decode"] * 1e3, 3) for k, v in med.items()},
        "train_speedup": round(med["bridge"]["train"] / med["one_gemm"]["train"], 3),
        "decode_speedup": round(med["bridge"]["decode"] / med["one_gemm"]["decode"], 3),
        "logit_diff": (ref["one_gemm"] - ref["bridge"]).abs().max().item(),
        "logit_scale": ref["bridge"].abs().max().item(),
        "output_layer_fwd_bwd_ms": output_layer,
        "output_layer_speedup_frozen": round(output_layer["trainable"] / output_layer["frozen"], 3),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def time_output_layer(args: argparse.Namespace, device: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """Median ms of the chunked logprobs' forward + backward with the output weight trainable and frozen."""
    from oumi_megatron.engine.kernels.chunked_logprobs import auto_chunk_tokens, chunked_token_logprobs

    g = torch.Generator().manual_seed(2)
    hidden = (0.02 * torch.randn(args.output_tokens, 1, 1536, generator=g)).to(device, torch.bfloat16)
    weight = (0.02 * torch.randn(args.output_vocab, 1536, generator=g)).to(device, torch.bfloat16)
    targets = torch.randint(0, args.output_vocab, (1, args.output_tokens), generator=g).to(device)
    times: dict[str, list[float]] = {"trainable": [], "frozen": []}
    for i in range(args.repeats + 1):
        for name in times:
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(name == "trainable")
            sync()
            started = time.perf_counter()
            logprobs, _ = chunked_token_logprobs(h, w, targets, 1.0, auto_chunk_tokens(args.output_vocab))
            logprobs.sum().backward()
            sync()
            if i > 0:
                times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}


if __name__ == "__main__":
    main()
