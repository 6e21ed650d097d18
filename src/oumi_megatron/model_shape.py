"""The model's shape, read from its Hugging Face ``config.json`` without loading any weights.

A Hub name is read from the Hub (or its cache). Where the Hub cannot be reached (``HF_HUB_OFFLINE=1``, no network, a
gated model without a token), a name the repository ships a shape for (configs/model_shapes/index.json) resolves to
that copy, said in one line (``ResolvedShape.note``); any other name fails naming ``--model-config`` and the shipped
names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

SHIPPED_SHAPES = Path(__file__).resolve().parents[2] / "configs" / "model_shapes"
"""Copies of the public config.json of the models the shipped configs name (a source checkout's configs/)."""

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
        """From a local folder (or config.json), else from the Hugging Face Hub (config.json only), else the shipped
        copy where the Hub cannot be reached (``resolve_shape`` says which it read)."""
        return resolve_shape(model_name, revision).shape


@dataclass(frozen=True)
class ResolvedShape:
    shape: ModelShape
    note: str | None = None
    """One line where the shape is not the model's own config.json: the shipped copy read instead, and why."""


def shipped_shapes() -> dict[str, Path]:
    """Hub name -> the shipped copy of its config.json (configs/model_shapes/index.json)."""
    index = SHIPPED_SHAPES / "index.json"
    if not index.is_file():  # an installed wheel carries no configs/
        return {}
    return {name: SHIPPED_SHAPES / folder / "config.json" for name, folder in json.loads(index.read_text()).items()}


def hub_failure(e: BaseException) -> str:
    """Why the Hub gave no config.json, in a user's words."""
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no", "off"):
        return "the Hub is not read (HF_HUB_OFFLINE is set) and the local cache has no copy"
    if type(e).__name__ == "GatedRepoError" or " 401 " in f" {e} " or "gated" in text.lower():
        return ("it is gated: set HF_TOKEN to a token of an account that accepted its license (or run "
                "`hf auth login`)")
    if type(e).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"):
        return f"the Hub has no such model ({text})"
    return f"the Hub cannot be reached ({text})"


def download_problem(model_name: str, e: BaseException) -> str:
    """``model.model_name``'s download failed: why, and what it needs, in one line."""
    why = hub_failure(e)
    need = {"the Hub is not read": f"download it once where the Hub can be reached (`hf download {model_name}` with the "
                                   "same HF_HOME), or set model.model_name to a local folder",
            "it is gated": "then run again",
            "the Hub has no such model": "check model.model_name"}
    fix = next((v for k, v in need.items() if why.startswith(k)), "check the network (or set HF_HUB_OFFLINE=1 to use "
               "the local cache), or set model.model_name to a local folder")
    return f"model.model_name: {model_name} could not be downloaded: {why}; {fix}."


def resolve_shape(model_name: str, revision: str | None = None) -> ResolvedShape:
    """``ModelShape.resolve`` with what it read: a local folder, the Hub's config.json (or its cache), or, where the Hub
    gives none and the repository ships one for ``model_name``, that copy (with a one-line note)."""
    local = Path(model_name).expanduser()
    if local.exists():
        return ResolvedShape(ModelShape.from_file(local))
    if model_name.startswith((".", "/", "~")):
        raise ModelShapeError(f"local model path {model_name} does not exist")
    try:
        from huggingface_hub import hf_hub_download

        downloaded = hf_hub_download(model_name, "config.json", revision=revision)
    except Exception as e:  # noqa: BLE001 - offline, gated, missing repo: all mean "can't read it"
        why = hub_failure(e)
        shipped = {name.lower(): path for name, path in shipped_shapes().items()}
        path = shipped.get(model_name.lower())
        if path is not None and path.is_file() and not why.startswith("the Hub has no such model"):
            where = path.relative_to(SHIPPED_SHAPES.parent.parent) if path.is_relative_to(SHIPPED_SHAPES.parent.parent) else path
            return ResolvedShape(ModelShape.from_file(path), f"{model_name}'s config.json read from the shipped {where}: "
                                                             f"{why}.")
        known = ", ".join(sorted(shipped_shapes())) or "none in this installation"
        folder = f" (nor is it a local folder: {Path.cwd() / model_name} does not exist)" if "/" in model_name else ""
        raise ModelShapeError(
            f"cannot read config.json of '{model_name}'{folder}: {why}. Pass `--model-config PATH/config.json` (a copy of "
            f"{model_name}'s config.json), or use a local model folder; shapes shipped in configs/model_shapes/: {known}"
        ) from e
    return ResolvedShape(ModelShape.from_file(downloaded))


def read_config_shape(config: MegatronTrainingConfig, model_config_path: str | None, found: Findings,
                      notes: list[str]) -> tuple[ModelShape | None, bool]:
    """The shape of ``model.model_name`` (``model_config_path``: a copy of its config.json instead) and whether its
    architecture is one this project cannot train; where it cannot be read, None and the problem in ``found``. A
    shipped copy read instead of the Hub's is a line in ``notes``."""
    source = model_config_path or config.model.model_name
    try:
        if model_config_path:
            return ModelShape.from_file(model_config_path), False
        resolved = resolve_shape(config.model.model_name, config.model.model_revision)
        if resolved.note:
            notes.append(f"model.model_name: {resolved.note}")
        return resolved.shape, False
    except ModelShapeError as e:
        field_name = "--model-config" if model_config_path else "model.model_name"
        if e.unsupported_architecture or not (model_config_path or str(e).startswith("local model path")):
            found.add(field_name, str(e))  # a Hub name's message names --model-config and the shipped shapes
        else:
            found.add(field_name, f"cannot read the model's shape: {e}. Use a local folder with config.json, check the "
                                  f"name, or pass `--model-config PATH/config.json` with a copy of {source}'s config.")
        return None, e.unsupported_architecture


def check_model_needs(config: MegatronTrainingConfig, shape: ModelShape, found: Findings) -> None:
    """What the model needs beyond the layout (engine/parallel/layout.py checks the split): its own code, its context
    length."""
    if shape.remote_code and not config.model.trust_remote_code:
        found.add("model.trust_remote_code", f"{shape.source} needs its own code to load (config.json has an auto_map), "
                                             "which is not run unless you allow it. If you trust it, set "
                                             "model.trust_remote_code: true.")
    seq, limit = config.grpo.max_sequence_length, shape.max_position_embeddings
    if isinstance(limit, int) and limit > 0 and isinstance(seq, int) and seq > limit:
        found.add("grpo.max_completion_length",
                  f"grpo.max_prompt_length + grpo.max_completion_length = {config.grpo.max_prompt_length} + "
                  f"{config.grpo.max_completion_length} = {seq} exceeds the model's max_position_embeddings ({limit}). "
                  f"Lower them so that they sum to at most {limit}.")
