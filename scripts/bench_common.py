"""What the benchmark scripts share: model shapes, card names and peaks, and the runner of whole-run rows.

Imported by the scripts beside it (``python scripts/bench_X.py`` puts scripts/ first on ``sys.path``). Light to
import: torch, transformers and yaml are imported by the functions that need them, so scripts/gpu_check.py can read
result files with it on a machine where those are slow to load.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oumi_megatron.examples.scale_task import SHAPES as PACKAGE_SHAPES

REPO = Path(__file__).resolve().parents[1]
RUN_GRPO = REPO / "scripts" / "run_grpo.py"
"""The trainer ``oumi train`` runs, without Oumi (configs' megatron:/grpo: sections, rows from a folder): every whole run."""

# -- model shapes ---------------------------------------------------------------------------------------------------
_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _package_dims(name: str) -> dict[str, Any]:
    """The architecture's dimensions of one of examples/scale_task.py's SHAPES (configs/model_shapes/ checks them)."""
    return {k: PACKAGE_SHAPES[name][k] for k in _DIMS}


_LLAMA_0_8B = dict(_arch="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
SHAPES: dict[str, dict[str, Any]] = {
    # name -> the HF config's fields ("_arch": which config class; max_position_embeddings: the run's sequence length
    # where a shape has none). Random weights everywhere: only the shapes matter.
    "0.8b": _LLAMA_0_8B,  # bench_train_step's default, bench_weight_sync's model
    # Llama-3-8B: Llama-3.1-8B's dimensions, RoPE without 3.1's scaling (as measured in docs/benchmarks.md)
    "8b": dict(_arch="llama", **_package_dims("llama-3.1-8b"), rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # a Qwen3-MoE (30B-A3B style, scaled down to 2.6B: 12 layers, 32 experts, 4 per token): SequentialMLP experts
    "moe": dict(_arch="qwen3_moe", vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4,
                moe_intermediate_size=1024, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "qwen7b": dict(_arch="llama", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,  # Qwen2.5-7B
                   num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # bench_logprobs: the 0.8B's layers, 4 of them, with Qwen2.5's 152k vocabulary
    "logprobs-152k": {**_LLAMA_0_8B, "vocab_size": 152064, "num_hidden_layers": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    # bench_rollout's two
    "smollm2-135m": dict(_arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2.5-1.5b": dict(_arch="qwen2", **_package_dims("qwen2.5-1.5b"), max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_theta=1000000.0),
}
LAW_SIZES: dict[str, dict[str, int]] = {  # bench_scale_laws's sizes
    # Llama-3.1's architecture (untied embeddings, SwiGLU, RMSNorm), MHA with head dim 64, narrower and shallower
    "7m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=8192),
    "27m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, vocab_size=16384),
    "110m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, vocab_size=16384),
    "554m": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, vocab_size=32768),
}
TRAIN_SHAPES = ("0.8b", "8b", "moe", "qwen7b", "smollm2-135m", "qwen2.5-1.5b")  # bench_train_step --shape
ROLLOUT_SHAPES = ("smollm2-135m", "qwen2.5-1.5b")  # bench_rollout --shape
_ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def hf_config(shape: str, seq: int | None = None, layers: int | None = None) -> Any:
    """The transformers config of ``SHAPES[shape]``; ``seq`` sets max_position_embeddings, ``layers`` overrides the depth."""
    import transformers

    fields = {**copy.deepcopy(SHAPES[shape]), **({"num_hidden_layers": layers} if layers else {})}
    if seq is not None:
        fields["max_position_embeddings"] = seq
    config_class, architecture = _ARCHITECTURES[fields.pop("_arch")]
    return getattr(transformers, config_class)(**fields, architectures=[architecture])


# -- cards ----------------------------------------------------------------------------------------------------------
CARDS: dict[str, dict[str, float]] = {  # the SXM parts: dense bf16 FLOP/s (MFU's denominator), HBM bytes/s (rooflines)
    "H100": {"bf16_tflops": 989.0, "hbm_bytes_per_s": 3.35e12},
    "H200": {"bf16_tflops": 989.0, "hbm_bytes_per_s": 4.8e12},
}


def apply_settings(raw: dict[str, Any], settings: list[str]) -> None:
    """``--set SECTION.KEY=VALUE`` of the benchmarks: each value read as YAML, into the config's ``raw`` tree."""
    import yaml

    for setting in settings:
        dotted, value = setting.split("=", 1)
        *parents, key = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = yaml.safe_load(value)


def card_name() -> str:
    """The GPU's name as torch reports it, or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _card(name: str) -> dict[str, float] | None:
    return next((v for k, v in CARDS.items() if k in name), None)


def peak_bf16_tflops(name: str) -> float:
    """Dense bf16 TFLOP/s of the card called ``name`` (989, an H100's and H200's, for cards not listed)."""
    card = _card(name)
    return card["bf16_tflops"] if card else 989.0


def hbm_bandwidth(name: str) -> float | None:
    """HBM bytes/s of the card called ``name``, None for cards not listed."""
    card = _card(name)
    return card["hbm_bytes_per_s"] if card else None


# -- the real task (configs/smollm2_arithmetic_gpu.yaml) --------------------------------------------------------------
REAL_CONFIG = REPO / "configs" / "smollm2_arithmetic_gpu.yaml"


@functools.cache
def real_max_prompt_length() -> int:
    """The real task's grpo.max_prompt_length: both libraries' engines get it."""
    import yaml

    return yaml.safe_load(REAL_CONFIG.read_text())["grpo"]["max_prompt_length"]


def rollout_kv_cache_gib(model: str, completions: int, max_len: int) -> float:
    """The KV cache a step's rollouts fill (every completion at full length), with a quarter more for vLLM's blocks."""
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import kv_cache_bytes_per_token
    from oumi_megatron.utils.disk import GIB

    shape = ModelShape.from_file(model)
    return 1.25 * completions * max_len * kv_cache_bytes_per_token(shape, shape.num_layers) / GIB


# -- whole-run rows (bench_grpo, bench_async, bench_scale) -----------------------------------------------------------
class RowFailed(RuntimeError):
    """A row's process failed; its log's tail is the message."""


SGLANG_SITE = "OUMI_SGLANG_SITE"
"""Names, on the lent GPU machine, the folder of SGLang's carried wheel set (scripts/gpu_check.sh sets it): kept apart
from vLLM's set, whose pins differ (pydantic, xgrammar, transformers), and put first on the path of SGLang's runs only."""


def sglang_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with SGLang's carried set first on PYTHONPATH where ``OUMI_SGLANG_SITE`` names
    one; unchanged elsewhere (SGLang installed as usual)."""
    env = dict(os.environ if env is None else env)
    if env.get(SGLANG_SITE):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env[SGLANG_SITE], env.get("PYTHONPATH", "")) if p)
    return env


def run_logged(cmd: list[str], log: Path, sglang: bool = False) -> None:
    """``cmd`` from the repo root, its output to ``log``; raises RowFailed (after printing the log's tail) if it fails.
    ``sglang``: a run that starts SGLang engines (``sglang_env``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    if sglang:
        env = sglang_env(env)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        print(f"{' '.join(cmd[:3])} failed ({proc.returncode}); its log: {log}\n{tail}", flush=True)
        raise RowFailed(f"exit {proc.returncode}: " + tail[-600:].replace("\n", " | "))


def mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the rows that have it, None where none does."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def run_worker(work: Path, cfg: Path, args: Any, flags: list[str], launcher: list[str] | None = None,
               gpus: int = 1, sglang: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """One whole run of scripts/run_grpo.py (the trainer ``oumi train`` runs) on ``cfg`` in ``work``, its log beside
    it; ``args`` has ``rows`` and ``model``; ``launcher``: torchrun's command for several ranks (default: one
    process). Returns its result.json, the steps that count (step 1, the warm-up, left out where there are more) and
    the columns every whole-run row has: tokens/s/GPU (prompt + completion tokens of those steps' batches over their
    step time / ``gpus``, NeMo-RL's definition), step time and its phases, rewards. ``sglang``: see ``run_logged``."""
    shutil.rmtree(work, ignore_errors=True)  # a run left from an earlier call would be resumed, not measured
    run_logged([*(launcher or [sys.executable]), str(RUN_GRPO), str(cfg), str(work), "--rows", args.rows, "--model", args.model,
                *flags], work.parent / f"{work.name}.log", sglang=sglang)
    result = json.loads((work / "result.json").read_text())
    # a row's final checkpoint is not a result: at the 1.5B shape it is ~21 GB, and the rows after it must fit the disk
    shutil.rmtree(work / "run" / "checkpoints", ignore_errors=True)
    train = result["train"]
    steady = train[1:] if len(train) > 1 else train
    step_s = [t["perf/step_s"] or (t["time/rollout_s"] + t["time/logprob_s"] + t["time/train_s"]) for t in steady]
    rewards = [t["reward/mean"] for t in train]
    columns = {
        "tokens_per_s_per_gpu": sum(t["batch/real_tokens"] for t in steady) / sum(step_s) / gpus,
        "step_s": sum(step_s) / len(step_s), "step_s_per_step": step_s,
        **{name: mean_of(steady, f"time/{name}") for name in ("rollout_s", "logprob_s", "train_s", "sync_s")},
        "reward_per_step": rewards, "reward_first10": sum(rewards[:10]) / len(rewards[:10]),
        "reward_last10": sum(rewards[-10:]) / len(rewards[-10:]), "steps": len(train),
    }
    return result, steady, columns


def run_rows(paths: str, known: tuple[str, ...], run: Callable[[str], dict[str, Any]],
             result_file: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Each of the comma-separated ``paths`` (one of ``known``) through ``run``, one after another: (rows, failures).
    One row failing (e.g. TRL with an untested vLLM) must not lose the others' numbers, and ``result_file`` is
    rewritten after every row, so a call cut off later keeps what is done."""
    rows, failed = [], []
    for path in paths.split(","):
        if path not in known:
            raise SystemExit(f"--paths: {', '.join(known)}, not {path!r}")
        started = time.perf_counter()
        try:
            rows.append(run(path))
            rows[-1]["row_wall_s"] = time.perf_counter() - started  # the process: start-up, model load, the steps
            print(f"row done: {json.dumps(rows[-1])}", flush=True)
        except RowFailed as e:
            failed.append(f"{path}: {e}")
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.write_text(json.dumps({"rows": rows, "failed": failed}, indent=1))
    return rows, failed


def print_report(heading: str, table_text: str, failed: list[str]) -> None:
    """The date, ``heading`` (card and command), the markdown table, and the rows that failed (gpu_check greps these)."""
    print(f"\n{time.strftime('%Y-%m-%d')}, {heading}\n")
    print(table_text)
    for f in failed:
        print(f"FAILED {f}")


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def link_cell(r: dict[str, Any]) -> str:
    """A row's weight push against the raw broadcast over the same group: 'GB/s (N% of raw GB/s)', or '-'."""
    if not (r.get("sync_gbps") and r.get("fraction_of_raw")):
        return "-"
    return f"{r['sync_gbps']:.1f} ({100 * r['fraction_of_raw']:.2g}% of {r['raw_gbps']:.0f})"


# -- kernel profiles ---------------------------------------------------------------------------------------------------
def kernel_profile(run: Callable[[], Any], per: int | Callable[[], int] = 1, top: int = 20) -> dict[str, Any]:
    """What ``run()`` (``per`` steps of something; a callable: read after the run) spends per step, kernel by kernel:
    on a GPU the device kernels (and copies) with their device time, on a CPU the aten ops with their own CPU time.
    Returns the ``top`` heaviest as rows (name, calls and microseconds per step, share of the total) and the totals:
    the kernels a step launches and their time, which set against the step's measured time gives the gaps between
    kernels (launches, host waits)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    per = per() if callable(per) else per
    stats = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (cuda and e.device_type != DeviceType.CUDA and e.self_cpu_time_total > 0):
            continue  # on a GPU only the device's own rows (a kernel's row carries no CPU time)
        stats.append((e.key, e.count / per, us / per))
    stats.sort(key=lambda s: -s[2])
    total_us = sum(s[2] for s in stats)
    rows = [{"name": name, "calls_per_step": round(calls, 2), "us_per_step": round(us, 1),
             "share": round(us / total_us, 4) if total_us else 0.0} for name, calls, us in stats[:top]]
    return {"device": "cuda kernels" if cuda else "cpu ops", "steps": per,
            "kernels_per_step": round(sum(s[1] for s in stats), 1), "us_per_step": round(total_us, 1), "rows": rows}


def kernel_table(profile_: dict[str, Any], step_ms: float | None = None, title: str = "") -> str:
    """``kernel_profile``'s result as a markdown table; ``step_ms`` (the step's measured time) adds the gap line."""
    what = "kernel" if profile_["device"] == "cuda kernels" else "aten op (CPU)"
    lines = [f"{title}{profile_['kernels_per_step']:g} {what}s a step, {profile_['us_per_step'] / 1e3:.3f} ms of their time"
             + ("" if step_ms is None else f" against {step_ms:.3f} ms measured (gaps: {step_ms - profile_['us_per_step'] / 1e3:.3f} ms)"),
             "", f"| {what} | calls / step | us / step | share |", "| --- | --- | --- | --- |"]
    for r in profile_["rows"]:
        lines.append(f"| {r['name'][:90]} | {r['calls_per_step']:g} | {r['us_per_step']:.1f} | {100 * r['share']:.1f}% |")
    return "\n".join(lines)
