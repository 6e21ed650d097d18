"""A throughput task at a real model's shape: random weights, fixed-length completions, a cheap reward.

Whole-run benchmarks (scripts/bench_grpo.py) need a model of a size users train, which cannot be downloaded here.
Throughput does not depend on what the weights know, so this builds one locally:

- **model**: one of ``SHAPES`` with random weights, saved as an HF folder in bf16: Qwen2.5-1.5B's architecture
  (28 layers, hidden 1536, 12 query / 2 KV heads, SwiGLU 8960, QKV bias, tied embeddings, vocabulary 151,936),
  Llama-3.1-8B's (32 layers, hidden 4096, 32 query / 8 KV heads, SwiGLU 14336, untied embeddings, vocabulary 128,256,
  RoPE theta 500,000 with the "llama3" scaling) or Llama-3.1-70B's (80 layers, hidden 8192, 64 query / 8 KV heads,
  SwiGLU 28672, the same vocabulary and RoPE; a few layers of it, ``num_hidden_layers``, for one GPU);
- **tokenizer**: byte-level, with the full vocabulary (256 byte tokens, filler tokens of two and three bytes up to
  the vocabulary's size less 3, then ChatML's three special tokens), so every id a random model samples decodes, in
  vLLM too. Prompts encode one token per byte;
- **completions**: a random model almost never samples its EOS (1 token in 10^5), so completions run to
  ``max_completion_length``: fixed length, as throughput comparisons want;
- **prompts**: the arithmetic task's questions (examples/arithmetic_task.py) as chat rows, ~200 tokens each;
- **reward**: ``char_diversity``, the fraction of distinct characters in the completion: cheap, and it varies within
  a group, so advantages are not zero and every step trains. It takes TRL's reward signature, which this project's
  reward functions accept too (grpo/rewards.py), so both libraries score with the same function.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oumi_megatron.examples.arithmetic_task import TRAIN_TEMPLATES, make_rows
from oumi_megatron.examples.tiny_models import LLAMA3_1_ROPE, build_byte_tokenizer

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters=LLAMA3_1_ROPE),
    # its width: scripts/bench_scale_laws.py --gpu runs a slice of it (2 of its 80 layers) on one GPU
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                          rope_parameters=LLAMA3_1_ROPE),
}
"""The models' config.json architecture fields (configs/model_shapes/ holds the published files; a test compares)."""


def build_scale_model(out_dir: str | Path, seed: int = 0, shape: str = "qwen2.5-1.5b", **overrides: Any) -> Path:
    """Writes a random model of ``shape`` (one of ``SHAPES``; bf16) and its full-vocabulary tokenizer to ``out_dir``;
    idempotent. ``overrides`` change config fields (fewer layers to fit one GPU; the tests use a small width)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if shape not in SHAPES:
        raise ValueError(f"scale model shape {shape!r}: choose one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    spec = {**SHAPES[shape], **overrides, "seed": seed}
    stamp = out / "scale_model.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    fields = {k: v for k, v in spec.items() if k not in ("seed", "model_type")}
    tokenizer = build_byte_tokenizer(fields["vocab_size"])
    assert len(tokenizer) == fields["vocab_size"], (len(tokenizer), fields["vocab_size"])
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.for_model(spec["model_type"], **fields, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initializing billions of parameters on a CPU takes minutes
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    return out


def char_diversity(completions: list[Any], **_: Any) -> list[float]:
    """The fraction of distinct characters in each completion (TRL's reward signature; chat completions too)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / len(t) if t else 0.0 for t in texts]


def write_scale_rows(out_dir: str | Path, n: int = 4000, seed: int = 0) -> Path:
    """``out_dir/train.rows.jsonl``: ``n`` chat rows (the arithmetic task's questions) in the row format the real task's
    rows have (scripts/prepare_gpu_real_model.py), so the same workers read them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"data_source": "scale", "prompt": [{"role": "user", "content": r["question"]}],
             "reward_model": {"style": "rule", "ground_truth": ""}}
            for r in make_rows(n, seed, TRAIN_TEMPLATES)]
    path = out / "train.rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
