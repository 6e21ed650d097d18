"""The decode step's Triton kernels against the paths they replace (run as a subprocess: TRITON_INTERPRET=1 on a CPU,
compiled on a GPU where CUDA is available, the engine there too).

    [TRITON_INTERPRET=1] python tests/workers/decode_kernels_worker.py CKPT OUT_JSON

- engine/kernels/token_sampling.py against rollout/sampling.py's torch path: greedy tokens (Megatron's vocab padding
  holding the largest logits, a tie), log-probabilities over the whole vocabulary at temperatures 1 and 0.7 (several
  slices a row), a seed's draws repeated, and the frequencies of 600 draws against softmax;
- engine/kernels/decode_attention.py against SDPA over the same cache and mask (fp32 and bf16; a last slot per row and
  one for every row; left padding and holes), and its cache write against indexed assignment;
- the static-cache decoder on the tiny Llama with ``attention_backend: sdpa``, so that its decode steps run both
  kernels: greedy tokens and logprobs against Megatron-Core's schedule path, and multi-turn episodes (observations
  appended, against the schedule path turn by turn: tests/workers/generation_worker.py ``episode_checks``).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter runs on CPU tensors


def generator(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


def sampling_checks() -> dict:
    from oumi_megatron.engine.kernels.token_sampling import SLICE, sample_tokens

    torch.manual_seed(0)
    vocab, columns = SLICE + 1900, SLICE + 1920  # two slices a row; the last 20 columns: vocab padding
    logits = torch.randn(6, columns) * 3
    logits[:, vocab:] = 40.0  # the padding's logits are the largest: in the log-sum-exp, never drawn
    logits[0, 5] = logits[0, SLICE + 3] = logits[0, :vocab].max() + 1  # a tie across the slices: the first wins
    logits = logits.to(DEVICE)
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        tokens, logprobs = sample_tokens(x, 1.0, vocab, True, generator(1))
        ref = torch.log_softmax(x.float(), -1)
        out[f"greedy_tokens_equal_{dtype}"] = tokens.tolist() == x[:, :vocab].argmax(-1).tolist()
        out[f"greedy_logprob_max_abs_diff_{dtype}"] = (logprobs - ref.gather(1, tokens[:, None])[:, 0]).abs().max().item()
    out["greedy_tie_token"] = int(sample_tokens(logits, 1.0, vocab, True, None)[0][0])
    first = sample_tokens(logits, 0.7, vocab, False, generator(3))
    again = sample_tokens(logits, 0.7, vocab, False, generator(3))
    other = sample_tokens(logits, 0.7, vocab, False, generator(4))
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, first[0][:, None])[:, 0]
    out["sampled_in_vocab"] = bool((first[0] < vocab).all())
    out["sampled_logprob_max_abs_diff"] = (first[1] - ref).abs().max().item()
    out["same_seed_same_tokens"] = first[0].tolist() == again[0].tolist()
    out["other_seed_other_tokens"] = first[0].tolist() != other[0].tolist()
    small = torch.tensor([[1.0, 0.0, -1.0, 30.0]], device=DEVICE).repeat(600, 1)  # 3 usable tokens and a padding column
    tokens, _ = sample_tokens(small, 0.5, 3, False, generator(5))
    out["frequencies"] = (torch.bincount(tokens, minlength=4).float() / len(tokens)).tolist()
    out["softmax"] = torch.softmax(small[0, :3].cpu() / 0.5, -1).tolist() + [0.0]
    return out


def attention_checks() -> dict:
    import oumi_megatron.engine.kernels.decode_attention as da
    from oumi_megatron.engine.kernels.attention import sdpa
    from oumi_megatron.engine.kernels.decode_attention import (
        decode_attention,
        rotate_and_write_decode_kv,
        write_decode_kv,
    )
    from oumi_megatron.engine.kernels.rope import fused_rope

    torch.manual_seed(0)
    rows, groups, heads, dim, slots = 5, 2, 6, 80, 150  # 3 query heads a group; a head dim of no power of two
    out = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        q = torch.randn(1, rows, heads, dim).to(DEVICE, dtype)
        keys = torch.randn(rows, groups, slots, dim).to(DEVICE, dtype)
        values = torch.randn(rows, groups, slots, dim).to(DEVICE, dtype)
        valid = torch.rand(rows, slots, device=DEVICE) > 0.3
        valid[:, :7] = False  # left padding
        for label, last in (("per_row", [70, 149, 9, 64, 100]), ("shared", [120])):
            last = torch.tensor(last, device=DEVICE)
            ends = last.expand(rows) if last.numel() == 1 else last
            allowed = valid & (torch.arange(slots, device=DEVICE)[None, :] <= ends[:, None])
            allowed[torch.arange(rows), ends] = True  # the slot a row writes this step is always its own
            got = decode_attention(q, keys, values, allowed, last, dim ** -0.5)
            ref = sdpa(q.permute(1, 2, 0, 3).float(), keys.float(), values.float(), attn_mask=allowed[:, None, None, :],
                       scale=dim ** -0.5, enable_gqa=True)  # [rows, heads, 1, dim]
            ref = ref.permute(2, 0, 1, 3).reshape(1, rows, heads * dim)
            out[f"attention_max_abs_diff_{name}_{label}"] = (got.float() - ref).abs().max().item()
            da.SPLIT_SLOTS, default = 64, da.SPLIT_SLOTS  # 150 slots over three programs a row: the combine kernel
            try:
                split = decode_attention(q, keys, values, allowed, last, dim ** -0.5)
            finally:
                da.SPLIT_SLOTS = default
            out[f"attention_split_max_abs_diff_{name}_{label}"] = (split.float() - ref).abs().max().item()
            # the step's key and value written at each row's slot, as index_copy_ / scatter_ write them (a strided value:
            # a view of the layer's fused QKV projection)
            key = torch.randn(1, rows, groups, dim).to(DEVICE, dtype)
            value = torch.randn(1, rows, groups, 2 * dim).to(DEVICE, dtype)[..., :dim]
            k_got, v_got, k_ref, v_ref = (t.clone() for t in (keys, values, keys, values))
            write_decode_kv(key, value, k_got, v_got, last)
            k_ref[torch.arange(rows), :, ends] = key[0]
            v_ref[torch.arange(rows), :, ends] = value[0]
            out[f"cache_write_equal_{name}_{label}"] = torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
            # the step's RoPE inside both kernels against engine/kernels/rope.py's rotation before them (64 of the 80
            # dims rotated; one angle row for every row, or a row each as in episodes)
            freqs = torch.rand(1, rows if label == "per_row" else 1, 1, 64, device=DEVICE) * 6
            q_view = torch.randn(1, rows, heads, 2 * dim).to(DEVICE, dtype)[..., :dim]  # strided, as the QKV split's
            expected = decode_attention(fused_rope(q_view, freqs.expand(1, rows, 1, 64)), k_got, v_got, allowed, last,
                                        dim ** -0.5)
            got = decode_attention(q_view, k_got, v_got, allowed, last, dim ** -0.5, freqs)
            out[f"rope_attention_max_abs_diff_{name}_{label}"] = (got.float() - expected.float()).abs().max().item()
            k_rope, v_rope = keys.clone(), values.clone()
            q_rope = rotate_and_write_decode_kv(q_view, key, value, k_rope, v_rope, last, freqs)
            k_only = keys.clone()
            write_decode_kv(key, value, k_only, values.clone(), last, freqs)  # the key alone: the same cache
            k_ref = keys.clone()
            k_ref[torch.arange(rows), :, ends] = fused_rope(key, freqs.expand(1, rows, 1, 64))[0]
            out[f"rope_cache_write_max_abs_diff_{name}_{label}"] = max(
                (k.float() - k_ref.float()).abs().max().item() for k in (k_rope, k_only))
            # ... and the query rotated in the same kernel (for SDPA), as the layer's rotation
            q_ref = fused_rope(q_view, freqs.expand(1, rows, 1, 64))
            out[f"rope_query_max_abs_diff_{name}_{label}"] = (q_rope.float() - q_ref.float()).abs().max().item()
            # from the fused QKV projection's own layout (static_cache.KernelQKV): [1, rows, groups, (3 + 2) * dim]
            # without its bias, which the kernel adds as torch's `output + bias` stores it, then rotates
            per_group = heads // groups
            mixed = torch.randn(1, rows, groups, (per_group + 2) * dim).to(DEVICE, dtype)
            bias = torch.randn(groups, (per_group + 2) * dim).to(DEVICE, dtype)
            q_m, k_m, v_m = mixed.split([per_group * dim, dim, dim], dim=-1)
            b_q, b_k, b_v = bias.split([per_group * dim, dim, dim], dim=-1)
            k_fused, v_fused = keys.clone(), values.clone()
            q_fused = rotate_and_write_decode_kv(q_m.unflatten(-1, (per_group, dim)), k_m, v_m, k_fused, v_fused, last,
                                                 freqs, (b_q.unflatten(-1, (per_group, dim)), b_k, b_v))
            summed = mixed + bias  # Megatron-Core's projection: the add, then the query reshaped out of the groups
            q_ref = fused_rope(summed[..., :per_group * dim].reshape(1, rows, heads, dim), freqs.expand(1, rows, 1, 64))
            k_ref, v_ref = keys.clone(), values.clone()
            k_ref[torch.arange(rows), :, ends] = fused_rope(summed[..., per_group * dim:-dim],
                                                            freqs.expand(1, rows, 1, 64))[0]
            v_ref[torch.arange(rows), :, ends] = summed[0, :, :, -dim:]
            out[f"fused_qkv_query_max_abs_diff_{name}_{label}"] = (q_fused.float() - q_ref.float()).abs().max().item()
            out[f"fused_qkv_cache_max_abs_diff_{name}_{label}"] = max(
                (k_fused.float() - k_ref.float()).abs().max().item(), (v_fused.float() - v_ref.float()).abs().max().item())
    return out


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in units of ``ref``'s last place (bf16: 8 significant bits)."""
    ulp = torch.ldexp(torch.ones_like(ref.float()), torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))).int() - 7)
    return ((got.float() - ref.float()).abs() / ulp).max().item()


def norm_checks() -> dict:
    """engine/kernels/norms.py add_rms_norm against torch's add and RMSNorm (a hidden size of no power of two, and one
    wider than a program's block: two passes over a row). bf16 in last places: Triton's interpreter rounds fp32 to
    bf16 toward zero (triton 3.6 interpreter.py ``cast_impl``), a GPU to nearest as torch does."""
    from oumi_megatron.engine.kernels.norms import add_rms_norm

    torch.manual_seed(1)
    out: dict = {"interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    for cols in (80, 3000):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            x, residual = (torch.randn(3, 5, cols).to(DEVICE, dtype) for _ in range(2))
            norm = torch.nn.RMSNorm(cols, eps=1e-5).to(DEVICE, dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.rand(cols) + 0.5)
                normed, total = add_rms_norm(x, residual, norm.weight, 1e-5)
                sum_ref, normed_ref = x + residual, norm(total)  # the norm against torch's of the same sum
            if dtype == torch.float32:
                out[f"add_norm_sum_equal_{name}_{cols}"] = torch.equal(total, sum_ref)
                out[f"add_norm_max_abs_diff_{name}_{cols}"] = (normed - normed_ref).abs().max().item()
            else:
                out[f"add_norm_sum_ulps_{name}_{cols}"] = _ulps(total, sum_ref)
                out[f"add_norm_ulps_{name}_{cols}"] = _ulps(normed, normed_ref)
    return out


def decoder_checks(ckpt: str) -> dict:
    from generation_worker import episode_checks

    import oumi_megatron.engine.kernels.token_sampling as token_sampling
    import oumi_megatron.rollout.decoding.static_cache as static_cache
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.wrappers import unwrap
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend
    from oumi_megatron.rollout.sampling import SamplingParams

    calls = {"decode_attention": 0, "sample_tokens": 0, "rotate_query": 0, "rotate_fused_qkv": 0}

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    static_cache.decode_attention = counted("decode_attention", static_cache.decode_attention)
    static_cache.rotate_and_write_decode_kv = counted("rotate_query", static_cache.rotate_and_write_decode_kv)
    own_layout = static_cache.rotate_and_write_decode_kv

    def fused_layout(query, *args):  # noqa: ANN001, ANN002, ANN202
        calls["rotate_fused_qkv"] += query.dim() == 5 and args[-1] is not None  # KernelQKV's layout and bias
        return own_layout(query, *args)

    static_cache.rotate_and_write_decode_kv = fused_layout
    token_sampling.sample_tokens = counted("sample_tokens", token_sampling.sample_tokens)
    params = MegatronParams()
    params.transformer_config.recompute_granularity = None
    params.transformer_config.attention_backend = "sdpa"
    params.transformer_config.apply_rope_fusion = True  # the layers rotate as the decode kernels do: RoPE moves into them
    _, engine = build_engine(ckpt, engine_layout(params), params, OptimSettings(), dtype=torch.float32)
    # a QKV bias as Qwen2's (the tiny Llama has none): every path below adds it, the decode kernels in the cache write
    for layer in unwrap(engine.model[0]).decoder.layers:
        linear = layer.self_attention.linear_qkv
        bias = 0.5 * torch.randn(linear.weight.shape[0], generator=torch.Generator().manual_seed(3))
        linear.bias = torch.nn.Parameter(bias.to(linear.weight))
    vocab = 259
    rng = torch.Generator().manual_seed(7)  # the prompts: on the host
    # 4 prompts of 1-9 tokens: the interpreter runs each of a kernel's programs in Python, its time grows with the rows
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 10, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(4)]
    schedule = MegatronRolloutBackend(engine, vocab, path="schedule")
    static = MegatronRolloutBackend(engine, vocab, path="static", decode_kernels="true")
    probe = schedule.generate(prompts, SamplingParams(max_new_tokens=8, pad_token_id=256, greedy=True), 1)
    eos = int(torch.tensor([g[0].completion_ids[2] for g in probe]).mode().values)  # some rows end early
    greedy = SamplingParams(max_new_tokens=8, pad_token_id=256, greedy=True, eos_token_id=eos)
    ref = [g[0] for g in schedule.generate(prompts, greedy, 1)]
    before = dict(calls)
    got = [g[0] for g in static.generate(prompts, greedy, 1)]
    used = {k: calls[k] - before[k] for k in calls}
    # megatron.rollout_decode_kernels: false, on the same engine: torch's sampling and SDPA, the same tokens
    off = MegatronRolloutBackend(engine, vocab, path="static", decode_kernels="false")
    before = dict(calls)
    off_got = [g[0] for g in off.generate(prompts, greedy, 1)]
    off_used = {k: calls[k] - before[k] for k in calls}
    # auto: the sampling kernel, the query and key rotated by the cache write, SDPA attends; episodes on it too
    auto = MegatronRolloutBackend(engine, vocab, path="static")
    before = dict(calls)
    auto_got = [g[0] for g in auto.generate(prompts, greedy, 1)]
    return {
        "decoder_auto_path": auto.decoder.path if auto.decoder else None,
        "decoder_auto_kernel_calls": {k: calls[k] - before[k] for k in calls},
        "decoder_auto_greedy_tokens_equal": [r.completion_ids for r in auto_got] == [r.completion_ids for r in ref],
        "decoder_auto_logprob_max_abs_diff": max(abs(a - b) for x, y in zip(auto_got, ref)
                                                 for a, b in zip(x.logprobs, y.logprobs)),
        "decoder_path": static.decoder.path if static.decoder else None,
        "decoder_off_path": off.decoder.path if off.decoder else None,
        "decoder_off_kernel_calls": off_used,
        "decoder_off_greedy_tokens_equal": [r.completion_ids for r in off_got] == [r.completion_ids for r in ref],
        "decoder_off_logprob_max_abs_diff": max(abs(a - b) for x, y in zip(off_got, ref)
                                                for a, b in zip(x.logprobs, y.logprobs)),
        "decoder_greedy_tokens_equal": [r.completion_ids for r in got] == [r.completion_ids for r in ref],
        "decoder_rows_ended_early": sum(1 for r in got if r.finished and len(r.completion_ids) < 8),
        "decoder_logprob_max_abs_diff": max(abs(a - b) for x, y in zip(got, ref) for a, b in zip(x.logprobs, y.logprobs)),
        "decoder_kernel_calls": used,
        # on auto's kernels against the schedule path (the decoder's other references are tests/test_engine.py's)
        **episode_checks(auto, schedule, prompts[:3], eos, references=("reference_schedule",)),  # 6 rows: 1, 2, 3 turns
    }


def main() -> None:
    ckpt, out = sys.argv[1], Path(sys.argv[2])
    result = {**sampling_checks(), **attention_checks(), **norm_checks(), **decoder_checks(ckpt)}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
