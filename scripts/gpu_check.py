"""GPU tests and benchmarks in one call, on the lent GPU machine: the harness behind scripts/gpu_check.sh.

    bash scripts/gpu_check.sh                          # installs what the image lacks, then runs this
    GPU_CHECK_BENCH="cp sp" bash scripts/gpu_check.sh  # modes by name (the table below; `--list` prints it)
    python3 scripts/gpu_check.py --bench laws --dry-run  # the commands a call would run, without running them

In order: the GPU tests (tests/test_gpu.py; GPU_CHECK_TESTS="expr" selects them with pytest -k, "none" skips them),
the real-model run (GPU_CHECK_REAL_MODEL names the GGUF), the benchmark modes of GPU_CHECK_BENCH (space-separated
names; "1", the default, is the modes marked default; "0" none), then the tables of what they wrote in $OUT (default
gpu_results). The exit status is the tests'. GPU_CHECK_JOBS="JOB | JOB" runs several settings at once, one GPU each.
Each mode's own settings are GPU_CHECK_* variables, named in its help. A setting that lists several values (seq
lengths, extra bench arguments) is split on whitespace, as the shell script did; GPU_CHECK_NGPU overrides the GPU
count nvidia-smi gives (dry runs on a machine without GPUs).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_common import sglang_env

REPO = Path(__file__).resolve().parents[1]
HF_SMOLLM2 = "output/smollm2_135m_instruct"  # the real task's model, converted from the GGUF once per machine
# the engine before issue 12: SDPA only (fusions, chunked logprobs and fused optimizer kernels off)
NOFUSE = ["--set", "gradient_accumulation_fusion=false", "--set", "apply_rope_fusion=false", "--set", "bias_activation_fusion=false",
          "--set", "optimizer_config.fused_kernels=false", "--logprob-chunk", "0"]
GRAPHS = ["--set", "cuda_graph_impl=local", "--set", "cuda_graph_seq_length=2048"]
PY = ["python3"]


def env(name: str, default: str = "") -> str:
    """A setting: unset and empty both mean the default (the shell's ${NAME:-default})."""
    return os.environ.get(name) or default


def words(name: str, default: str = "") -> list[str]:
    """A setting that lists values, split on whitespace (the shell's unquoted expansion)."""
    return env(name, default).split()


def torchrun(n: int | str) -> list[str]:
    return ["torchrun", "--nproc_per_node", str(n)]


def tail_lines(text: str, n: int) -> list[str]:
    return text.splitlines()[-n:] if n else []


def grep_after(text: str, pattern: str, after: int) -> list[str]:
    """``grep -A AFTER PATTERN``: each matching line and the ``after`` lines that follow it, groups apart joined by --."""
    lines, out, last = text.splitlines(), [], -1
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            start = max(i, last + 1)
            if out and start > last + 1:
                out.append("--")
            out.extend(lines[start:i + after + 1])
            last = min(i + after, len(lines) - 1)
    return out


class Check:
    """One call: where results go, the GPU count, and the command runner (or, with ``dry_run``, its printer)."""

    def __init__(self, results: Path, ngpu: int, dry_run: bool) -> None:
        self.results, self.ngpu, self.dry_run = results, ngpu, dry_run

    def out(self, name: str) -> str:
        return f"{self.results}/{name}"

    def sh(self, argv: list[str], *, log: str | None = None, tail: int | None = None, head: int | None = None,
           sglang: bool = False) -> int:
        """``argv`` with stdout and stderr together: into ``log`` if given, then its first ``head`` or last ``tail``
        lines printed (``cmd 2>&1 | tee LOG | tail -N``). Its exit status; a failure stops nothing (as in the shell).
        ``sglang``: a command that starts SGLang engines (SGLang's carried set first on its path: bench_common.sglang_env)."""
        if self.dry_run:
            notes = ([f"> {log}"] if log else []) + ([f"tail -{tail}"] if tail else []) + ([f"head -{head}"] if head else [])
            print(shlex.join(argv) + (f"  # {', '.join(notes)}" if notes else ""))
            return 0
        run_env = sglang_env() if sglang else None
        if log is None:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env)
            text = proc.stdout.decode(errors="replace")
        else:
            with open(log, "wb") as f:
                proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=run_env)
            text = Path(log).read_text(errors="replace")
        shown = text.splitlines()[:head] if head else tail_lines(text, tail or 0)
        if shown:
            print("\n".join(shown))
        return proc.returncode

    def note(self, text: str) -> None:
        """What a dry run would do besides commands (copies, removals), as a comment."""
        if self.dry_run:
            print(f"# {text}")

    def ensure_hf_model(self, gguf_setting: str, tail: int) -> None:
        """The real task's HF folder, converted from the GGUF that ``gguf_setting`` names where it is not there yet."""
        if Path(HF_SMOLLM2, "config.json").is_file():
            return
        gguf = env(gguf_setting)
        if not gguf:
            raise SystemExit(f"{gguf_setting}: unset, and {HF_SMOLLM2} is not there (the GGUF it is converted from)")
        self.sh([*PY, "-m", "oumi_megatron", "gguf-to-hf", "--gguf", gguf, "--out", HF_SMOLLM2], tail=tail)

    def whole_run(self, argv: list[str], name: str) -> None:
        """A whole-run bench (grpo, async, scale): its log's last 6000 bytes kept as NAME.tail (they come back even
        when the call is cut off later), and its table, row and FAILED lines printed (or the tail's last 40 lines)."""
        log, kept = self.out(f"{name}.log"), self.out(f"{name}.tail")
        self.sh(argv, log=log)
        self.note(f"tail -c 6000 {log} > {kept}; rm {log}")
        if self.dry_run:
            return
        Path(kept).write_bytes(Path(log).read_bytes()[-6000:])
        Path(log).unlink()
        text = Path(kept).read_text(errors="replace")
        shown = [line for line in text.splitlines() if re.match(r"\||FAILED|20", line)] or tail_lines(text, 40)
        if shown:
            print("\n".join(shown))

    def copy(self, src: str, dst: str) -> None:
        """``cp SRC DST 2>/dev/null``: nothing where SRC is missing."""
        self.note(f"cp {src} {dst}")
        if not self.dry_run and Path(src).is_file():
            shutil.copyfile(src, dst)

    def train_step(self, launcher: list[str], args: list[str], out: str, tail: int) -> None:
        self.sh([*launcher, "scripts/bench_train_step.py", *args, "--out", self.out(out)], tail=tail)


# -- the modes, in the order a call runs them ------------------------------------------------------------------------
def mode_none(c: Check) -> None:
    print("benchmarks skipped (GPU_CHECK_BENCH=0)")


def mode_laws(c: Check) -> None:
    # the slice's ~53 GB checkpoint on a RAM disk where /dev/shm has the room, else the disk
    laws_dir = "/tmp/oumi_laws"
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free // 2**30 >= 75:
        laws_dir = "/dev/shm/oumi_laws"
    c.sh(["df", "-h", "/", "/dev/shm"], tail=2)
    c.sh(["free", "-g"], head=2)
    c.sh([*PY, "scripts/bench_scale_laws.py", "--gpu", "--state-dir", laws_dir, "--json", c.out("slice.json"),
          *[a for s in words("GPU_CHECK_LAWS_SET") for a in ("--set", s)]],
         log=c.out("slice.log"), tail=12)
    c.note(f"rm -rf {laws_dir}")
    if not c.dry_run:
        shutil.rmtree(laws_dir, ignore_errors=True)


def mode_train1(c: Check) -> None:
    # the HF reference, the engine before, the fast path and the fast path + CUDA graphs: same call, same card
    c.train_step(PY, ["--hf-reference", *NOFUSE], "bench_1gpu_a_unfused.json", 3)
    # the step without graphs is host-bound, so its tokens/s vary between processes: a row per repeat
    for k in range(1, int(env("GPU_CHECK_REPEAT", "1")) + 1):
        c.train_step(PY, [], f"bench_1gpu_b_fast_{k}.json", 3)
    c.train_step(PY, GRAPHS, "bench_1gpu_c_fast_graphs.json", 3)


def mode_bisect(c: Check) -> None:
    for f in ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion", "optimizer_config.fused_kernels"):
        c.train_step(PY, [*GRAPHS, "--set", f"{f}=false"], f"bench_1gpu_no_{f}.json", 3)
    c.train_step(PY, [*GRAPHS, "--logprob-chunk", "4096"], "bench_1gpu_chunked_logprobs.json", 3)


def mode_logprobs(c: Check) -> None:
    c.sh([*PY, "scripts/bench_logprobs.py", "--out", c.out("logprobs.json")], tail=3)


def bench_table(c: Check, argv: list[str], log: str, shape: str, rows: int) -> None:
    """Runs a generation bench into ``log``; prints its table (the line starting ``| SHAPE`` and ``rows`` after it),
    and its last 30 lines when it failed."""
    rc = c.sh(argv, log=log)
    if c.dry_run:
        return
    text = Path(log).read_text(errors="replace")
    shown = (tail_lines(text, 30) if rc else []) + grep_after(text, rf"^\| {shape}", rows)
    if shown:
        print("\n".join(shown))


def mode_rollout(c: Check) -> None:
    for job in words("GPU_CHECK_ROLLOUT", "smollm2-135m:128x128 qwen2.5-1.5b:128x128"):
        shape, batch, *paths = job.split(":")
        log = c.out(f"rollout_{shape}_{batch}.log")
        argv = [*PY, "scripts/bench_rollout.py", "--shape", shape, "--batch", batch, *(["--paths", paths[0]] if paths and paths[0] else []),
                "--out", c.out(f"rollout_{shape}_{batch}.json")]
        bench_table(c, argv, log, shape, 6)


def mode_episodes(c: Check) -> None:
    """Multi-turn episodes against single-turn generation (scripts/bench_episodes.py), GPU_CHECK_EPISODES jobs of
    SHAPE:ROWSxNEW:TURNS[:CUDA_GRAPHS]."""
    for job in words("GPU_CHECK_EPISODES", "smollm2-135m:128x192:3 qwen2.5-1.5b:128x192:3"):
        shape, batch, turns, *graphs = job.split(":")
        tag = f"{shape}_{batch}_{turns}" + (f"_graphs_{graphs[0]}" if graphs else "")
        log = c.out(f"episodes_{tag}.log")
        argv = [*PY, "scripts/bench_episodes.py", "--shape", shape, "--batch", batch, "--turns", turns,
                *(["--cuda-graphs", graphs[0]] if graphs else []), "--out", c.out(f"episodes_{tag}.json")]
        bench_table(c, argv, log, shape, 5)


def mode_grpo(c: Check) -> None:
    # real: GPU_CHECK_GGUF names the GGUF (GPU_CHECK_REAL_MODEL would also start the real-model run); scale: the random
    # Qwen2.5-1.5B shape, built by the bench. Work dirs stay in /tmp/grpo: checkpoints must not travel back.
    for task in words("GPU_CHECK_GRPO_TASKS", "real"):
        if task == "real":
            c.ensure_hf_model("GPU_CHECK_GGUF", tail=2)
            model, rows = HF_SMOLLM2, ".gpu_real/rows"
        else:
            model, rows = "/tmp/scale_model", "/tmp/scale_rows"
        c.whole_run([*PY, "scripts/bench_grpo.py", "--task", task, "--model", model, "--rows", rows,
                     "--steps", env("GPU_CHECK_GRPO_STEPS", "20"), "--paths", env("GPU_CHECK_GRPO_PATHS", "embedded,trl"),
                     "--profile", "--out", "/tmp/grpo", "--results", str(c.results), *words("GPU_CHECK_GRPO_ARGS"),
                     *[a for s in words("GPU_CHECK_GRPO_SET") for a in ("--set", s)]], f"grpo_{task}")


def mode_async(c: Check) -> None:
    c.ensure_hf_model("GPU_CHECK_GGUF", tail=2)
    c.whole_run([*PY, "scripts/bench_async.py", "--model", HF_SMOLLM2, "--rows", ".gpu_real/rows",
                 "--steps", env("GPU_CHECK_ASYNC_STEPS", "120"), "--paths", env("GPU_CHECK_ASYNC_PATHS", "sync_dp2,sync_separate,async"),
                 "--out", "/tmp/async", "--results", str(c.results)], "async")


def mode_scale(c: Check) -> None:
    # the model (built on the GPU by the bench) and the work dirs stay in /tmp
    c.whole_run([*PY, "scripts/bench_scale.py", "--model", "/tmp/scale_llama", "--rows", "/tmp/scale_rows", "--out", "/tmp/scale",
                 "--results", str(c.results), "--gpus", str(c.ngpu), *words("GPU_CHECK_SCALE_ARGS")], "scale")


def mode_loop(c: Check) -> None:
    for v in words("GPU_CHECK_LOOP", "unfused fast graphs"):
        log = c.out(f"loop_{v}.log")
        flag = [] if v == "fast" else [f"--{v}"]
        if c.sh([*PY, "tests/workers/grpo_loop_worker.py", f"/tmp/loop_{v}", "--steps", "80", *flag], log=log) and not c.dry_run:
            print("\n".join(tail_lines(Path(log).read_text(errors="replace"), 20)))
        c.copy(f"/tmp/loop_{v}/result.json", c.out(f"grpo_loop_1gpu_{v}.json"))


def mode_train2(c: Check) -> None:
    for layout in (["--tp", "2"], ["--pp", "2"]):
        name = "".join(layout).strip("-")
        c.train_step(torchrun(2), [*layout, *NOFUSE], f"bench_2gpu_{name}_a_unfused.json", 2)
        c.train_step(torchrun(2), layout, f"bench_2gpu_{name}_b_fast.json", 2)


def mode_zb(c: Check) -> None:
    for pp in words("GPU_CHECK_ZB_PP", "2 4"):
        if c.ngpu < int(pp):
            continue
        for k in range(1, int(env("GPU_CHECK_REPEAT", "1")) + 1):
            for m in words("GPU_CHECK_ZB_MICROBATCHES", "8"):  # the 1F1B bubble is (pp - 1) / (m + pp - 1) of the step
                for s in ("1f1b", "zb_h1"):
                    c.train_step(torchrun(pp), ["--pp", pp, "--microbatches", m, "--schedule", s, *words("GPU_CHECK_ZB_ARGS")],
                                 f"bench_pp{pp}_m{m}_{s}_{k}.json", 2)


def mode_mq(c: Check) -> None:
    for k in words("GPU_CHECK_MQ_CHUNKS", "0 2 4 8"):
        c.train_step(torchrun(2), ["--pp", "2", "--shape", "qwen7b", "--seq", "4096", "--mbs", "1", "--microbatches", "4", "--steps", "3",
                                   "--module-queue", k, *words("GPU_CHECK_MQ_ARGS")],
                     f"mq_{env('GPU_CHECK_MQ_TAG', 'default')}_k{k}.json", 2)


def mode_cp(c: Check) -> None:
    extra = words("GPU_CHECK_CP_ARGS")
    for seq in words("GPU_CHECK_CP_SEQS", "16384 32768"):  # CP=1 may run out of memory at the longest: recorded as such
        c.train_step(PY, ["--seq", seq, "--mbs", "1", "--microbatches", "2", "--steps", "3", *extra], f"bench_cp1_seq{seq}.json", 2)
        c.train_step(torchrun(2), ["--cp", "2", "--seq", seq, "--mbs", "1", "--microbatches", "2", "--steps", "3", *extra],
                     f"bench_cp2_seq{seq}.json", 2)


def mode_sp(c: Check) -> None:
    for seq in words("GPU_CHECK_SP_SEQS", "8192"):
        for sp in ([], ["--sequence-parallel"]):
            c.train_step(torchrun(2), ["--tp", "2", *sp, "--seq", seq, "--mbs", "1", "--microbatches", "4", "--steps", "3",
                                       *words("GPU_CHECK_SP_ARGS")], f"bench_tp2{'_sp' if sp else ''}_seq{seq}.json", 2)


def mode_moe(c: Check) -> None:
    extra = words("GPU_CHECK_MOE_ARGS")
    c.train_step(PY, ["--shape", "moe", "--seq", "4096", "--mbs", "1", "--microbatches", "4", "--steps", "3", *extra],
                 "bench_moe_ep1.json", 2)
    c.train_step(torchrun(2), ["--shape", "moe", "--ep", "2", "--seq", "4096", "--mbs", "1", "--microbatches", "4", "--steps", "3",
                               *extra], "bench_moe_ep2.json", 2)


def mode_plan(c: Check) -> None:
    one_step = ["--mbs", "1", "--warmup", "1", "--steps", "1"]
    c.train_step(PY, [*one_step, "--seq", "16384", "--microbatches", "2", "--recompute", "full"], "plan_1gpu_full_recompute.json", 1)
    if c.ngpu < 2:
        return
    pp2 = [*one_step, "--pp", "2", "--seq", "8192", "--microbatches", "4"]
    dp2 = [*one_step, "--seq", "8192", "--microbatches", "2"]
    c.train_step(torchrun(2), pp2, "plan_pp2.json", 1)
    c.train_step(torchrun(2), [*pp2, "--module-queue", "4"], "plan_pp2_module_queue.json", 1)
    c.train_step(torchrun(2), dp2, "plan_dp2_distributed_optimizer.json", 1)
    c.train_step(torchrun(2), [*dp2, "--set", "ddp_config.use_distributed_optimizer=false"], "plan_dp2_plain_optimizer.json", 1)


def mode_8b(c: Check) -> None:
    c.train_step(torchrun(2), ["--shape", "8b", "--tp", "2", "--steps", "4"], "bench_8b_tp2_a_fast.json", 2)
    c.train_step(torchrun(2), ["--shape", "8b", "--tp", "2", "--steps", "4", *GRAPHS], "bench_8b_tp2_b_graphs.json", 2)


def mode_lora(c: Check) -> None:
    c.sh([*PY, "scripts/bench_lora_layer.py", "--layers", "8", "--seq", "256", "--mbs", "16", "--microbatches", "4",
          "--rows", "128", "--out", c.out("lora_layer.json")], log=c.out("lora_layer.log"), tail=20)


def mode_sglang(c: Check) -> None:
    # the colocated SGLang engine against the embedded backend on the real task's model, bf16 (tests/workers/sglang_worker.py)
    c.ensure_hf_model("GPU_CHECK_GGUF", tail=2)
    ckpt = "/tmp/sglang_smollm2_mc"
    if not Path(ckpt).is_dir():
        c.sh([*PY, "-m", "oumi_megatron", "convert", "--hf", HF_SMOLLM2, "--out", ckpt, "--dtype", "bfloat16"], tail=2)
    c.sh([*PY, "tests/workers/sglang_worker.py", ckpt, HF_SMOLLM2, c.out("sglang_smollm2.json"), "--placement", "colocated",
          "--dtype", "bfloat16", "--rows", env("GPU_CHECK_SGLANG_ROWS", "128"), "--new-tokens", "64", "--syncs", "3"],
         log=c.out("sglang_smollm2.log"), tail=4, sglang=True)


def mode_sync(c: Check) -> None:
    c.sh([*PY, "scripts/bench_weight_sync.py", "--out", c.out("sync.json")], tail=20)


def mode_sync_slice(c: Check) -> None:
    c.sh([*PY, "scripts/bench_weight_sync.py", "--slice", "--out", c.out("sync_slice.json")], log=c.out("sync_slice.log"),
         tail=8)


def mode_sync_colocated(c: Check) -> None:
    c.sh([*PY, "scripts/bench_weight_sync.py", "--colocated-slice", "--out", c.out("sync_colocated.json")],
         log=c.out("sync_colocated.log"), tail=8)


@dataclass(frozen=True)
class Mode:
    name: str
    min_gpus: int
    run: Callable[[Check], None]
    help: str
    default: bool = False  # one of GPU_CHECK_BENCH=1's


MODES = [
    Mode("0", 0, mode_none, "no benchmarks (the tests and the real-model run only)"),
    Mode("laws", 1, mode_laws, "the Llama-3.1-70B-wide slice's convert / GRPO step / checkpoint save / load / export against "
         "the plan (scripts/bench_scale_laws.py --gpu; issue 43)"),
    Mode("train1", 1, mode_train1, "one-GPU training step: HF reference, the engine before issue 12, the fast path "
         "(GPU_CHECK_REPEAT times, one process each), the fast path + CUDA graphs", default=True),
    Mode("bisect", 1, mode_bisect, "the fast path + CUDA graphs with each fusion off in turn, and with chunked logprobs"),
    Mode("logprobs", 1, mode_logprobs, "the 152k-vocabulary logprob benchmark, full logits vs chunked", default=True),
    Mode("episodes", 1, mode_episodes, "multi-turn episodes vs single-turn generation, embedded backend "
         "(scripts/bench_episodes.py) for each SHAPE:ROWSxNEW:TURNS of GPU_CHECK_EPISODES"),
    Mode("rollout", 1, mode_rollout, "generation (scripts/bench_rollout.py) for each SHAPE:ROWSxNEW[:PATHS] of GPU_CHECK_ROLLOUT"),
    Mode("grpo", 1, mode_grpo, "whole GRPO runs, this project vs TRL (scripts/bench_grpo.py) for each task of GPU_CHECK_GRPO_TASKS "
         "(default real; real needs GPU_CHECK_GGUF), GPU_CHECK_GRPO_STEPS, GPU_CHECK_GRPO_PATHS, GPU_CHECK_GRPO_SET (K=V ...), "
         "GPU_CHECK_GRPO_ARGS (more bench arguments, e.g. --micro-batch 64)"),
    Mode("async", 2, mode_async, "asynchronous GRPO (1 trainer GPU + 1 engine GPU) against synchronous DP=2 and the same "
         "placement synchronously, real task (scripts/bench_async.py; GPU_CHECK_GGUF, GPU_CHECK_ASYNC_STEPS, GPU_CHECK_ASYNC_PATHS)"),
    Mode("scale", 1, mode_scale, "GRPO at scale on the Llama-3.1-8B shape against NeMo-RL (scripts/bench_scale.py; --gpus is the "
         "machine's; GPU_CHECK_SCALE_ARGS)"),
    Mode("loop", 1, mode_loop, "the tiny GRPO loop on 1 GPU for each variant of GPU_CHECK_LOOP (default: unfused fast graphs)"),
    Mode("train2", 2, mode_train2, "TP=2 and PP=2 training steps, before issue 12 and fast", default=True),
    Mode("zb", 2, mode_zb, "ZB-H1 against 1F1B for each PP of GPU_CHECK_ZB_PP (default 2 4, as GPUs allow), GPU_CHECK_REPEAT "
         "times, for each of GPU_CHECK_ZB_MICROBATCHES (default 8); GPU_CHECK_ZB_ARGS more bench arguments"),
    Mode("mq", 2, mode_mq, "ModuleQueue off and with GPU_CHECK_MQ_CHUNKS (default 0 2 4 8) on PP=2, Qwen2.5-7B shape "
         "(GPU_CHECK_MQ_ARGS more bench arguments, GPU_CHECK_MQ_TAG names one setting's result files)"),
    Mode("cp", 2, mode_cp, "CP=2 on 2 GPUs against CP=1 on one at GPU_CHECK_CP_SEQS (default 16384 32768; GPU_CHECK_CP_ARGS)"),
    Mode("sp", 2, mode_sp, "TP=2 with and without sequence parallelism at GPU_CHECK_SP_SEQS (default 8192; GPU_CHECK_SP_ARGS)"),
    Mode("moe", 2, mode_moe, "the Qwen3-MoE shape (2.6B, 32 experts) EP=1 on 1 GPU vs EP=2 on 2 (GPU_CHECK_MOE_ARGS)"),
    Mode("plan", 1, mode_plan, "the memory plan's estimate vs max_memory_allocated: full recompute; with 2 GPUs also PP=2 "
         "+/- ModuleQueue, DP=2 +/- the distributed optimizer"),
    Mode("8b", 2, mode_8b, "Llama-3-8B dimensions with TP=2, with and without CUDA graphs (2 x H200)"),
    Mode("lora", 1, mode_lora, "LoRA's adapter output in one GEMM against Megatron-Bridge's forward: train fwd+bwd and a "
         "decode-shaped forward on 8 of the 1.5B shape's layers (scripts/bench_lora_layer.py)"),
    Mode("sglang", 1, mode_sglang, "the colocated SGLang engine's greedy parity with the embedded backend and its weight "
         "probe after each of 3 syncs, SmolLM2-135M in bf16 (tests/workers/sglang_worker.py; GPU_CHECK_GGUF, "
         "GPU_CHECK_SGLANG_ROWS)"),
    Mode("sync", 2, mode_sync, "the weight-sync benchmark, trainer GPU 0 -> receiver GPU 1", default=True),
    Mode("sync_slice", 1, mode_sync_slice, "one sender's export and push snapshot at the 70B and 405B widths, 1 and 2 "
         "layers, extrapolated to the whole models (scripts/bench_weight_sync.py --slice; issue 45)"),
    Mode("sync_colocated", 1, mode_sync_colocated, "the colocated vLLM sync at the 70B width, 1 and 2 layers, extrapolated "
         "to one rank of a 70B TP 8 sync (scripts/bench_weight_sync.py --colocated-slice; needs vLLM carried; issue 45)"),
]


def select_modes(bench: str) -> list[Mode]:
    """The modes GPU_CHECK_BENCH names ("1": the default ones), in MODES' order; each runs once."""
    names = bench.split()
    unknown = set(names) - {m.name for m in MODES} - {"1"}
    if unknown:
        print(f"GPU_CHECK_BENCH: no mode {', '.join(sorted(unknown))} (modes: {', '.join(m.name for m in MODES)})", file=sys.stderr)
    return [m for m in MODES if m.name in names or (m.default and "1" in names)]


# -- the tests, the real-model run, the jobs ---------------------------------------------------------------------------
def run_tests(c: Check) -> int:
    """tests/test_gpu.py (GPU_CHECK_TESTS: pytest -k; "none" skips them); its log kept, its last 25 lines shown."""
    expr = env("GPU_CHECK_TESTS")
    if expr == "none":
        return 0
    argv = [*PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/test_gpu.py", "-rs", *(["-k", expr] if expr else [])]
    return c.sh(argv, log=c.out("gpu_tests.log"), tail=25)


def run_real_model(c: Check) -> None:
    """configs/smollm2_arithmetic_gpu.yaml through scripts/run_grpo.py when GPU_CHECK_REAL_MODEL names the GGUF: rows and
    Oumi's gsm8k reward from .gpu_real/rows (scripts/prepare_gpu_real_model.py). GPU_CHECK_REAL_STEPS caps the steps (a
    run resumes from output/ on a machine still warm), GPU_CHECK_REAL_BASE evaluates the base model too,
    GPU_CHECK_REAL_BACKEND=vllm rolls out with vLLM (GPU_CHECK_REAL_KV_GIB sizes its KV cache), GPU_CHECK_REAL_BUDGET_S
    (default 540) stops it in time for its metrics to come back, GPU_CHECK_REAL_SAVE_STEPS checkpoints more often,
    GPU_CHECK_REAL_CONFIG runs another config of the task (e.g. configs/smollm2_arithmetic_large_calculator_gpu.yaml; its
    rows prepared for it, in GPU_CHECK_REAL_ROWS, default .gpu_real/rows)."""
    c.ensure_hf_model("GPU_CHECK_REAL_MODEL", tail=4)
    backend = env("GPU_CHECK_REAL_BACKEND")
    config = env("GPU_CHECK_REAL_CONFIG", "configs/smollm2_arithmetic_gpu.yaml")
    stem = Path(config).stem.removeprefix("smollm2_arithmetic").removesuffix("_gpu")
    work = "output/real_gpu" + stem + (f"_{backend}" if backend else "")
    flags = [*(["--max-steps", env("GPU_CHECK_REAL_STEPS")] if env("GPU_CHECK_REAL_STEPS") else []),
             *(["--eval-base"] if env("GPU_CHECK_REAL_BASE") else []),
             *(["--inference-backend", backend] if backend else []),
             *(["--vllm-kv-cache-gib", env("GPU_CHECK_REAL_KV_GIB")] if env("GPU_CHECK_REAL_KV_GIB") else []),
             *(["--save-steps", env("GPU_CHECK_REAL_SAVE_STEPS")] if env("GPU_CHECK_REAL_SAVE_STEPS") else [])]
    log = c.out("real_model.log")
    rc = c.sh(["timeout", env("GPU_CHECK_REAL_BUDGET_S", "540"), *PY, "scripts/run_grpo.py", config,
               work, "--rows", env("GPU_CHECK_REAL_ROWS", ".gpu_real/rows"), *flags], log=log, sglang=backend == "sglang")
    c.copy(f"{work}/run/metrics.jsonl", c.out("real_metrics.jsonl"))
    c.copy(f"{work}/result.json", c.out("real_result.json"))
    c.note(f"tail -c 3000 {log} > {c.out('real_model_tail.log')}; rm {log}")
    if c.dry_run:
        return
    metrics = Path(work, "run", "metrics.jsonl")
    rows = str(sum(1 for line in metrics.read_text().splitlines() if line)) if metrics.is_file() else ""
    print(f"real-model run exit {rc} ({rows} metrics rows)")
    text = Path(log).read_text(errors="replace")
    found = [line for line in text.splitlines() if re.search("eval at step|accuracy: step|Error|error", line)]
    if found[-15:]:
        print("\n".join(found[-15:]))
    Path(c.out("real_model_tail.log")).write_bytes(Path(log).read_bytes()[-3000:])
    Path(log).unlink()


def run_jobs(c: Check, jobs: str) -> int:
    """GPU_CHECK_JOBS="JOB | JOB": one job per GPU, in parallel. A JOB is this harness's settings, shell-quoted
    (GPU_CHECK_BENCH=grpo GPU_CHECK_TESTS='a or b'; words that are not NAME=VALUE are its command-line arguments). Job i
    runs with CUDA_VISIBLE_DEVICES=i, its own MASTER_PORT and its results in $OUT/jobI; its log's tail is printed at
    the end. GPU_CHECK_GGUF set outside the jobs is converted once, before they start. Exit status 1 if any job failed."""
    if env("GPU_CHECK_GGUF"):
        c.ensure_hf_model("GPU_CHECK_GGUF", tail=1)
    specs = jobs.split("|")
    if specs and not specs[-1]:  # the shell's `read -a` drops a trailing empty field
        specs.pop()
    if len(specs) > c.ngpu:
        print(f"GPU_CHECK_JOBS: {len(specs)} jobs for {c.ngpu} GPU(s)")
        return 1
    procs = []
    for i, spec in enumerate(specs):
        settings, args = job_settings(spec)
        # the job's own settings come last: they may override these
        settings = {"CUDA_VISIBLE_DEVICES": str(i), "MASTER_PORT": str(29500 + 111 * i), "OUT": c.out(f"job{i}"), **settings}
        argv = [*PY, "scripts/gpu_check.py", *args]
        if c.dry_run:
            print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in settings.items()), shlex.join(argv)]) + f"  # > /tmp/gpu_job{i}.log")
            continue
        Path(c.out(f"job{i}")).mkdir(parents=True, exist_ok=True)
        job_env = {**{k: v for k, v in os.environ.items() if k != "GPU_CHECK_JOBS"}, **settings}
        with open(f"/tmp/gpu_job{i}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=job_env))
    failed = [p.wait() for p in procs]  # all of them, whichever ends first
    for i, spec in enumerate(specs if procs else []):
        print(f"== job {i}:{spec}")
        print("\n".join(tail_lines(Path(f"/tmp/gpu_job{i}.log").read_text(errors="replace"), 30)))
    return 1 if any(failed) else 0


def job_settings(spec: str) -> tuple[dict[str, str], list[str]]:
    """One job of GPU_CHECK_JOBS, shell-quoted: its NAME=VALUE words (environment variables) and the rest (flags)."""
    assignment = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
    tokens = shlex.split(spec)
    settings = dict(w.split("=", 1) for w in tokens if assignment.match(w))
    return settings, [w for w in tokens if not assignment.match(w)]


# -- the tables, last ----------------------------------------------------------------------------------------------------
def grpo_loop_report(results: Path) -> str:
    """The tiny GRPO loop's runs (grpo_loop_*.json: tests/workers/grpo_loop_worker.py's result, from the loop mode and
    tests/test_gpu.py)."""
    import json

    loops = [json.loads(p.read_text()) for p in sorted(results.glob("grpo_loop_*.json"))]
    if not loops:
        return ""
    lines = ["| GRPO loop (tiny demo) | GPUs | card | steps | reward first 10 -> last 10 | wall s | rollout s | train s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in loops:
        name = f"TP{r['tp']} PP{r['pp']}" + (" packed" if r["packing"] else "") + (f" {r['variant']}" if r.get("variant") else "")
        w = r["rewards"]
        lines.append(f"| {name} | {r['world_size']} | {r['card']} | {r['steps']} | {sum(w[:10])/10:.3f} -> {sum(w[-10:])/10:.3f} "
                     f"| {r['seconds']:.0f} | {r['rollout_s']:.0f} | {r['train_s']:.0f} |")
    return "\n".join(lines)


def vllm_report(results: Path) -> str:
    """The vLLM engine on GPU (vllm_gpu_PLACEMENT.json, from tests/test_gpu.py)."""
    import json

    runs = [(p.stem.removeprefix("vllm_gpu_"), json.loads(p.read_text())) for p in sorted(results.glob("vllm_gpu_*.json"))]
    if not runs:
        return ""
    lines = ["| vLLM engine on GPU (bf16) | sync | tensors | MB | sync s | stale engine mean/max abs diff | after sync mean/max |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs:
        s = r["sync"]
        lines.append(f"| {name} | {s['method']} | {s['tensors']} | {s['bytes']/1e6:.1f} | {s['seconds']:.3f} "
                     f"| {r['stale_engine_mean']:.3f} / {r['stale_engine']:.3f} | {r['after_sync_mean']:.4f} / {r['after_sync']:.4f} |")
    return "\n".join(lines)


def real_model_report(results: Path) -> str:
    """The real-model run (real_result.json: scripts/run_grpo.py's result.json, copied by run_real_model)."""
    import json

    path = results / "real_result.json"
    # bench_grpo's real-task rows (GPU_CHECK_BENCH=grpo) share the name and hold "rows" instead
    r = json.loads(path.read_text()) if path.is_file() else {}
    if "eval_curve" not in r:
        return ""
    c, t = r["eval_curve"], r["train"]
    lines = ["| real model (SmolLM2-135M, arithmetic) | eval set | card | steps | accuracy first -> last eval | exported hf_model "
             "| format | rollout s / train s (last step) | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for prefix in [k.split("/")[0] for k in c[-1] if k.endswith("/accuracy")]:
        lines.append(f"| {r.get('config', 'configs/smollm2_arithmetic_gpu.yaml')} | {prefix} | {r['card']} | {c[-1]['step']} "
                     f"| {c[0][prefix + '/accuracy']:.3f} -> {c[-1][prefix + '/accuracy']:.3f} "
                     f"| {r['hf_model_eval'][prefix + '/accuracy']:.3f} | {c[-1][prefix + '/format_rate']:.2f} "
                     f"| {t[-1]['time/rollout_s']:.1f} / {t[-1]['time/train_s']:.2f} "
                     f"| {max(x['perf/peak_gpu_memory_gib'] or 0 for x in t):.1f} |")
    return "\n".join(lines)


def reports() -> list[Callable[[Path], str]]:
    """Each table's function, in the order they are printed. The bench modules are imported here, not at the top:
    they import torch, which a dry run or --list does not need."""
    import bench_logprobs
    import bench_train_step
    import bench_weight_sync

    return [bench_train_step.report, bench_logprobs.report, grpo_loop_report, vllm_report, real_model_report, bench_weight_sync.report,
            bench_weight_sync.slice_report, bench_weight_sync.colocated_report]


def print_reports(results: Path) -> None:
    """Every table whose result files are in ``results``, each after a blank line. A table that fails to build is
    reported and skipped: the call's exit status stays the tests'."""
    try:
        functions = reports()
    except Exception:  # a bench module that does not import here
        print(f"\nno tables: {traceback.format_exc()}")
        return
    for report in functions:
        try:
            text = report(results)
        except Exception:  # a result file of an unexpected form (a run cut off mid-write): the other tables still print
            print(f"\n{report.__module__}.{report.__name__} failed:\n{traceback.format_exc()}")
            continue
        if text:
            print("\n" + text)


# -- the call ----------------------------------------------------------------------------------------------------------
def gpu_count() -> int:
    """GPU_CHECK_NGPU, else the GPUs nvidia-smi lists (all of the host's: CUDA_VISIBLE_DEVICES does not change it)."""
    if env("GPU_CHECK_NGPU"):
        return int(env("GPU_CHECK_NGPU"))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return 0
    return len(listed.splitlines())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags for the main settings; each is also (and by default taken from) its environment variable."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="modes:\n" + "\n".join(f"  {m.name:<9}{m.help}" for m in MODES))
    p.add_argument("--bench", default=None, metavar="MODES", help="GPU_CHECK_BENCH: space-separated mode names (default 1)")
    p.add_argument("--tests", default=None, metavar="EXPR", help="GPU_CHECK_TESTS: pytest -k of tests/test_gpu.py; none skips")
    p.add_argument("--jobs", default=None, metavar="JOBS", help="GPU_CHECK_JOBS: settings of parallel jobs, one GPU each, '|' apart")
    p.add_argument("--dry-run", action="store_true", help="GPU_CHECK_DRY_RUN=1: print the commands, run nothing")
    p.add_argument("--list", action="store_true", help="print the modes and exit")
    args = p.parse_args(argv)
    # the flags become the environment variables, so jobs and the modes read one place
    for flag, name in (("bench", "GPU_CHECK_BENCH"), ("tests", "GPU_CHECK_TESTS"), ("jobs", "GPU_CHECK_JOBS")):
        if getattr(args, flag) is not None:
            os.environ[name] = getattr(args, flag)
    if args.dry_run:
        os.environ["GPU_CHECK_DRY_RUN"] = "1"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{m.name:<9}{'default, ' if m.default else ''}{m.min_gpus}+ GPU(s): {m.help}" for m in MODES))
        return 0
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a job's log shows progress as it goes
    os.chdir(REPO)
    results = Path(env("OUT", "gpu_results"))
    dry_run = env("GPU_CHECK_DRY_RUN") not in ("", "0")
    if not dry_run:
        results.mkdir(parents=True, exist_ok=True)
    os.environ["GPU_RESULTS"] = str(results)  # where tests/test_gpu.py writes its result files
    c = Check(results, gpu_count(), dry_run)
    if env("GPU_CHECK_JOBS"):
        return run_jobs(c, env("GPU_CHECK_JOBS"))
    test_rc = run_tests(c)
    if env("GPU_CHECK_REAL_MODEL"):
        run_real_model(c)
    bench = env("GPU_CHECK_BENCH", "1")
    for mode in select_modes(bench):
        if c.ngpu < mode.min_gpus:
            if mode.name in bench.split():  # named, not only one of "1"'s: say why nothing ran
                print(f"{mode.name}: needs {mode.min_gpus} GPUs, this machine has {c.ngpu}: skipped")
            continue
        if dry_run:
            print(f"# mode {mode.name}")
        mode.run(c)
    if not dry_run:
        print_reports(results)
    return test_rc


if __name__ == "__main__":
    sys.exit(main())
