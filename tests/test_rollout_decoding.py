"""The static-cache decoder's pieces that need no model: device-side token picking and the CUDA-graph decision.
(The decoder itself against Megatron-Core's schedule path, under 1 rank, TP=2 and PP=2 x VPP=2:
tests/test_engine.py, tests/workers/generation_worker.py.)"""

from types import SimpleNamespace

import pytest
import torch

from oumi_megatron.rollout.decoding.decoder import KeptGenerations, resolve_cuda_graphs
from oumi_megatron.rollout.sampling import SamplingParams, pick_tokens

FREQ_ATOL = 0.015  # 40,000 draws: a frequency's standard error is <= 0.0025


def _logits() -> torch.Tensor:
    # 5 usable tokens and 3 columns of Megatron's vocab padding, the largest logits of all (never drawn)
    return torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 9.0, 9.0, 9.0]])


def test_greedy_takes_the_best_usable_token_and_reports_its_full_vocab_logprob() -> None:
    tokens, logprobs = pick_tokens(_logits(), SamplingParams(greedy=True), vocab_size=5)
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx(torch.log_softmax(_logits(), -1)[0, 0].item(), abs=1e-6)


def test_sampling_follows_softmax_over_the_usable_vocab() -> None:
    logits = _logits().expand(40_000, -1).contiguous()
    params = SamplingParams(temperature=0.7)
    tokens, logprobs = pick_tokens(logits, params, vocab_size=5, generator=torch.Generator().manual_seed(0))
    assert int(tokens.max()) < 5
    want = torch.softmax(logits[0, :5] / 0.7, -1)
    got = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert (got - want.double()).abs().max().item() <= FREQ_ATOL
    full = torch.log_softmax(logits[0] / 0.7, -1)  # the full vocabulary, padding included, as the trainer computes
    assert torch.allclose(logprobs, full[tokens], atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = _logits().expand(20_000, -1).contiguous()
    # softmax over the 5 usable tokens: 0.563, 0.207, 0.126, 0.076, 0.028 -> top_p 0.75 keeps the first two
    tokens, _ = pick_tokens(logits, SamplingParams(top_p=0.75), vocab_size=5, generator=torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) == {0, 1}


def test_a_seed_draws_the_same_tokens() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    draw = [pick_tokens(logits, SamplingParams(), 50, torch.Generator().manual_seed(5))[0] for _ in range(2)]
    other = pick_tokens(logits, SamplingParams(), 50, torch.Generator().manual_seed(6))[0]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], other)


def _stages(device: str, pp: int = 1, moe: bool = False) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), pp=pp, is_moe=moe)


@pytest.mark.parametrize(("stages", "requested", "graphs", "why"), [
    (_stages("cuda"), "auto", True, "auto"),
    (_stages("cpu"), "auto", False, "no CUDA device"),
    (_stages("cuda", pp=2), "auto", False, "PP > 1"),
    (_stages("cuda", moe=True), "auto", False, "MoE"),
    (_stages("cuda"), "false", False, "rollout_cuda_graphs: false"),
    (_stages("cuda"), "true", True, "true"),
])
def test_cuda_graph_decision(stages: SimpleNamespace, requested: str, graphs: bool, why: str) -> None:
    got, reason = resolve_cuda_graphs(requested, stages)  # type: ignore[arg-type]
    assert got is graphs
    assert why in reason


def _kernel_stages(device: str, sdpa: bool = True, head_dim: int = 64, unsupported: str | None = None,
                   rope: str | None = None, norms: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), takes_additive_masks=sdpa,
                           attentions=[SimpleNamespace(hidden_size_per_attention_head=head_dim)],
                           unsupported_reason=lambda: unsupported, rope_in_decode_kernels_reason=lambda: rope,
                           fused_residual_norms_reason=lambda: norms)


@pytest.mark.parametrize(("stages", "requested", "on", "why"), [
    (_kernel_stages("cuda"), "auto", (True, False, True, True), "auto; attention on SDPA"),
    (_kernel_stages("cuda", rope="apply_rope_fusion off"), "auto", (True, False, False, True),
     "RoPE in the layers (apply_rope_fusion off)"),
    (_kernel_stages("cuda", norms="norms other than torch's RMSNorm"), "auto", (True, False, True, False),
     "residual adds apart (norms other than torch's RMSNorm)"),
    (_kernel_stages("cuda"), "true", (True, True, True, True), "rollout_decode_kernels: true"),
    (_kernel_stages("cuda", rope="apply_rope_fusion off"), "true", (True, True, False, True),
     "RoPE in the layers (apply_rope_fusion off)"),
    (_kernel_stages("cuda", sdpa=False), "auto", (True, False, True, True), "auto; attention on SDPA"),
    (_kernel_stages("cuda", sdpa=False), "true", None, "decode attention kernel cannot run: layers not on attention_backend: sdpa"),
    (_kernel_stages("cuda", head_dim=512), "true", None, "decode attention kernel cannot run: head dim 512 > 256"),
    (_kernel_stages("cuda", unsupported="multi-latent attention"), "auto", (False, False, False, False), "does not cover"),
    (_kernel_stages("cuda", unsupported="multi-latent attention"), "true", None, "kernels cannot run here"),
    (_kernel_stages("cpu"), "auto", (False, False, False, False), "no CUDA device"),
    (_kernel_stages("cpu"), "true", None, "no CUDA device"),
    (_kernel_stages("cuda"), "false", (False, False, False, False), "rollout_decode_kernels: false"),
])
def test_decode_kernels_decision(stages: SimpleNamespace, requested: str, on: tuple[bool, bool, bool, bool] | None, why: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron.rollout_decode_kernels, decided once per decoder (a CUDA device stands for Triton running: no tensor is
    made on it here): ``auto`` runs the sampling kernel, the step's RoPE in the cache write and the residual adds in the
    norms, ``true`` the attention kernel too (None: an error naming the field); RoPE moves into the kernels only where
    the layers' rotation is their arithmetic, the adds into the norms only where those are torch's RMSNorm."""
    import oumi_megatron.rollout.decoding.decoder as decoder

    monkeypatch.setattr(decoder, "triton_runs_on_device", lambda device: device.type == "cuda")
    if on is None:
        fix = r"megatron.rollout_decode_kernels: true, but .*Set megatron.rollout_decode_kernels: auto"
        with pytest.raises(ValueError, match=fix) as e:
            decoder.resolve_decode_kernels(requested, stages)  # type: ignore[arg-type]
        assert why in str(e.value)
        return
    got = decoder.resolve_decode_kernels(requested, stages)  # type: ignore[arg-type]
    assert (got.sampling, got.attention, got.rope, got.residual_norms) == on
    assert why in got.why, got


def test_cuda_graphs_true_where_they_cannot_run_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"megatron.rollout_cuda_graphs: true.*PP > 1.*Set megatron.rollout_cuda_graphs: auto"):
        resolve_cuda_graphs("true", _stages("cuda", pp=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be one of"):
        resolve_cuda_graphs("sometimes", _stages("cuda"))  # type: ignore[arg-type]


def test_a_kept_graph_is_given_back_only_for_its_shape_and_unmoved_storage() -> None:
    """rollout_cuda_graphs_kept (decoder.py KeptGenerations): a kept generation serves a later call of the same shape
    while the parameters' storage is where its graph was captured; moved storage (ModuleQueue re-attaching its
    weights) drops it, and past the limit the least recently used shape goes."""
    kept = KeptGenerations(limit=2)
    a, b, c = object(), object(), object()
    kept.keep("a", (1, 2), a)
    assert kept.take("a", (1, 3)) is None and kept.take("a", (1, 2)) is None  # moved storage: dropped for good
    kept.keep("a", (1, 2), a)
    kept.keep("b", (1, 2), b)
    assert kept.take("a", (1, 2)) is a  # taken out while it runs ...
    kept.keep("a", (1, 2), a)  # ... and kept again: now the most recently used
    kept.keep("c", (1, 2), c)  # over the limit: "b", the least recently used, goes
    assert list(kept.entries) == ["a", "c"] and kept.take("b", (1, 2)) is None
    assert KeptGenerations(limit=0).take("a", (1, 2)) is None


@pytest.mark.parametrize(("requested", "graphs"), [("auto", True), ("false", False)])
def test_vllm_engines_follow_rollout_cuda_graphs(requested: str, graphs: bool) -> None:
    """vLLM engines capture their own graphs on GPU unless ``false`` asks for eager steps (``enforce_eager``)."""
    from oumi_megatron.rollout.vllm_common import vllm_cuda_graphs

    assert vllm_cuda_graphs(requested) is graphs


def test_vllm_cuda_graphs_true_without_a_gpu_is_an_error_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from oumi_megatron.rollout.vllm_common import vllm_cuda_graphs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine

    with pytest.raises(ValueError, match=r"megatron.rollout_cuda_graphs: true.*no CUDA device.*auto"):
        vllm_cuda_graphs("true")


def test_append_buckets_are_powers_of_two_and_one_and_a_half_times_them() -> None:
    """rollout/decoding/episodes.py ``bucket``: an append's group and chunk sizes come from a few shapes (each a CUDA
    graph), each padding its block by less than a third, and never past the batch's rows."""
    from oumi_megatron.rollout.decoding.episodes import bucket

    sizes = [bucket(n) for n in range(1, 200)]
    assert sorted(set(sizes)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert all(n <= s and (s - n) / s < 1 / 3 for n, s in zip(range(1, 200), sizes))  # padding: under a third
    assert bucket(37) == 48 and bucket(33) == 48 and bucket(49) == 64
    assert bucket(100, cap=64) == 64 and bucket(5, cap=4) == 4
