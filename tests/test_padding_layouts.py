"""Issue 28: the layouts that pad sequences, through `oumi train`, on GRPO batches of any width.

Context parallelism pads every microbatch to a multiple of 2 x CP, sequence parallelism to a multiple of TP (in
training), and under expert parallelism the DP ranks, each with its own width, meet in every MoE layer. GRPO
batches have whatever width the step's longest prompt + completion has: ``oumi train`` with CP=2 used to stop in its
first step (logprobs 72 wide against a completion mask 71 wide). Each 2-rank run here is compared, step by step, with
the run that pads nothing (one rank; for EP, expert parallelism off on the same 2 DP ranks): padded rows with a KL
penalty (reference logprobs), truncated importance sampling and truncated-completion masking (the paths that read
the engine's logprobs against the batch's masks), and for CP packed rows without them (packed rows under SP and EP:
tests/test_engine.py::test_packed_microbatches_match_padded, and the EP=2 learning run of test_grpo_trainer.py, whose
batches have every width). Same seeds, same rollouts: every metric agrees to float rounding (seen: <= 2e-6 relative,
grad_norm; 2026-11-28). Each run costs ~40 s of CI's 2 cores, so the runs are few and short.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, free_port, run_cli

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "configs" / "tiny_cpu_grpo.yaml")
STEPS = 2  # step 2 has a reference to differ from (KL > 0)
# 24 tokens: some completions end before the limit, so masking leaves some of each batch to train on
COMMON = ["--training.max_steps", str(STEPS), "--training.save_steps", "0", "--training.save_final_model", "false",
          "--training.include_performance_metrics", "false", "--grpo.max_completion_length", "24"]
OPTIONS = ["--grpo.beta", "0.04", "--grpo.tis_cap", "2.0", "--grpo.mask_truncated_completions", "true"]
PACKED = ["--megatron.enable_sequence_packing", "true"]
RUN_DEPENDENT = ("time/", "tokens_per_s", "rollout/tokens_per_s", "rollout/decode_ms_per_step",  # wall-clock numbers
                 "preflight/")  # and the network preflight: each run measures its own world


def _run(out: Path, model: Path, *overrides: str, nproc: int = 1) -> list[dict]:
    args = ["-m", "oumi", "train", "-c", CONFIG, "--model.model_name", str(model), "--training.output_dir", str(out),
            *COMMON, *overrides]
    cmd = ["python", *args] if nproc == 1 else ["torchrun", "--nproc_per_node", str(nproc), "--master-port",
                                                  str(free_port()), *args]
    proc = run_cli(cmd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _assert_same_run(got: list[dict], want: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1)), what
    for g, w in zip(got, want):
        keys = {k for k in w if not k.startswith(RUN_DEPENDENT) and isinstance(w[k], (int, float))}
        assert keys <= set(g), (what, w["step"], sorted(keys - set(g)))
        for k in sorted(keys):
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (what, w["step"], k, g[k], w[k])
    trained = [r for r in want if "loss" in r]
    assert trained, f"{what}: no step trained on anything"


def _widths(rows: list[dict], sequences: int) -> list[int]:
    """The padded layout's row width per trained step (one sequence per row: processed tokens / sequences)."""
    return [r["batch/processed_tokens"] // sequences for r in rows if "batch/processed_tokens" in r]


def test_context_and_sequence_parallel_equal_one_rank_on_any_width(tmp_path: Path, tiny_model_dir: Path) -> None:
    ref = _run(tmp_path / "ref", tiny_model_dir, *OPTIONS)
    ref_packed = _run(tmp_path / "ref_packed", tiny_model_dir, *PACKED)
    widths = _widths(ref, sequences=32)  # 4 prompts x 8 generations, DP = 1
    # the point of the test: widths that 2 x CP = 4 does not divide (seen 79 in step 1); TP = 2 does not divide 79 either
    assert any(w % 4 for w in widths) and any(w % 2 for w in widths), widths
    # the packed run samples the same first batch (same seed and weights), so its rows hold the same odd longest sequence
    assert ref_packed[0]["reward/mean"] == ref[0]["reward/mean"]
    assert ref[1]["kl"] > 0 and ref[0]["batch/untrained_samples"] > 0  # the KL penalty and the masking are on
    cp2 = ["--megatron.context_parallel_size", "2"]
    _assert_same_run(_run(tmp_path / "cp2", tiny_model_dir, *cp2, *OPTIONS, nproc=2), ref, "cp2")
    _assert_same_run(_run(tmp_path / "cp2_packed", tiny_model_dir, *cp2, *PACKED, nproc=2), ref_packed, "cp2 packed")
    sp = ["--megatron.tensor_model_parallel_size", "2", "--megatron.sequence_parallel", "true"]
    _assert_same_run(_run(tmp_path / "tp2_sp", tiny_model_dir, *sp, *OPTIONS, nproc=2), ref, "tp2_sp")


def test_expert_parallel_equals_local_experts_on_any_width(tmp_path: Path, tiny_moe_dir: Path) -> None:
    """The tiny Qwen3-MoE on 2 DP ranks: EP=2 (tokens reach the other rank's experts by all-to-all, each rank with
    its own batch width) against EP=1 (every expert local). EP adds no padding of its own; with TP > 1 a MoE needs
    SP, whose padding the tp2_sp runs above cover (TP 2 x EP 2 needs 4 ranks, more than CI's 2 cores run)."""
    local = _run(tmp_path / "ep1", tiny_moe_dir, *OPTIONS, nproc=2)
    ep2 = _run(tmp_path / "ep2", tiny_moe_dir, "--megatron.expert_model_parallel_size", "2", *OPTIONS, nproc=2)
    _assert_same_run(ep2, local, "EP=2")
