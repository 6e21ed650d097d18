"""The model's shape, read from its Hugging Face ``config.json`` without loading any weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Expert-count keys used by the MoE families transformers ships (Mixtral, Qwen-MoE, DeepSeek, ...).
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ModelShapeError(ValueError):
    """config.json could not be found or read, or describes a model this project cannot train."""

    def __init__(self, message: str, unsupported_architecture: bool = False) -> None:
        super().__init__(message)
        self.unsupported_architecture = unsupported_architecture


@dataclass(frozen=True)
class ModelShape:
    """What the parallel layout depends on."""

    source: str
    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_experts: int = 0
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    intermediate_size: int = 0
    """The dense MLP's hidden size (0: unknown, taken as 4 x hidden_size by the memory plan)."""
    head_dim: int = 0
    """Per-head size (0: hidden_size / num_attention_heads)."""
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    remote_code: bool = False
    """config.json has an ``auto_map``: loading it runs the model folder's own code."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def head_size(self) -> int:
        """Per-head size: ``head_dim``, or hidden_size / num_attention_heads where config.json has none."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def widths(self) -> tuple[int, int, int, int, int]:
        """(hidden, query width, key/value width, dense FFN, one expert's FFN), with config.json's defaults
        (head_dim = hidden / heads, FFN 4 x hidden)."""
        h, d = self.hidden_size, self.head_size
        ffn = self.intermediate_size or 4 * h
        return h, d * self.num_attention_heads, d * self.num_key_value_heads, ffn, self.moe_intermediate_size or ffn

    def layer_params(self) -> tuple[float, float]:
        """(dense, expert) parameters of one transformer layer."""
        h, q, kv, ffn, expert_ffn = self.widths()
        attention = h * (q + 2 * kv) + q * h + 2 * h  # QKV, output projection, two norms
        if self.is_moe:
            return attention + h * self.num_experts, 3 * h * expert_ffn * self.num_experts  # router; experts
        return attention + 3 * h * ffn, 0.0

    def vllm_weight_bytes(self, tensor_parallel: int = 1) -> float:
        """A vLLM engine's weights in bf16: the whole model (every layer), split over the engine's tensor parallelism
        (a colocated engine's is Megatron's TP; a Ray fleet engine's, its GPUs)."""
        dense, experts = self.layer_params()
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return 2 * (self.num_layers * (dense + experts) + embeddings) / tensor_parallel

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], source: str) -> ModelShape:
        # Multimodal configs nest the language model's settings.
        nested = cfg.get("text_config")
        text: dict[str, Any] = nested if isinstance(nested, dict) else cfg
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in text]
        if missing:
            # e.g. GPT-2 (n_layer, n_embd): not a GPT-style architecture Megatron-Bridge maps
            arch = ", ".join(cfg.get("architectures") or ()) or f"model_type {cfg.get('model_type', 'unknown')!r}"
            raise ModelShapeError(
                f"{source} is a {arch} model: architecture not supported (Megatron-Bridge maps Llama-style "
                f"causal LMs such as LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM; "
                f"this config.json has no {', '.join(missing)}). Use a supported model.",
                unsupported_architecture=True,
            )
        heads = int(text["num_attention_heads"])
        experts = next((int(text[k]) for k in _EXPERT_KEYS if text.get(k)), 0)
        return cls(
            source=source,
            model_type=str(cfg.get("model_type", text.get("model_type", "unknown"))),
            architectures=tuple(cfg.get("architectures") or ()),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            vocab_size=int(text.get("vocab_size", 0)),
            num_experts=experts,
            max_position_embeddings=text.get("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            intermediate_size=int(text.get("intermediate_size") or 0),
            head_dim=int(text.get("head_dim") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            remote_code=bool(cfg.get("auto_map")),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelShape:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelShapeError(f"{path} does not exist")
        try:
            return cls.from_config_dict(json.loads(path.read_text()), str(path))
        except json.JSONDecodeError as e:
            raise ModelShapeError(f"{path} is not valid JSON: {e}") from e

    @classmethod
    def resolve(cls, model_name: str, revision: str | None = None) -> ModelShape:
        """From a local folder (or config.json), else from the Hugging Face Hub (config.json only)."""
        local = Path(model_name).expanduser()
        if local.exists():
            return cls.from_file(local)
        if model_name.startswith((".", "/", "~")):
            raise ModelShapeError(f"local model path {model_name} does not exist")
        try:
            from huggingface_hub import hf_hub_download

            downloaded = hf_hub_download(model_name, "config.json", revision=revision)
        except Exception as e:  # noqa: BLE001 - offline, gated, missing repo: all mean "can't read it"
            raise ModelShapeError(
                f"could not read config.json of '{model_name}' from the Hugging Face Hub "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        return cls.from_file(downloaded)
