"""The SDPA core attention against Megatron-Core's local DotProductAttention (run as a subprocess).

    python tests/workers/attention_worker.py WORKDIR OUT_JSON [float32|bfloat16]

One tiny GQA Llama (4 query heads, 2 key/value heads), converted once, built four times from the same
checkpoint: ``attention_backend: local``, ``sdpa``, ``sdpa`` under Megatron's selective recompute of
core attention (the default recompute setting; recompute must not change a number), all three with the
fusions off, and that third one with every fusion of engine/kernels/fusions.py on (Triton RoPE and SwiGLU,
weight gradients accumulated into main_grad; on the CPU the Triton kernels run in Triton's interpreter
when TRITON_INTERPRET=1), and that one again with logprobs taken in chunks of 7 tokens from the hidden
states (engine/kernels/chunked_logprobs.py). Records, for each
path the engine has, the largest difference between local and sdpa: logprobs of right-padded rows (causal, no mask tensor), logprobs and
entropy of a packed row (block-diagonal mask), greedy KV-cached generation (tokens and their logprobs;
left-padded prompts), and the gradients of one training step on padded rows and one on the packed row
(fp32 main_grad of every parameter). The packed row carries its segment ids, so on a GPU in bf16 the SDPA
runs attend through the varlen kernel (``packed_attention: auto``) while ``local`` uses the mask.
"""

import json
import sys
from pathlib import Path

import torch


def fused_vs_unfused(a: dict, b: dict) -> dict:
    """Largest differences between the unfused run ``a`` and the fused-kernel run ``b``."""
    return {
        "fused_padded_logprobs_max_abs_diff": (a["padded"][:, :-1] - b["padded"][:, :-1]).abs().max().item(),
        "fused_packed_logprobs_max_abs_diff": (a["packed"][:23] - b["packed"][:23]).abs().max().item(),
        "fused_generated_tokens_equal": a["tokens"] == b["tokens"],
        "fused_grad_max_rel_diff": max(((a["grads"][n] - b["grads"][n]).abs().max() / a["grads"][n].abs().max().clamp_min(1e-30)).item()
                                       for n in a["grads"]),
    }


def per_sample_rope() -> dict:
    """engine/kernels/rope.py with a position per sample (freqs [1, b, 1, rot]: the episode decoder's step) against
    Megatron-Core's unfused RoPE, forward and backward (under TRITON_INTERPRET the kernel runs on the CPU)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from oumi_megatron.engine.kernels.rope import fused_rope, fused_rope_covers

    g = torch.Generator().manual_seed(3)
    t = torch.randn(1, 5, 4, 16, generator=g, requires_grad=True)
    freqs = (torch.randint(0, 50, (5,), generator=g).float()[:, None] * torch.rand(12, generator=g)[None])[None, :, None, :]
    ref = _apply_rotary_pos_emb_bshd(t, freqs)
    got = fused_rope(t, freqs)
    upstream = torch.randn(ref.shape, generator=g)
    (grad_ref,) = torch.autograd.grad(ref, t, upstream)
    (grad_got,) = torch.autograd.grad(got, t, upstream)
    return {"per_sample_rope_covered": fused_rope_covers(t, freqs, False),
            "per_sample_rope_max_abs_diff": (ref - got).abs().max().item(),
            "per_sample_rope_grad_max_abs_diff": (grad_ref - grad_got).abs().max().item()}


def main() -> None:
    workdir, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.kernels.attention import core_attention_name
    from oumi_megatron.engine.kernels.fusions import FUSIONS
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron
    from oumi_megatron.engine.wrappers import unwrap
    from oumi_megatron.examples.tiny_models import build_tiny_model
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.trainer.batches import block_causal_mask

    src = build_tiny_model(workdir / "hf_gqa", arch="llama", gqa=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (4, 24), generator=g)
    # one packed row: sequences of 10, 8 and 6 tokens, positions restarting at 0 in each
    lengths = [10, 8, 6]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = {"input_ids": torch.randint(0, 300, (1, 24), generator=g),
              "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
              "attention_mask": block_causal_mask(segment_ids), "segment_ids": segment_ids}
    prompts = [ids[0, :5].tolist(), ids[1, :12].tolist(), ids[2, :9].tolist()]

    runs = {}
    # the third run: SDPA under Megatron's selective recompute of core attention (the default setting)
    # the fourth: SDPA with the fused kernels (engine/kernels/fusions.py) against the third's unfused ops
    for name, backend, recompute, fused in (("local", "local", None, False), ("sdpa", "sdpa", None, False),
                                            ("sdpa_recompute", "sdpa", "selective", False), ("fused", "sdpa", "selective", True),
                                            ("chunked", "sdpa", "selective", True)):
        params = MegatronParams(micro_batch_size=2)
        # the fifth: logprobs and entropy from the hidden states in chunks of 7 tokens, no full logits
        params.logprob_chunk_tokens = 7 if name == "chunked" else 0
        params.transformer_config.recompute_granularity = recompute
        params.transformer_config.attention_backend = backend
        for fusion in FUSIONS:
            setattr(params.transformer_config, fusion, fused)
        layout = engine_layout(params)
        ckpt = workdir / "mc_gqa"
        if not (ckpt / "oumi_megatron.json").is_file():
            convert_hf_to_megatron(src, ckpt, layout, params, dtype=dtype)
        _, engine = build_engine(ckpt, layout, params, OptimSettings(lr=1e-4), dtype=dtype)
        core = core_attention_name(engine.model[0])
        padded = torch.cat(engine.compute_logprobs([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]))
        packed_lp, packed_entropy = engine.compute_logprobs_and_entropy([packed])
        rollouts = [group[0] for group in MegatronRolloutBackend(engine, vocab_size=320).generate(
            prompts, SamplingParams(greedy=True, max_new_tokens=8, pad_token_id=256), 1)]

        def loss_fn(logprobs: torch.Tensor, batch: dict) -> tuple:
            return -logprobs[:, :-1].sum(), torch.tensor(logprobs[:, :-1].numel()), {}

        engine.train_step([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], loss_fn)
        grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in unwrap(engine.model[0]).named_parameters()}
        engine.train_step([packed], loss_fn)  # packed rows: block-diagonal mask, or the varlen kernel (CUDA, bf16)
        packed_grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in unwrap(engine.model[0]).named_parameters()}
        runs[name] = {"core": core, "padded": padded, "packed": packed_lp[0], "entropy": packed_entropy[0],
                      "packed_attention": engine.packed_attention, "packed_grads": packed_grads,
                         "tokens": [r.completion_ids for r in rollouts],
                         "gen_logprobs": torch.tensor([lp for r in rollouts for lp in r.logprobs]), "grads": grads}

    a, b = runs["local"], runs["sdpa"]
    grad_diff = max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"])
    grad_scale = max(a["grads"][n].abs().max().item() for n in a["grads"])
    same_tokens = a["tokens"] == b["tokens"]
    result = {
        "core_attention": {"local": a["core"], "sdpa": b["core"]},
        "padded_logprobs_max_abs_diff": (a["padded"][:, :-1] - b["padded"][:, :-1]).abs().max().item(),
        "packed_logprobs_max_abs_diff": (a["packed"][:23] - b["packed"][:23]).abs().max().item(),
        "packed_entropy_max_abs_diff": (a["entropy"] - b["entropy"]).abs().max().item(),
        "generated_tokens_equal": same_tokens,
        "generated_logprobs_max_abs_diff": (a["gen_logprobs"] - b["gen_logprobs"]).abs().max().item() if same_tokens else None,
        "grad_max_abs_diff": grad_diff,
        "packed_attention": {"local": a["packed_attention"], "sdpa": b["packed_attention"]},
        "packed_grad_max_rel_diff": max(((a["packed_grads"][n] - b["packed_grads"][n]).abs().max()
                                         / a["packed_grads"][n].abs().max().clamp_min(1e-30)).item() for n in a["packed_grads"]),
        "grad_max_abs": grad_scale,
        "recompute_grad_max_abs_diff": max((b["grads"][n] - runs["sdpa_recompute"]["grads"][n]).abs().max().item() for n in b["grads"]),
        "recompute_padded_logprobs_max_abs_diff": (b["padded"] - runs["sdpa_recompute"]["padded"]).abs().max().item(),
        **fused_vs_unfused(runs["sdpa_recompute"], runs["fused"]),
        "chunked_padded_logprobs_max_abs_diff": (runs["fused"]["padded"] - runs["chunked"]["padded"]).abs().max().item(),
        "chunked_packed_logprobs_max_abs_diff": (runs["fused"]["packed"] - runs["chunked"]["packed"]).abs().max().item(),
        "chunked_packed_entropy_max_abs_diff": (runs["fused"]["entropy"] - runs["chunked"]["entropy"]).abs().max().item(),
        "chunked_grad_max_rel_diff": max(((runs["fused"]["grads"][n] - runs["chunked"]["grads"][n]).abs().max()
                                          / runs["fused"]["grads"][n].abs().max().clamp_min(1e-30)).item() for n in runs["fused"]["grads"]),
        "finite": all(torch.isfinite(r[k]).all().item() for r in (a, b) for k in ("padded", "packed", "entropy")),
        **per_sample_rope(),
    }
    out_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
