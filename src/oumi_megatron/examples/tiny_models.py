"""Tiny random Hugging Face causal LMs and a byte-level tokenizer, built locally.

Used by the tests and the CPU demo so that nothing is downloaded. Shapes are the smallest that still
exercise TP=2 / PP=2 / VPP=2 (heads and KV heads divisible by 2, layers divisible by 4) and that
vLLM's CPU attention accepts (head size >= 32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "llama3_1", "qwen2", "qwen3")
MOE_ARCHITECTURES = ("qwen3_moe",)

# ChatML, as Qwen uses; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_1_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama-3.1's RoPE, as transformers 5 spells it (``rope_parameters``)."""


def build_byte_tokenizer(vocab_size: int | None = None):  # noqa: ANN201 - transformers type imported lazily
    """A byte-level BPE tokenizer with no merges (text encodes one token per byte): 256 byte tokens + ChatML special
    tokens. ``vocab_size``: filler tokens of two and three bytes between the two, so that every id below it decodes
    (the special tokens then take the last three ids)."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    if vocab_size is not None:
        fillers = itertools.chain((a + b for a in alphabet for b in alphabet),
                                  (a + b + c for a in alphabet for b in alphabet for c in alphabet))
        count = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
        vocab.update((w, len(alphabet) + i) for i, w in enumerate(itertools.islice(fillers, count)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def tiny_config(arch: str = "qwen2", num_layers: int = 4, vocab_size: int = 320, head_dim: int = 32,  # noqa: ANN201
                gqa: bool = False, init_std: float = 0.02):
    """A tiny config of the given architecture style (llama, llama3_1: Llama-3.1's RoPE (theta 500,000, "llama3"
    frequency scaling), qwen2: QKV bias + tied embeddings, qwen3: QK-norm, qwen3_moe: Qwen3 with mixture-of-experts MLPs).
    Two heads of ``head_dim`` (64 for vLLM's FlashAttention-3 on Hopper GPUs, which has no 32); with ``gqa``
    four query heads sharing two key/value heads. ``init_std``: the weights' initial std (transformers'
    ``initializer_range``)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    heads = 4 if gqa else 2
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=heads * head_dim,
        intermediate_size=4 * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=258,  # <|im_end|> in build_byte_tokenizer
        pad_token_id=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=init_std,
    )
    if arch == "llama":
        return LlamaConfig(head_dim=head_dim, tie_word_embeddings=False, **common)
    if arch == "llama3_1":
        # the scaling slows the frequencies whose wavelength passes 2048 positions (parity_worker compares them)
        common.update(rope_parameters=LLAMA3_1_ROPE, max_position_embeddings=131072)  # transformers wants > 8192
        return LlamaConfig(head_dim=head_dim, tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, tie_word_embeddings=False, **common)
    if arch == "qwen3_moe":  # every layer a mixture of 4 experts, 2 per token (EP = 2: two experts per rank)
        # head_dim is missing from Qwen3MoeConfig's signature, but it is kept like any extra field (in config.json too)
        # and the model reads it
        return Qwen3MoeConfig(head_dim=head_dim, tie_word_embeddings=False, num_experts=4,  # type: ignore[call-arg]
                              num_experts_per_tok=2, moe_intermediate_size=2 * head_dim, decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES + MOE_ARCHITECTURES}")


def build_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen2", seed: int = 0, num_layers: int = 4,
                     head_dim: int = 32, gqa: bool = False, init_std: float = 0.02) -> Path:
    """Writes a random tiny causal LM + tokenizer to ``out_dir`` (idempotent for the same arguments). ``init_std``
    larger than transformers' 0.02 gives the output layer logits of some range at step 0: LoRA, which leaves that layer
    frozen, can then move the model's choices on the demo task (at 0.02 the tied head caps every logit near 1)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    stamp = out / "tiny_model.json"
    spec = {"arch": arch, "seed": seed, "num_layers": num_layers, **({"head_dim": head_dim} if head_dim != 32 else {}),
            **({"gqa": True} if gqa else {}), **({"init_std": init_std} if init_std != 0.02 else {})}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    tokenizer = build_byte_tokenizer()
    config = tiny_config(arch, num_layers=num_layers, head_dim=head_dim, gqa=gqa, init_std=init_std)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    return out
