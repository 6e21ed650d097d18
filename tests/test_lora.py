"""LoRA (``training.use_peft`` + ``peft:``) on Megatron-Bridge's peft/: parity with HF PEFT, layouts, exports, state.

One 2-rank torchrun world (tests/workers/lora_worker.py) runs every layout once; the tests read what it recorded and
the folders it exported, and compare them with HF PEFT on the same base model. The config tests need no world.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_BIN, free_port, run_cli, shared_once, shared_path
from oumi_megatron.validation import validate_config

TORCHRUN = str(VENV_BIN / "torchrun")
IDS = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(11))  # the worker's batch
PARITY = 1e-5  # fp32 on both sides; Megatron's fused QKV and PEFT's separate projections sum in different orders
LAYOUTS = ("tp2", "tp2_sp", "pp2", "pp2_vpp2")


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    work = shared_path(tmp_path_factory, "lora")  # the world runs once for every xdist worker (conftest.shared_once)

    def build() -> dict:
        proc = run_cli([TORCHRUN, "--nproc_per_node", "2", "--master-port", str(free_port()),
                        str(REPO / "tests" / "workers" / "lora_worker.py"), str(work)])
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return json.loads((work / "result.json").read_text())

    return shared_once(tmp_path_factory, "lora_world", build), work


def _hf_logprobs(model: torch.nn.Module) -> torch.Tensor:
    """Each next token's logprob under ``model`` (the engine's ``compute_logprobs`` without its last column)."""
    with torch.no_grad():
        logits = model(input_ids=IDS).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, IDS[:, 1:, None])[..., 0]


def _base(work: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(work / "hf", torch_dtype=torch.float32).eval()


def _peft(work: Path, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(work), adapter).eval()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _max_diff(a: object, b: object) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def test_engine_logprobs_equal_hf_peft_with_the_exported_adapter(lora: tuple[dict, Path]) -> None:
    """The adapter exported for PEFT (hf_adapter/: adapter_config.json + adapter_model.safetensors), loaded by PEFT's
    own PeftModel on the HF base, gives the engine's logprobs; adapters switched off give the HF base's own."""
    r, work = lora
    adapter = work / "dp2_adapter_only" / "hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"])
    assert not (work / "dp2_adapter_only" / "hf_model").exists()  # adapter_only writes the adapter alone
    ours = torch.tensor(r["dp2"]["logprobs"])
    peft_lp = _hf_logprobs(_peft(work, adapter))
    base_lp = _hf_logprobs(_base(work))
    assert _max_diff(ours, peft_lp) <= PARITY
    assert _max_diff(r["dp2"]["logprobs_adapters_off"], base_lp) <= PARITY
    assert _max_diff(ours, base_lp) > 0.05  # the (random) adapters change the policy: the parity above means something
    assert r["dp2"]["logprobs_back_on"] == r["dp2"]["logprobs"]  # switching off is undone exactly


def test_merged_export_is_base_plus_scaled_update_and_base_export_is_the_source(lora: tuple[dict, Path]) -> None:
    """peft_save_mode merged: hf_model/ holds W + (alpha / r) B A (PEFT's merge_and_unload), a plain HF model with
    PEFT's logits; adapter_and_base_model: the adapter beside the base, bit-identical to the model trained from."""
    r, work = lora
    adapter = _tensors(work / "dp2_adapter_only" / "hf_adapter")
    merged = _tensors(work / "dp2_merged" / "hf_model")
    base = _tensors(work / "hf")
    name = "model.layers.1.self_attn.q_proj.weight"
    a = adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert _max_diff(merged[name], base[name] + 16.0 / 8 * b @ a) <= 1e-6
    assert _max_diff(merged[name], base[name]) > 1e-3
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(work / "dp2_merged" / "hf_model", torch_dtype=torch.float32).eval()
    assert _max_diff(_hf_logprobs(plain), r["dp2"]["logprobs"]) <= PARITY
    both = work / "dp2_adapter_and_base_model"
    assert _tensors(both / "hf_adapter").keys() == adapter.keys()
    kept = _tensors(both / "hf_model")
    assert kept.keys() == base.keys() and all(torch.equal(kept[k], base[k]) for k in base)


def test_adapters_train_alone_and_agree_across_layouts(lora: tuple[dict, Path]) -> None:
    """The base stays frozen (no gradient, bit-identical after a step) and the optimizer holds the adapters alone;
    the same adapters under TP 2, TP 2 + SP, PP 2 and PP 2 x VPP 2 (loaded from one checkpoint of the adapters,
    resharded) give the reference's logprobs, export the same adapter, and take the same step."""
    r, work = lora
    ref = r["dp2"]
    assert ref["base_changed"] == [] and ref["base_with_grad"] == []
    assert ref["optimizer_params"] == ref["adapter_params"] == 28_672  # 2 layers x (qkv, o, fc1, fc2) at r 8
    assert ref["base_params"] > 6 * ref["adapter_params"]
    exported = _tensors(work / "dp2_adapter_only" / "hf_adapter")
    assert _tensors(work / "tp2_adapter_only" / "hf_adapter").keys() == exported.keys()
    assert max(_max_diff(t, exported[k]) for k, t in _tensors(work / "tp2_adapter_only" / "hf_adapter").items()) == 0.0
    # each rank holds half of every adapter under TP 2 or PP 2 (oumi-megatron plan counts them so: plan.py lora_params)
    assert {r[name]["rank_adapter_params"] for name in LAYOUTS} == {ref["adapter_params"] // 2}
    for name in LAYOUTS:
        entry = r[name]
        assert _max_diff(entry["logprobs"], ref["logprobs"]) <= PARITY, name
        assert _max_diff(entry["logprobs_adapters_off"], ref["logprobs_adapters_off"]) <= PARITY, name
        assert max(_max_diff(v, exported[k]) for k, v in entry["adapters"].items()) <= 1e-7, name
        assert entry["loss"] == pytest.approx(r["tp2"]["loss"], abs=1e-5), name
        moved = max(_max_diff(v, exported[k]) for k, v in entry["adapters_after_step"].items())
        assert moved > 1e-3, name  # the step moved the adapters (Adam's first step: about lr)
        assert max(_max_diff(v, r["tp2"]["adapters_after_step"][k])
                   for k, v in entry["adapters_after_step"].items()) <= 2e-5, name


def test_adapter_output_in_one_gemm_equals_bridge_s_forward(lora: tuple[dict, Path]) -> None:
    """At TP 1 the engine adds each adapter's output in one addmm (engine/peft.py) where Megatron-Bridge runs a GEMM, a
    multiply and an add: the same logits and adapter gradients (fp32), and every adapted layer dispatches its multiply
    and add no more. (TP 2 keeps Bridge's forward: the layouts above agree with this one.)"""
    got = lora[0]["dp2"]["one_gemm"]
    adapted = got["adapted_layers"]
    assert adapted == 4 * 4  # the tiny model's 4 layers x (qkv, proj, fc1, fc2)
    assert got["logit_diff"] <= 1e-6 * got["logit_scale"]
    assert got["grad_scale"] > 1e-4 and got["grad_diff"] <= 1e-6 * got["grad_scale"]
    one, bridge = got["ops"]["one_gemm"], got["ops"]["bridge"]
    assert (one["addmm"], bridge["addmm"]) == (adapted, 0)
    assert bridge["mm"] - one["mm"] == adapted  # B's GEMM is the addmm
    assert bridge["mul"] - one["mul"] == adapted and bridge["add"] - one["add"] == adapted
    assert bridge["all"] - one["all"] >= 2 * adapted


def test_canonical_lora_on_q_and_v_alone_matches_peft(lora: tuple[dict, Path]) -> None:
    """lora_target_modules [q_proj, v_proj] (PEFT's default for Llama): an adapter on those two projections alone
    (Bridge's canonical LoRA), the same under TP 2, and PEFT on the exported adapter gives the engine's logprobs."""
    r, work = lora
    assert r["canonical"]["trainable"] == [f"self_attention.linear_qkv.adapter.adapter_{p}.{m}.weight"
                                           for p in "qv" for m in ("linear_in", "linear_out")]
    adapter = work / "canonical_adapter_only" / "hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 4
    assert _max_diff(_hf_logprobs(_peft(work, adapter)), r["canonical"]["logprobs"]) <= PARITY
    assert _max_diff(r["canonical_tp2"]["logprobs"], r["canonical"]["logprobs"]) <= PARITY
    merged = _tensors(work / "canonical_merged" / "hf_model")
    base = _tensors(work / "hf")
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged[k], base[k])  # no adapter on k_proj: its weight is the base's
    assert _max_diff(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]) > 1e-3


def test_rollouts_decode_merged_weights_and_give_the_base_back_bit_exact(lora: tuple[dict, Path]) -> None:
    """megatron.lora_sync: merged (the default): the embedded backend decodes from the base with the adapters folded in
    (engine/peft.py ``adapters_merged``). In every layout (TP 2 and canonical LoRA's fused q/k/v included) the merged
    model gives the adapters' logprobs, the base moved while merged and came back bit-identical, and the bytes kept
    aside are the adapted layers' base weights, as ``oumi-megatron plan`` counts them; the backend's greedy rollouts
    under merged and adapter agree, and leave the base as it was."""
    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import lora_merged_base_params

    r, work = lora
    for name in ("dp2", *LAYOUTS, "canonical", "canonical_tp2"):
        got = r[name]["merged"]
        assert _max_diff(got["logprobs"], r[name]["logprobs"]) <= PARITY, name
        assert got["restored"] and got["base_moved"] > 1e-3, name
        assert got["kept_bytes"] == got["adapted_bytes"] > 0, name
    ref = r["dp2"]["merged"]
    every = LoraSettings(8, 16.0, 0.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), False, "adapter_only")
    assert ref["kept_bytes"] == 4 * lora_merged_base_params(ModelShape.from_file(work / "hf"), every)  # fp32, TP 1
    assert ref["restored_after_rollouts"]
    merged, adapter = ref["rollout_merged"], ref["rollout_adapter"]
    assert len(merged) == len(adapter) == 4 and all(len(tokens) == 8 for tokens, _ in merged)
    for (tokens_m, lp_m), (tokens_a, lp_a) in zip(merged, adapter, strict=True):
        assert tokens_m == tokens_a
        assert _max_diff(lp_m, lp_a) <= 1e-4


@pytest.mark.parametrize(("override", "field"), [
    ({"lora_r": 0}, "peft.lora_r"),
    ({"lora_alpha": 0}, "peft.lora_alpha"),
    ({"lora_dropout": 1.0}, "peft.lora_dropout"),
    ({"lora_target_modules": ["q_proj", "attn_out"]}, "peft.lora_target_modules"),
    ({"q_lora": True}, "peft.q_lora"),
    ({"lora_modules_to_save": ["lm_head"]}, "peft.lora_modules_to_save"),
])
def test_bad_peft_fields_are_refused_by_name(make_config, override: dict, field: str) -> None:  # noqa: ANN001
    cfg = make_config(training={"use_peft": True}, peft=override)
    report = validate_config(cfg, world_size=1, model_shape=None, check_bridge=False)
    assert field in report.fields(), report.format_problems()


@pytest.mark.parametrize(("megatron", "field"), [
    ({"lora_sync": "deltas"}, "megatron.lora_sync"),
    ({"inference_backend": "sglang", "lora_sync": "adapter"}, "megatron.lora_sync"),  # SGLang takes merged weights
    ({"inference_backend": "vllm", "weight_sync_method": "checkpoint", "lora_sync": "adapter"}, "megatron.lora_sync"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb_h1"}, "megatron.pipeline_schedule"),
    ({"enable_module_queue": True}, "megatron.enable_module_queue"),
    ({"context_parallel_size": 2}, "megatron.context_parallel_size"),
])
def test_layouts_lora_does_not_run_under_are_refused(make_config, megatron: dict, field: str) -> None:  # noqa: ANN001
    cfg = make_config(training={"use_peft": True}, peft={"lora_r": 8}, megatron=megatron)
    report = validate_config(cfg, world_size=2, model_shape=None, check_bridge=False)
    assert field in report.fields(), report.format_problems()


def test_lora_on_a_mixture_of_experts_model_is_refused(make_config) -> None:  # noqa: ANN001
    from oumi_megatron.model_shape import ModelShape

    moe = ModelShape(source="moe", model_type="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), num_layers=4,
                     hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=320, num_experts=4)
    report = validate_config(make_config(training={"use_peft": True}), world_size=1, model_shape=moe, check_bridge=False)
    assert "training.use_peft" in report.fields() and "mixture-of-experts" in report.format_problems()


def test_peft_settings_resolve_hf_and_megatron_names(make_config) -> None:  # noqa: ANN001
    from oumi_megatron.config.lora import lora_settings

    cfg = make_config(training={"use_peft": True}, peft={"lora_r": 16, "lora_alpha": 32,
                                                         "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    settings, problems = lora_settings(cfg)
    assert problems == [] and settings is not None
    assert (settings.rank, settings.alpha, settings.targets, settings.canonical) == (16, 32.0, ("linear_qkv", "linear_proj"), False)
    assert validate_config(cfg, world_size=1, model_shape=None, check_bridge=False).ok
    off, none = lora_settings(make_config(peft={"lora_r": 16}))
    assert off is None and none == []  # use_peft false: the peft: section is not read


def test_evaluating_an_adapter_folder_says_to_merge_it(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    from oumi_megatron.assembly import evaluate_model
    from oumi_megatron.errors import UserInputError

    adapter = tmp_path / "hf_adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(UserInputError, match="is a LoRA adapter.*--peft-save-mode merged"):
        evaluate_model(make_config(), None, [], model_dir=adapter)  # type: ignore[arg-type]
