"""Single-rank parity against Hugging Face for the three architecture styles (run as a subprocess).

    python tests/workers/parity_worker.py WORKDIR OUT_JSON [float32|bfloat16]

For llama (untied), llama3_1 (Llama-3.1's RoPE scaling), qwen2 (QKV bias, tied embeddings), qwen3 (QK-norm) and
qwen3_moe (4 experts, top-2 routing, SequentialMLP experts on the local spec): build a tiny random HF
model, convert it with Megatron-Bridge, and record (1) max |Megatron logits - HF logits|,
(2) max |engine logprobs - log_softmax(HF logits)[chosen tokens]|, (3) whether the HF export of the
converted checkpoint is bit-identical to the source weights.
"""

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    workdir, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron, export_to_hf
    from oumi_megatron.examples.tiny_models import ARCHITECTURES, MOE_ARCHITECTURES, build_tiny_model
    from oumi_megatron.rollout.decoding.generation_mode import last_token_logits

    results = {}
    params = MegatronParams()
    params.transformer_config.recompute_granularity = None
    layout = engine_layout(params)
    for arch in ARCHITECTURES + MOE_ARCHITECTURES:
        src = build_tiny_model(workdir / f"hf_{arch}", arch=arch)
        ckpt = convert_hf_to_megatron(src, workdir / f"mc_{arch}", layout, params, dtype=dtype)
        _, engine = build_engine(ckpt, layout, params, OptimSettings(), dtype=dtype)
        # The reference is always the fp32 HF model.
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval().to(device)
        ids = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            ref_logits = hf(ids.to(device)).logits.float().cpu()
            engine.model[0].eval()
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            mc_logits = engine.model[0](input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=None).float().cpu()
        ref_lp = torch.log_softmax(ref_logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = torch.cat(engine.compute_logprobs([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]))[:, :-1]
        # generation's path: last-position logits of left-padded prompts with an explicit mask
        from oumi_megatron.rollout.decoding.padding import left_padded_batch

        prompts = [ids[0, :20].tolist(), ids[1, :32].tolist()]
        pid, ppos, pmask = left_padded_batch(prompts, pad_id=0)
        last = last_token_logits(engine, pid.to(device), ppos.to(device), pmask.to(device)).float().cpu()
        ref_last = torch.stack([ref_logits[0, 19], ref_logits[1, 31]])
        exported = export_to_hf(ckpt, workdir / f"export_{arch}", layout, params)
        a = load_file(str(next(src.glob("*.safetensors"))))
        b = load_file(str(next(exported.glob("*.safetensors"))))
        extra = sorted(set(b) - set(a))
        reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval().to(device)
        with torch.no_grad():
            reload_logits = reloaded(ids.to(device)).logits.float().cpu()
        # RoPE frequencies, which near-uniform attention at this initialization hides from the logits: Megatron's
        # against HF's, and how far HF's are from the unscaled ones (so a scaling the bridge dropped would show)
        mc_rope = next(m for n, m in engine.model[0].named_modules() if n.endswith("rotary_pos_emb"))
        hf_rope = hf.model.rotary_emb
        dim = hf_rope.inv_freq.numel() * 2
        unscaled = 1.0 / hf.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        rel = lambda x, y: ((x.float().cpu() - y.float().cpu()).abs() / y.float().cpu().abs()).max().item()  # noqa: E731
        results[arch] = {
            "rope_inv_freq_max_rel_diff": rel(mc_rope.inv_freq, hf_rope.inv_freq),
            "rope_scaling_max_rel_effect": rel(hf_rope.inv_freq, unscaled),
            "logits_max_abs_diff": (mc_logits[..., : ref_logits.shape[-1]] - ref_logits).abs().max().item(),
            "logprobs_max_abs_diff": (lp - ref_lp).abs().max().item(),
            "last_token_logits_max_abs_diff": (last[:, : ref_last.shape[-1]] - ref_last).abs().max().item(),
            # a bf16 checkpoint rounds fp32 source weights, so bit-identity is an fp32 property
            "export_bit_identical": set(a) <= set(b) and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a),
            "export_max_abs_diff": max((a[k] - b[k].to(a[k].dtype)).abs().max().item() for k in a),
            "export_extra_keys": extra,
            "export_missing_keys": sorted(set(a) - set(b)),
            "reloaded_logits_max_abs_diff": (reload_logits - ref_logits).abs().max().item(),
        }
    out_json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
