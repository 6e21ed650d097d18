"""GPU proofs (bf16, NCCL). Skipped, and reported as skipped, on machines without CUDA.

Run by scripts/gpu_check.sh on the lent GPU machine. Tolerances (bf16 vs the fp32 HF reference):
logits and logprobs within 0.1 absolute (bf16 keeps ~3 significant digits; logits here are O(1)).
Across layouts (bf16): the first step's loss within 1e-3 relative, later ones within 5e-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.gpu
PY = str(VENV_BIN / "python")
TORCHRUN = str(VENV_BIN / "torchrun")
WORKERS = REPO / "tests" / "workers"
BF16_TOL = 0.1


def _check(proc) -> None:  # noqa: ANN001
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


@pytest.mark.parametrize("arch", ["llama", "llama3_1", "qwen2", "qwen3"])
def test_bf16_matches_hf_on_gpu(tmp_path_factory: pytest.TempPathFactory, arch: str) -> None:
    work = tmp_path_factory.mktemp(f"gpu_{arch}")
    out = work / "parity.json"
    _check(run_cli([PY, str(WORKERS / "parity_worker.py"), str(work), str(out), "bfloat16"]))
    r = json.loads(out.read_text())[arch]
    assert r["logits_max_abs_diff"] <= BF16_TOL, r
    assert r["logprobs_max_abs_diff"] <= BF16_TOL, r
    assert r["last_token_logits_max_abs_diff"] <= BF16_TOL, r
    assert r["reloaded_logits_max_abs_diff"] <= BF16_TOL, r
    assert r["rope_inv_freq_max_rel_diff"] <= 1e-6, r


def test_sdpa_attention_matches_local_attention_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fast path (torch SDPA: cuDNN/flash kernels, native GQA) against Megatron-Core's local attention,
    bf16 on the GPU: logprobs (padded, packed: varlen kernel vs block-diagonal mask), entropy and
    greedy-generation logprobs within BF16_TOL, gradients (padded and packed rows) within 5% of their
    largest entry (bf16 accumulation order differs)."""
    work = tmp_path_factory.mktemp("gpu_sdpa")
    out = work / "attention.json"
    _check(run_cli([PY, str(WORKERS / "attention_worker.py"), str(work), str(out), "bfloat16"]))
    r = json.loads(out.read_text())
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / "sdpa_vs_local.json").write_text(json.dumps(r))
    assert r["core_attention"] == {"local": "DotProductAttention", "sdpa": "SdpaCoreAttention"}, r
    assert r["finite"], r
    for key in ("padded_logprobs_max_abs_diff", "packed_logprobs_max_abs_diff", "packed_entropy_max_abs_diff"):
        assert r[key] <= BF16_TOL, (key, r)
    if r["generated_tokens_equal"]:  # greedy ties may break differently in bf16
        assert r["generated_logprobs_max_abs_diff"] <= BF16_TOL, r
    assert r["grad_max_abs"] > 0 and r["grad_max_abs_diff"] <= 0.05 * r["grad_max_abs"], r
    # packed rows: SDPA through torch's varlen flash kernel (no mask) against the local block-diagonal mask
    assert r["packed_attention"] == {"local": "mask", "sdpa": "varlen"}, r
    assert r["packed_grad_max_rel_diff"] <= 0.05, r
    # the fused kernels (Triton RoPE/SwiGLU, wgrad accumulated into fp32 main_grad) against the unfused ops
    for key in ("fused_padded_logprobs_max_abs_diff", "fused_packed_logprobs_max_abs_diff"):
        assert r[key] <= BF16_TOL, (key, r)
    assert r["fused_grad_max_rel_diff"] <= 0.05, r
    for key in ("chunked_padded_logprobs_max_abs_diff", "chunked_packed_logprobs_max_abs_diff", "chunked_packed_entropy_max_abs_diff"):
        assert r[key] <= BF16_TOL, (key, r)
    assert r["chunked_grad_max_rel_diff"] <= 0.05, r


def test_cuda_graphs_match_eager_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``cuda_graph_impl: local`` (each layer's forward/backward replayed as a CUDA graph, microbatches
    padded to cuda_graph_seq_length) against the eager engine, bf16: 4 optimizer steps of different
    lengths give the same losses and grad norms within 2%, forward-only logprobs between steps (another
    micro batch size, run eagerly) within BF16_TOL; a resume from a step-2 checkpoint repeats steps 3-4."""
    work = tmp_path_factory.mktemp("gpu_graphs")
    out = work / "graphs.json"
    _check(run_cli([PY, str(WORKERS / "cuda_graph_worker.py"), str(work), str(out)]))
    r = json.loads(out.read_text())
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / "cuda_graphs_vs_eager.json").write_text(json.dumps(r))
    assert r["graphed"] == {"none": False, "local": True}, r
    assert r["finite"], r
    assert r["loss_max_rel_diff"] <= 0.02 and r["grad_norm_max_rel_diff"] <= 0.02, r
    assert r["probe_logprobs_max_abs_diff"] <= BF16_TOL, r
    assert r["resume_max_rel_diff"] <= 1e-3, r  # resumed from step 2 with graphs: steps 3-4 as the straight run


def test_training_cuda_graphs_in_the_grpo_loop_match_eager_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The demo's GRPO loop with training CUDA graphs against the same loop eager, bf16: the first step (same
    rollouts: same seed and weights; generation never replays the training graphs) gives the same loss, grad norm
    and entropy. The loop's padded rows carry segment ids, which eager training sends through the varlen kernel;
    graphed training takes the causal path instead (PackedSeqParams is no graph input, and Megatron-Core's capture
    failed on it). Tolerances as test_cuda_graphs_match_eager_on_gpu (padding to the graphs' length changes the GEMM
    shapes, so bf16 sums differ in their last bits)."""
    firsts = {}
    for variant in ("eager", "graphs"):
        work = tmp_path_factory.mktemp(f"gpu_loop_{variant}")
        _check(run_cli([PY, str(WORKERS / "grpo_loop_worker.py"), str(work), "--steps", "2",
                        *(["--graphs"] if variant == "graphs" else [])]))
        first = json.loads((work / "run" / "metrics.jsonl").read_text().splitlines()[0])
        firsts[variant] = {k: first[k] for k in ("loss", "grad_norm", "entropy", "reward/mean")}
    eager, graphs = firsts["eager"], firsts["graphs"]
    assert graphs["reward/mean"] == eager["reward/mean"], firsts  # the same rollouts
    for key in ("grad_norm", "entropy"):
        assert abs(graphs[key] - eager[key]) <= 0.02 * abs(eager[key]), (key, firsts)
    assert abs(graphs["loss"] - eager["loss"]) <= 1e-3 + 0.02 * abs(eager["loss"]), firsts


def test_fused_optimizer_kernels_match_megatron_fallbacks_on_gpu() -> None:
    """megatron.optimizer_config.fused_kernels: torch's fused AdamW (switched on after Megatron-Core built
    its foreach AdamW) takes the same 3 steps within 1e-6 relative, and the foreach gradient norm equals
    Megatron-Core's per-tensor fallback within 1e-6 relative, fp32."""
    from types import SimpleNamespace

    from megatron.core.utils import local_multi_tensor_l2_norm

    from oumi_megatron.engine.optimizer import foreach_l2norm, use_fused_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(shape, device="cuda", generator=g) for shape in [(256, 128), (128,), (1000, 7)]]
    grads = [[torch.randn(t.shape, device="cuda", generator=g) for t in init] for _ in range(3)]
    runs = []
    for fused in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        adam = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if fused:
            use_fused_kernels(SimpleNamespace(optimizer=adam))
            assert adam.param_groups[0]["fused"] and not adam.param_groups[0]["foreach"]
        for step in grads:
            for p, grad in zip(params, step, strict=True):
                p.grad = grad.clone()
            adam.step()
        runs.append(params)
    for a, b in zip(*runs, strict=True):
        assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    ours, _ = foreach_l2norm(2048, flag, [grads[0]], False)
    theirs, _ = local_multi_tensor_l2_norm(2048, flag, [grads[0]], False)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()


def test_compiled_logprob_statistics_match_the_eager_path_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron.logprob_fusion`` compiled (torch.compile) against the eager chunked path, bf16 on the GPU, a 151,936
    vocabulary, T = 0.7: logprobs and entropy within 1e-4 absolute (fp32 sums in another order; values O(10)), the
    hidden states' and weight's gradients within 1e-2 of their norm (bf16 logit gradients may round the other way)."""
    from oumi_megatron.engine.kernels import chunked_logprobs as cl

    monkeypatch.setattr(cl, "_tp", lambda: (None, 1, 0))
    torch.manual_seed(0)
    hidden = (torch.randn(256, 4, 512, device="cuda") * 0.5).bfloat16()  # [s, b, h]
    weight = (torch.randn(151_936, 512, device="cuda") * 0.05).bfloat16()
    targets = torch.randint(0, 151_936, (4, 256), device="cuda")
    scale = torch.randn(4, 256, device="cuda")
    outs = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, entropy = cl.chunked_token_logprobs(h, w, targets, 0.7, chunk_tokens=384, with_entropy=True,
                                                      fused=fused)
        (logprobs * scale).sum().backward()
        outs.append((logprobs, entropy, h.grad.float(), w.grad.float()))
    (lp, ent, gh, gw), (lp_f, ent_f, gh_f, gw_f) = outs
    assert (lp - lp_f).abs().max() <= 1e-4 and (ent - ent_f).abs().max() <= 1e-4
    assert (gh - gh_f).norm() <= 1e-2 * gh.norm() and (gw - gw_f).norm() <= 1e-2 * gw.norm()


@pytest.mark.parametrize("first", [0, 1536], ids=["first_chunk", "later_chunk"])
def test_prefix_causal_flash_attention_matches_masked_sdpa_on_gpu(first: int) -> None:
    """CP's query-chunk attention on two flash calls merged by log-sum-exp (engine/kernels/chunk_attention.py) against
    SDPA with the boolean mask it replaces: output and q/k/v gradients in bf16, each compared with an fp32
    reference; the flash form may be at most 1.5x the masked form's error plus 1e-3 of the reference's scale."""
    from oumi_megatron.engine.kernels.chunk_attention import prefix_causal_attention

    torch.manual_seed(0)
    n, heads, kv_heads, dim = 512, 8, 2, 128
    q = torch.randn(2, heads, n, dim, device="cuda")
    k, v = (torch.randn(2, kv_heads, first + n, dim, device="cuda") for _ in range(2))
    grad = torch.randn(2, heads, n, dim, device="cuda")
    allowed = torch.arange(first + n, device="cuda")[None, :] <= (first + torch.arange(n, device="cuda"))[:, None]

    def run(fn, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    masked = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # noqa: E731
    ref = run(masked, torch.float32)
    old = run(masked, torch.bfloat16)
    new = run(lambda q, k, v: prefix_causal_attention(q, k, v, first), torch.bfloat16)
    for name, r, o, f in zip(("out", "dq", "dk", "dv"), ref, old, new):
        err_old, err_new = (o - r).abs().max().item(), (f - r).abs().max().item()
        assert err_new <= 1.5 * err_old + 1e-3 * r.abs().max().item(), (name, err_new, err_old)


def test_lora_matches_hf_peft_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LoRA (engine/peft.py, docs/lora.md) in bf16 on the GPU, one rank (tests/workers/lora_worker.py --gpu), against HF
    PEFT in fp32 on the adapter the engine exported: logprobs within BF16_TOL while the adapters move them by several
    times that; adapters switched off give the HF base; the merged export is W + (alpha / r) B A; after an Adam step
    every base weight is bit-identical and the optimizer holds the adapters alone; canonical LoRA on q_proj and v_proj
    alone likewise matches PEFT; the merged weights the embedded backend decodes from (lora_sync: merged) match PEFT
    too, and every base weight comes back bit-identical after them."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("gpu_lora")
    _check(run_cli([PY, str(WORKERS / "lora_worker.py"), str(work), "--gpu"]))
    r = json.loads((work / "result.json").read_text())
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(11))  # the worker's batch

    def base() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(work / "hf", torch_dtype=torch.float32).eval()

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]

    def diff(a: object, b: object) -> float:
        return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())

    ref = r["dp1"]
    base_lp = logprobs(base())
    peft_lp = logprobs(PeftModel.from_pretrained(base(), work / "dp1_adapter_only" / "hf_adapter").eval())
    report = {"peft_max_abs_diff": diff(ref["logprobs"], peft_lp), "adapter_shift": diff(peft_lp, base_lp),
              "adapters_off_max_abs_diff": diff(ref["logprobs_adapters_off"], base_lp)}
    canonical = work / "canonical_adapter_only" / "hf_adapter"
    report["canonical_peft_max_abs_diff"] = diff(r["canonical"]["logprobs"],
                                                 logprobs(PeftModel.from_pretrained(base(), canonical).eval()))
    # the weights the embedded backend decodes from under lora_sync: merged (bf16: one rounding of W + s B A)
    report["merged_peft_max_abs_diff"] = diff(ref["merged"]["logprobs"], peft_lp)
    report["canonical_merged_max_abs_diff"] = diff(r["canonical"]["merged"]["logprobs"], r["canonical"]["logprobs"])
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / "lora_vs_peft.json").write_text(json.dumps(report))
    assert report["peft_max_abs_diff"] <= BF16_TOL, report
    assert report["adapter_shift"] >= 2 * BF16_TOL, report  # the adapters matter: the parity above means something
    assert report["adapters_off_max_abs_diff"] <= BF16_TOL, report
    assert report["canonical_peft_max_abs_diff"] <= BF16_TOL, report
    assert ref["logprobs_back_on"] == ref["logprobs"]  # switching the adapters off is undone exactly
    assert report["merged_peft_max_abs_diff"] <= BF16_TOL and report["canonical_merged_max_abs_diff"] <= BF16_TOL, report
    assert ref["merged"]["restored"] and ref["merged"]["restored_after_rollouts"] and r["canonical"]["merged"]["restored"]
    assert ref["base_changed"] == [] and ref["base_with_grad"] == []
    assert ref["optimizer_params"] == ref["adapter_params"] == 28_672  # 2 layers x (qkv, o, fc1, fc2) at r 8
    adapter, merged, hf = (load_file(next((work / f).glob("*.safetensors"))) for f in
                           ("dp1_adapter_only/hf_adapter", "dp1_merged/hf_model", "hf"))
    name, prefix = "model.layers.1.self_attn.q_proj.weight", "base_model.model.model.layers.1.self_attn.q_proj"
    update = 16.0 / 8 * adapter[f"{prefix}.lora_B.weight"].float() @ adapter[f"{prefix}.lora_A.weight"].float()
    expected = hf[name].float() + update
    assert diff(merged[name].float(), expected) <= 0.01 * float(expected.abs().max()), name  # bf16 rounding of W + BA
    assert diff(merged[name].float(), hf[name].float()) > 0.1 * float(update.abs().max()), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], ["--pp", "2", "--schedule", "zb_h1"], ["--cp", "2"],
                                    ["--tp", "2", "--sequence-parallel"], ["--ep", "2"]],
                         ids=["tp2", "pp2", "pp2_zb_h1", "cp2", "tp2_sp", "moe_ep2"])
def test_two_gpu_layouts_match_one_gpu(tmp_path_factory: pytest.TempPathFactory, layout: list[str]) -> None:
    """Two GPUs (NCCL) against one, bf16; EP on the tiny Qwen3-MoE (all-to-all over NCCL, DP = 2 around it)."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("gpu_layout")
    src = build_tiny_model(work / "hf", arch="qwen3_moe" if "--ep" in layout else "llama")
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "bfloat16"]))
    worker = [str(WORKERS / "engine_worker.py"), str(ckpt), "--steps", "3", "--no-export"]
    _check(run_cli([PY, worker[0], worker[1], str(work / "ref"), *worker[2:]]))
    _check(run_cli([TORCHRUN, "--nproc_per_node", "2", "--master-port", str(free_port()), worker[0], worker[1],
                    str(work / "par"), *worker[2:], *layout]))
    ref = json.loads((work / "ref" / "result.json").read_text())
    got = json.loads((work / "par" / "result.json").read_text())
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-3 * abs(ref["loss"][0])
    for a, b in zip(got["loss"], ref["loss"]):
        assert abs(a - b) <= 5e-3 * abs(b)
    if "zb_h1" in layout:  # the schedule really ran on NCCL and deferred W (the CPU tests pin the exact count)
        assert got["schedule"] == ["zb_h1"] * 3 and min(got["deferred_wgrad_ops"]) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("recompute", [None, "uniform:1"], ids=["no_recompute", "full_recompute"])
def test_module_queue_matches_the_plain_last_stage_on_gpu(tmp_path_factory: pytest.TempPathFactory, recompute: str | None) -> None:
    """ModuleQueue on CUDA (side streams, pinned host copies, the distributed optimizer's buffer detached for
    each step), PP=2 over NCCL, fp32, 3 steps against the plain last stage (tests/workers/module_queue_worker.py):
    losses within 1e-6 relative, gradients and weights within 1e-5 absolute (GPU attention kernels need not be
    bit-reproducible between two runs), layers released when the final norm runs, all back after the step;
    without recompute and with full recompute of every layer (prefetch inside the backward pass)."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("gpu_module_queue")
    src = build_tiny_model(work / "hf", arch="llama")
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "float32"]))
    _check(run_cli([TORCHRUN, "--nproc_per_node", "2", "--master-port", str(free_port()),
                    str(WORKERS / "module_queue_worker.py"), str(ckpt), str(work / "out"), "--chunks", "3",
                    "--distributed-optimizer", *(["--recompute", recompute] if recompute else [])]))
    r = json.loads((work / "out" / "result.json").read_text())
    plain, mq = r["plain"], r["module_queue"]
    assert mq["class_by_rank"] == ["GPTModel", "ModuleQueue"] and mq["active"] == [True] * 3
    for a, b in zip(mq["loss"], plain["loss"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert max(mq["grad_max_abs_diff"]) <= 1e-5 and max(mq["value_max_abs_diff"]) <= 1e-5, mq
    assert mq["layer_bytes_on_device_at_final_norm_by_rank"][-1] == [0] and mq["all_resident_after_step"]
    assert r["module_queue_resumed"]["loss"][0] == pytest.approx(mq["loss"][2], rel=1e-6)


@pytest.mark.parametrize("mode", [["--async-save"], []], ids=["async", "sync"])
def test_checkpoint_resumes_on_gpu(tmp_path_factory: pytest.TempPathFactory, mode: list[str]) -> None:
    """A checkpoint saved in the background (Megatron-Core's staging writer) or synchronously (torch's FileSystemWriter
    streaming GPU tensors, checkpoint_io.py), each rank's optimizer shard as it is (dp_reshardable), resumes exactly."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("gpu_ckpt")
    src = build_tiny_model(work / "hf", arch="qwen2")
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "bfloat16"]))
    worker = str(WORKERS / "engine_worker.py")
    _check(run_cli([PY, worker, str(ckpt), str(work / "full"), "--steps", "3", "--save-at", "2", *mode, "--no-export"]))
    saved = work / "full" / "checkpoints" / "step_000002"
    assert (saved / "trainer_state.json").is_file() and not (saved.parent / ".step_000002.partial").exists()
    _check(run_cli([PY, worker, str(ckpt), str(work / "resumed"), "--steps", "3", "--resume", str(saved), "--no-export"]))
    full = json.loads((work / "full" / "result.json").read_text())
    resumed = json.loads((work / "resumed" / "result.json").read_text())
    assert abs(resumed["loss"][0] - full["loss"][2]) <= 1e-5 * abs(full["loss"][2])


def test_kv_cache_generation_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """fp32 on the GPU: KV-cached generation equals re-running the prefix and transformers' greedy; the static-cache
    decoder's CUDA graphs give the schedule path's tokens."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("gpu_kv")
    src = build_tiny_model(work / "hf", arch="llama")
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "float32"]))
    out = work / "gen.json"
    _check(run_cli([PY, str(WORKERS / "generation_worker.py"), str(ckpt), str(out), "--hf", str(src)]))
    r = json.loads(out.read_text())
    assert r["logits_max_abs_diff"] <= 1e-4, r["logits_max_abs_diff"]  # TF32-free fp32 matmuls; seen on CPU 3e-7
    assert r["greedy_tokens"] == r["hf_greedy_tokens"]
    assert r["sampled_kv_cache"] == r["sampled_no_cache"]
    # the static-cache decoder with CUDA-graph decode steps (issue 30) against the schedule path, fp32
    assert "CUDA-graph decode steps" in r["static_decoder"], r["static_decoder"]
    assert r["static_greedy_tokens"] == r["schedule_greedy_tokens"]
    assert r["static_logprob_max_abs_diff"] <= 1e-4, r["static_logprob_max_abs_diff"]
    assert r["static_grouped_tokens"] == r["static_per_row_tokens"]
    assert r["static_sampled_runs"][0] == r["static_sampled_runs"][1]  # replayed graphs draw what a seed says
    # the second call replayed the first's kept graph (no capture) and drew what a decoder capturing afresh draws
    assert r["static_sampled_capture_s"][0] > 0 and r["static_sampled_capture_s"][1] == 0, r["static_sampled_capture_s"]
    assert r["static_sampled_fresh_capture"] == r["static_sampled_runs"][1]
    # other prompts of that shape: the kept prefill and decode graphs replay on the refilled prompts (no capture) and
    # draw what a decoder running them afresh draws
    assert r["static_other_prompts_equal_fresh"] and r["static_other_prompts_capture_s"] == 0, r
    assert r["static_sampled_distinct_in_groups"] > 16
    # 150 tokens: the replays (every slot under the mask) give the eager steps' (the slots written so far) tokens
    assert r["long_graphs_tokens_equal"], r
    assert r["long_graphs_logprob_max_abs_diff"] <= 1e-4, r["long_graphs_logprob_max_abs_diff"]
    # episodes without a turn barrier: every turn of every row on one captured decode-step graph, the observations
    # appended by captured graphs of their chunk buckets: the episodes of forced tokens and of the turn-synchronous
    # path, logprobs as the trainer recomputes them
    assert all(r["episodes_same_tokens"]) and r["episodes_logprob_max_abs_diff"] <= 1e-4, r
    assert r["episodes_trainer_logprob_max_abs_diff"] <= 1e-4, r
    assert r["episodes_policy_path"] <= r["episodes_decode_steps"] < r["episodes_forced_decode_steps"], r
    assert r["episodes_append_forwards"] >= 1 and r["episodes_stats_agree"], r
    assert "CUDA-graph decode steps" in r["episodes_path"] and r["episodes_capture_s"] > 0, r["episodes_path"]


def test_decode_step_kernels_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The decode step's Triton kernels compiled (fused sampling, attention over the slots in use, the cache write)
    against the paths they replace, and the fp32 static-cache decoder running them (CUDA graphs) against the schedule
    path: the checks tests/test_engine.py runs in Triton's interpreter, at the GPU decoder tolerance above."""
    from oumi_megatron.examples.tiny_models import build_tiny_model
    from test_engine import check_decode_kernels

    work = tmp_path_factory.mktemp("gpu_decode_kernels")
    src = build_tiny_model(work / "hf", arch="llama")
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "float32"]))
    out = work / "decode_kernels.json"
    _check(run_cli([PY, str(WORKERS / "decode_kernels_worker.py"), str(ckpt), str(out)]))
    check_decode_kernels(json.loads(out.read_text()), decoder_atol=1e-4)


@pytest.mark.parametrize(
    "layout", [[], ["--pp", "2", "--packing"], ["--lora"]], ids=["1gpu", "pp2_packed", "lora"]
)
def test_grpo_loop_learns_on_gpu(tmp_path_factory: pytest.TempPathFactory, layout: list[str]) -> None:
    """The demo's GRPO loop (same trainer, rollouts, rewards, hyper-parameters) in bf16 on NCCL.
    The image has no Oumi, so the worker builds the config in Python (tests/workers/grpo_loop_worker.py).
    ``lora``: training.use_peft, r 16 on every linear layer, the KL term on (as the CPU whole-run LoRA test)."""
    two_ranks = "--pp" in layout
    if two_ranks and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    work = tmp_path_factory.mktemp("gpu_grpo")
    worker = [str(WORKERS / "grpo_loop_worker.py"), str(work), "--steps", "80", *layout]
    cmd = [PY, *worker] if not two_ranks else [TORCHRUN, "--nproc_per_node", "2", "--master-port", str(free_port()), *worker]
    _check(run_cli(cmd))
    r = json.loads((work / "result.json").read_text())
    if os.environ.get("GPU_RESULTS"):  # scripts/gpu_check.sh prints these in its table
        (Path(os.environ["GPU_RESULTS"]) / f"grpo_loop_{'_'.join(layout) or '1gpu'}.json").write_text(json.dumps(r))
    assert r["steps"] == 80 and r["hf_model"]
    rewards = r["rewards"]
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.2, [round(x, 3) for x in rewards]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (scripts/gpu_vllm_install.sh)")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_asynchronous_grpo_on_a_separate_engine_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """grpo.max_staleness: 1 on GPUs: the trainer on GPU 0, a separate vLLM engine on GPU 1, the new weights pushed
    over NCCL from the trainer's background thread while it trains (its other NCCL work on the main thread). The
    synchronous loop on the same two GPUs runs first, in the same call, for the step times beside it."""
    runs = {}
    for staleness in (0, 1):
        work = tmp_path_factory.mktemp(f"gpu_async_{staleness}")
        _check(run_cli([PY, str(WORKERS / "grpo_loop_worker.py"), str(work), "--steps", "40", "--vllm-separate",
                        "--max-staleness", str(staleness)], env={"LOCAL_WORLD_SIZE": "1"}))
        runs[staleness] = json.loads((work / "result.json").read_text())
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / "async_grpo.json").write_text(json.dumps(runs))
    sync, late = runs[0], runs[1]
    assert sync["steps"] == late["steps"] == 40
    assert late["staleness_max"] == [0.0] + [1.0] * 39
    assert all(g and g > 0 for g in late["weight_sync_gbps"][1:])
    rewards = late["rewards"]
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.1, [round(x, 3) for x in rewards]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dynamic_sampling_on_two_gpus(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DAPO dynamic sampling on DP=2 over NCCL (the filtered batch's rollouts are all-gathered as objects over the
    DP group): the CPU test's checks (tests/test_grpo_variants.py)."""
    from oumi_megatron.examples.tiny_models import build_tiny_model
    from test_grpo_variants import run_dynamic_sampling_worker

    work = tmp_path_factory.mktemp("gpu_dynamic_sampling")
    run_dynamic_sampling_worker(build_tiny_model(work / "hf", arch="qwen2"), work)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (see scripts/gpu_vllm_install.sh)")
def test_a_gpu_engine_takes_split_buckets_with_a_bare_load(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Streamed pushes into an unquantized GPU engine skip vLLM's layerwise reload (rollout/vllm_engine.py
    ``StreamWeightTransferEngine.layerwise``), and buckets split fused parameters anywhere: an engine started from
    model A that takes model B's tensors one per load computes B (bf16 against fp32 HF: BF16_TOL), and did not before."""
    work = tmp_path_factory.mktemp("gpu_bare_load")
    out = work / "bare_load.json"
    _check(run_cli([PY, str(WORKERS / "bare_load_worker.py"), str(work), str(out)]))
    r = json.loads(out.read_text())
    assert r["layerwise"] is False and r["tensors"] >= 30, r
    assert r["after_max_abs_diff"] <= BF16_TOL, r
    assert r["before_max_abs_diff"] >= 10 * BF16_TOL, r


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (the lent GPU image has none; scripts/gpu_check.sh installs it from "
                           "wheels carried in .vllm/, see docs/benchmarks.md)")
@pytest.mark.parametrize(("placement", "gpus"), [("colocated", 1), ("separate", 2)])
def test_vllm_engine_follows_the_policy_on_gpu(tmp_path_factory: pytest.TempPathFactory, placement: str, gpus: int) -> None:
    """The real vLLM engine on GPU, bf16: separate = trainer on GPU 0, engine process on GPU 1, weights
    streamed over NCCL (weight_sync_method: nccl); colocated = engine in the trainer's process on its
    GPU, asleep while training (weights dropped, refusing to generate until the next sync). After two
    optimizer steps the un-synced engine is off; after the sync
    its logprobs match the trainer's up to bf16 rounding (mean |diff| <= 0.02; the stale engine's is
    several times that)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp(f"gpu_vllm_{placement}")
    src = build_tiny_model(work / "hf", arch="qwen2", head_dim=64)
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "bfloat16"]))
    out = work / "sync.json"
    _check(run_cli([PY, str(WORKERS / "vllm_sync_worker.py"), str(ckpt), str(src), str(out), "--placement", placement,
                    "--method", "nccl", "--dtype", "bfloat16"], env={"LOCAL_WORLD_SIZE": "1"}))
    r = json.loads(out.read_text())
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / f"vllm_gpu_{placement}.json").write_text(json.dumps(r))
    assert r["sync"]["bytes"] > 0 and r["sync"]["tensors"] >= 30, r["sync"]
    assert r["after_sync_mean"] <= 0.02, r
    assert r["stale_engine_mean"] >= 5 * r["after_sync_mean"], r
    if placement == "separate":
        assert "vLLM engine process exited" in r["dead_engine_sync"], r["dead_engine_sync"]
        assert r["sleep"] == {"seconds": 0.0, "weights_dropped": False}, r["sleep"]  # it keeps its own GPU
    else:  # asleep it dropped its weights, refused to generate without them, and took the sync's after waking
        assert r["sleep"]["weights_dropped"] is True, r["sleep"]
        assert "dropped its weights" in r["generate_while_dropped"], r["generate_while_dropped"]


SGLANG_SITE = os.environ.get("OUMI_SGLANG_SITE", "")
"""The lent GPU machine's SGLang set, kept apart from vLLM's (scripts/gpu_check.sh); empty where SGLang is installed as
usual."""


def _sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None or Path(SGLANG_SITE, "sglang").is_dir()


@pytest.mark.skipif(not _sglang_installed(), reason="SGLang not installed (the lent GPU image has none; scripts/gpu_check.sh "
                                                  "installs the parts scripts/pack_sglang_for_gpu.sh makes)")
def test_sglang_engine_follows_the_policy_on_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The real SGLang engine colocated with the trainer on its GPU, bf16 (tests/workers/sglang_worker.py), at the start
    and after each of three updates (two optimizer steps and an in-memory sync each): the weight probe after every sync
    is a tenth or less of the stale engine's before it (a sync that did nothing leaves the stale value), and every row
    where SGLang's greedy tokens differ from the embedded backend's differs at a near-tie: the trainer's logprob margin
    between the two tokens chosen is within twice the engines' measured bf16 noise (their largest logprob difference
    on sampled tokens). The share of equal rows goes to the results (a random tiny model's next-token choices are
    near-ties that bf16 rounding decides; the real model's parity is gpu_check's `sglang` mode)."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = tmp_path_factory.mktemp("gpu_sglang")
    src = build_tiny_model(work / "hf", arch="qwen2", head_dim=64)
    ckpt = work / "mc"
    _check(run_cli(["python", "-m", "oumi_megatron", "convert", "--hf", str(src), "--out", str(ckpt), "--dtype", "bfloat16"]))
    out = work / "sglang.json"
    env = {"LOCAL_WORLD_SIZE": "1"}
    if SGLANG_SITE:
        env["PYTHONPATH"] = os.pathsep.join([SGLANG_SITE, os.environ.get("PYTHONPATH", "")])
    _check(run_cli([PY, str(WORKERS / "sglang_worker.py"), str(ckpt), str(src), str(out), "--placement", "colocated",
                    "--dtype", "bfloat16", "--rows", "64", "--new-tokens", "32", "--syncs", "3"], env=env))
    r = json.loads(out.read_text())
    if os.environ.get("GPU_RESULTS"):
        (Path(os.environ["GPU_RESULTS"]) / "sglang_gpu_colocated.json").write_text(json.dumps(r))
    assert r["sync"]["method"] == "in_memory" and r["sync"]["tensors"] >= 30 and len(r["syncs"]) == 3, r["syncs"]
    for stale, synced in zip(r["probes_stale"], r["syncs"], strict=True):
        assert synced["probe"] <= stale / 10, (r["probes_stale"], r["syncs"])
    noise = r["sampled_logprob_max_abs_diff"]
    for name in ("start", "synced_1", "synced_2", "synced"):
        margins = r[f"{name}_parity"]["divergence_margins"]
        assert all(abs(m) <= 2 * noise + 0.01 for m in margins), (name, noise, margins, r[f"{name}_parity"])


def test_the_push_snapshot_takes_no_gpu_memory() -> None:
    """An asynchronous push's snapshot (rollout/weight_sync/push.py) goes to pinned host memory tensor by tensor: 2 GiB of
    bf16 "exported" CUDA tensors add nothing to what the GPU holds (a GPU clone, as before, added 2 GiB), and the copies
    are exact."""
    from oumi_megatron.rollout.weight_sync.push import host_snapshot

    gen = torch.Generator(device="cuda").manual_seed(0)
    source = [(f"w{i}", torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)) for i in range(16)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    snapshot = host_snapshot(iter(source))
    assert torch.cuda.max_memory_allocated() - before == 0 and torch.cuda.memory_allocated() == before
    assert all(t.device.type == "cpu" and t.is_pinned() for _, t in snapshot)
    assert all(torch.equal(t, s.cpu()) for (_, t), (_, s) in zip(snapshot, source))
