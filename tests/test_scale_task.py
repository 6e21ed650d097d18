"""The throughput task at real models' shapes (examples/scale_task.py): the shapes are the published ones, a built
model is what the planner and the engines read, and every id it can sample decodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO
from oumi_megatron.examples.scale_task import SHAPES, build_scale_model, char_diversity, write_scale_rows

PUBLISHED = {"qwen2.5-1.5b": "qwen2.5-1.5b-instruct", "llama-3.1-8b": "llama-3.1-8b-instruct",
             "llama-3.1-70b": "llama-3.1-70b-instruct"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scale_shapes_are_the_published_configs(shape: str) -> None:
    published = json.loads((REPO / "configs" / "model_shapes" / PUBLISHED[shape] / "config.json").read_text())
    fields = dict(SHAPES[shape])
    rope = fields.pop("rope_parameters")
    assert {k: published[k] for k in fields} == fields
    assert rope["rope_theta"] == published["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert scaling == (published.get("rope_scaling") or {"rope_type": "default"})


def test_a_small_llama_3_1_scale_model_has_the_shape_the_planner_counts(tmp_path: Path) -> None:
    """Llama-3.1-8B's structure (untied embeddings, GQA, head_dim, the full vocabulary, "llama3" RoPE) at a small
    width: the HF model's parameters are what ModelShape counts for the planner and the engine-fits check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oumi_megatron.model_shape import ModelShape

    small = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16)
    out = build_scale_model(tmp_path / "llama", shape="llama-3.1-8b", **small)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert build_scale_model(tmp_path / "llama", shape="llama-3.1-8b", **small) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp  # the same spec is not built again

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.rope_parameters["rope_type"] == "llama3"
    assert next(model.parameters()).dtype == torch.bfloat16
    shape = ModelShape.from_file(out / "config.json")
    assert (shape.num_layers, shape.vocab_size, shape.head_size, shape.tie_word_embeddings) == (2, 128256, 16, False)
    counted = shape.vllm_weight_bytes() / 2  # bf16 bytes -> parameters
    assert counted + model.config.hidden_size == sum(p.numel() for p in model.parameters())  # ModelShape: no final norm

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 128256
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id == 128255
    ids = list(range(0, 128256, 997)) + [128253]  # fillers of two and three bytes, the last filler
    assert all(tokenizer.decode([i]) for i in ids)


def test_scale_rows_and_reward(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in write_scale_rows(tmp_path, n=5).read_text().splitlines()]
    assert len(rows) == 5 and all(r["prompt"][0]["role"] == "user" and r["prompt"][0]["content"] for r in rows)
    assert char_diversity(["abab", [{"role": "assistant", "content": "abcd"}], ""]) == [0.5, 1.0, 0.0]
