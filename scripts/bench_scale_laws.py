"""Growth laws of the state paths (issue 43): how each path's peak host memory and time grow with the model and ranks.

    python scripts/bench_scale_laws.py [--sizes 27m,110m,554m] [--layouts 1,pp2,dp2] [--out DIR] [--json FILE]

For each model size (random Llama-shaped models, bf16, built locally into ``--out``) and each layout (``1``: one
process; ``pp2``: two gloo ranks, two pipeline stages; ``dp2``: two gloo ranks, data parallel with the distributed
optimizer), one process tree runs the paths a run takes, in order, through the library's own functions:

- ``convert``: ``convert_hf_to_megatron`` (what ``oumi train`` does once);
- the trainer's state: ``build_engine`` and one optimizer step (not a path; its size is the base of the next two);
- ``save``: ``save_checkpoint`` (model, optimizer, RNG, manifest), above the trainer's state;
- ``load``: ``load_checkpoint`` into the same engine, above the trainer's state;
- ``export``: the trainer's final HF export (``HFWeightExporter.save``), above the trainer's state;
- ``export_cli``: ``export_to_hf`` of the checkpoint in a process that holds nothing (``oumi-megatron export``),
  the model's own build included;
- ``push``: an asynchronous weight push (rollout/weight_sync/push.py ``WeightPusher``, what ``grpo.max_staleness`` > 0 runs
  for a separate engine or the fleet): every sender's host snapshot of its share (rollout/weight_sync/senders.py) streamed
  over gloo into a receiver process that runs the engine's receive loop (weight_sync/stream.py receive_all; vLLM's load is
  not run), timed until the receiver has every tensor. ``pp2`` / ``tp2`` have two senders, ``1`` one.

Each path's peak is the rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs before
the path) above its resident set when the path starts, per rank. The table gives, per path, layout and rank, the
least-squares slope of that peak against the bf16 model's bytes (2 B per parameter of the whole model) and the wall
time at each size. A slope of 1.0 is one whole model's worth of bytes per rank; a rank of a PP=2 layout owns 0.5.

    python scripts/bench_scale_laws.py --gpu [--layers 2] [--state-dir DIR]      # on one GPU (scripts/gpu_check.py, mode laws)

``--gpu``: a Llama-3.1-70B-wide slice (configs/llama70b_slice_1gpu.yaml: the 70B model's width and vocabulary, 2 of its
layers, 3.8B parameters, random weights) through the trainer (scripts/run_grpo.py, what ``oumi train``
runs): convert, one GRPO step, the final checkpoint and the HF export in one process, then the checkpoint's load in a
second (the resume). Each phase's peak GPU memory (max_memory_allocated) and host memory (VmHWM) is printed beside
``oumi-megatron plan``'s for the slice (plan.py, state_plan.py). ``--state-dir``: where the run writes (the checkpoint
is ~53 GB: a RAM disk where the machine's disk is small).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import LAW_SIZES as SIZES
from bench_common import REPO, RUN_GRPO, apply_settings, card_name

LAYOUTS: dict[str, dict[str, int]] = {
    "1": {"ranks": 1},
    "pp2": {"ranks": 2, "pipeline_model_parallel_size": 2},
    "dp2": {"ranks": 2},
    "tp2": {"ranks": 2, "tensor_model_parallel_size": 2},
}
PATHS = ("convert", "save", "load", "export", "export_cli", "push")
PUSH_BUCKET_BYTES = 8 * 2**20
"""``push``'s buckets: smaller than the smallest model here (27m: 54 MB), so that the two in flight are the same at every
size and the slope is the snapshot's alone (at 256 MiB, the default, they would grow with the model up to 554m)."""
MAX_SHARD_FRACTION = 20
"""HF shards of 1/20 of the model: an HF shard is 5 GB of a 141 GB model at 70B, so the bench keeps the same ratio."""


def model_params(spec: dict[str, int]) -> int:
    h, f, n, v = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"], spec["vocab_size"]
    return 2 * v * h + n * (4 * h * h + 3 * h * f + 2 * h) + h


def build_model(out: Path, size: str) -> Path:
    from oumi_megatron.examples.scale_task import build_scale_model

    spec = SIZES[size]
    heads = spec["hidden_size"] // 64
    return build_scale_model(out / f"hf_{size}", shape="llama-3.1-8b", num_attention_heads=heads, num_key_value_heads=heads,
                             head_dim=64, max_position_embeddings=4096, **spec)


# -- the worker: one process per rank, every path in order -------------------------------------------------------------
def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := the current VmRSS


class Meter:
    def __init__(self) -> None:
        self.results: dict[str, dict[str, float]] = {}

    def measure(self, name: str, fn: Any) -> Any:
        import torch.distributed as dist

        gc.collect()
        dist.barrier()
        _reset_peak()
        start = _status_kib("VmRSS")
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
        dist.barrier()
        self.results[name] = {"peak_above_start_bytes": (peak - start) * 1024.0, "start_rss_bytes": start * 1024.0,
                              "seconds": seconds}
        return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import destroy, init_distributed
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.checkpointing import load_checkpoint, save_checkpoint
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron, export_to_hf
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter

    init_distributed()
    layout = {k: v for k, v in LAYOUTS[args.layout].items() if k != "ranks"}
    params = MegatronParams(**layout)
    params.transformer_config.recompute_granularity = None
    resolved = engine_layout(params)  # once: every path below runs on it
    params.checkpoint_config.use_async_checkpoint = False
    params.hf_max_shard_size = str(args.max_shard_bytes)
    work = Path(args.work)
    meter = Meter()
    baseline = _status_kib("VmRSS") * 1024.0
    dtype = torch.bfloat16
    mc = work / "megatron_checkpoint"
    paths = set(args.paths.split(","))
    if args.export_cli:  # a process of its own: it holds nothing but the model it builds
        meter.measure("export_cli", lambda: export_to_hf(work / "checkpoints" / "step_000001", work / "hf_export_cli", resolved, params))
        paths = set()
    else:
        meter.measure("convert", lambda: convert_hf_to_megatron(args.hf, mc, resolved, params, dtype=dtype))
    trainer_state = 0.0
    if paths & {"save", "load", "export", "push"}:
        settings = OptimSettings(lr=1e-5, total_steps=4)
        bridge, engine = build_engine(mc, resolved, params, settings, dtype)
        from megatron.core import parallel_state as ps

        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        ids = torch.randint(0, 1000, (2 * dp, 16), generator=torch.Generator().manual_seed(0)).chunk(dp)[dp_rank]

        def nll(logprobs: torch.Tensor, batch: dict) -> tuple:
            return -logprobs.sum(), torch.tensor(logprobs.numel()), {}

        engine.train_step([{"input_ids": ids, "loss_mask": torch.ones_like(ids)}], nll)
        gc.collect()
        trainer_state = _status_kib("VmRSS") * 1024.0 - baseline
        ckpt_root = work / "checkpoints"
        if "save" in paths or "load" in paths:
            ckpt = meter.measure("save", lambda: save_checkpoint(engine, ckpt_root, 1, {"data_position": 0}, mc / "hf",
                                                                 keep_last=1))
        if "load" in paths:
            meter.measure("load", lambda: load_checkpoint(engine, ckpt))
        if "export" in paths:
            exporter = HFWeightExporter(bridge, engine.model, mc / "hf", params.hf_max_shard_size)
            meter.measure("export", lambda: exporter.save(work / "hf_export"))
            del exporter
        if "push" in paths:
            push = _Push(HFWeightExporter(bridge, engine.model, mc / "hf"))
            meter.measure("push", push.run)
            push.close()
        del bridge, engine
        gc.collect()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, meter.results)
    if dist.get_rank() == 0:
        name = "result_export_cli.json" if args.export_cli else "result.json"
        (work / name).write_text(json.dumps({"ranks": gathered, "trainer_state_bytes": trainer_state,
                                             "baseline_bytes": baseline}, indent=1))
    destroy()


def _receive_pushes(conn: Any, senders: list[tuple[str, int]]) -> None:
    """The engine's side of ``push``, in a process of its own: every sender's group, received at once, until closed."""
    from oumi_megatron.rollout.weight_sync import stream

    groups = [stream.WeightSyncGroup(host, port, rank=1) for host, port in senders]
    while conn.recv() == "receive":
        conn.send(sum(len(bucket) for bucket in stream.receive_all(groups)))


class _Push:
    """``push``: the senders' links to a receiver process (rank 0 starts it), then one push per ``run``."""

    def __init__(self, exporter: Any) -> None:
        import multiprocessing

        import torch.distributed as dist

        from oumi_megatron.engine.parallel.distributed import replica_group
        from oumi_megatron.rollout.weight_sync.push import WeightPusher
        from oumi_megatron.rollout.weight_sync.senders import open_links, sender_role

        self.exporter, self.rank0 = exporter, dist.get_rank() == 0
        self.group, ranks = replica_group()
        self.role = sender_role(self.group, ranks)
        self.conn: Any = None
        self.process: Any = None

        def start(senders: list[tuple[str, int]]) -> Any:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.process = ctx.Process(target=_receive_pushes, args=(child, senders), daemon=True)
            self.process.start()
            return lambda: None

        self.link = open_links(self.role, self.group, ranks[0], "gloo", 1, start if self.rank0 else None)
        self.pusher = WeightPusher("gloo")

    def run(self) -> None:
        from concurrent.futures import Future

        done: Future = Future()

        def sessions() -> tuple[list[Future], list[Future]]:
            if not self.rank0:
                return [], []
            self.conn.send("receive")
            return [], [done]

        def wait(future: Future, _what: str) -> Any:
            future.set_result(self.conn.recv())  # the receiver's tensor count: it has them all
            return future.result()

        assert self.link is not None, "every rank of these layouts sends"
        self.pusher.push(self.role.pairs(self.exporter.stage_tensors()), self.link, PUSH_BUCKET_BYTES, sessions, wait)
        self.pusher.wait()

    def close(self) -> None:
        self.pusher.close()
        if self.rank0:
            self.conn.send("close")
            self.process.join(timeout=60)


# -- the driver -------------------------------------------------------------------------------------------------------
def run_one(out: Path, size: str, layout: str, paths: str, hf: Path) -> dict[str, Any]:
    import shutil

    from oumi_megatron.engine.parallel.distributed import free_port

    work = out / f"run_{size}_{layout}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ranks = LAYOUTS[layout]["ranks"]
    max_shard = 2 * model_params(SIZES[size]) // MAX_SHARD_FRACTION
    # glibc's malloc keeps freed memory resident and reuses it, which would hide a later path's allocations; a fixed
    # mmap threshold gives every large tensor its own mapping, returned when it is freed, so VmRSS follows live memory
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    log = out / f"run_{size}_{layout}.log"
    stages = [[]] + ([["--export-cli"]] if "export_cli" in paths.split(",") else [])
    with log.open("w") as f:
        for extra in stages:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                   str(free_port()), __file__, "--worker", "--layout", layout, "--hf", str(hf), "--work", str(work),
                   "--paths", paths, "--max-shard-bytes", str(max_shard), *extra]
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"bench_scale_laws: {size} {layout} failed (exit {proc.returncode}); see {log}")
    result = json.loads((work / "result.json").read_text())
    if len(stages) > 1:
        cli = json.loads((work / "result_export_cli.json").read_text())
        for rank, measured in zip(result["ranks"], cli["ranks"]):
            rank.update(measured)
    shutil.rmtree(work, ignore_errors=True)  # the checkpoints and exports of the large sizes fill a disk quickly
    return result


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")
    return slope, my - slope * mx


def laws(runs: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (path, layout, rank): the slope of the peak against the bf16 model bytes, and the seconds."""
    rows = []
    layouts = sorted({layout for _, layout in runs}, key=list(LAYOUTS).index)
    sizes = sorted({size for size, _ in runs}, key=list(SIZES).index)
    for path in PATHS:
        for layout in layouts:
            have = [s for s in sizes if (s, layout) in runs and path in runs[(s, layout)]["ranks"][0]]
            if len(have) < 2:
                continue
            model_bytes = [2.0 * model_params(SIZES[s]) for s in have]
            for rank in range(LAYOUTS[layout]["ranks"]):
                peaks = [runs[(s, layout)]["ranks"][rank][path]["peak_above_start_bytes"] for s in have]
                slope, intercept = fit(model_bytes, peaks)
                rows.append({"path": path, "layout": layout, "rank": rank, "slope": slope, "intercept_mib": intercept / 2**20,
                             "sizes": have, "peak_mib": [p / 2**20 for p in peaks],
                             "seconds": [runs[(s, layout)]["ranks"][rank][path]["seconds"] for s in have]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    sizes = sorted({s for r in rows for s in r["sizes"]}, key=list(SIZES).index)
    head = ("| path | layout | rank | peak / bf16 model bytes (slope) | intercept MiB | "
            + " | ".join(f"peak MiB / s at {s}" for s in sizes) + " |")
    lines = [head, "|" + " --- |" * (5 + len(sizes))]
    for r in rows:
        cells = {s: f"{p:.0f} / {t:.1f}" for s, p, t in zip(r["sizes"], r["peak_mib"], r["seconds"])}
        lines.append(f"| {r['path']} | {r['layout']} | {r['rank']} | {r['slope']:.2f} | {r['intercept_mib']:.0f} | "
                     + " | ".join(cells.get(s, "") for s in sizes) + " |")
    return "\n".join(lines)


# -- the 70B-wide slice on one GPU ---------------------------------------------------------------------------------
SLICE_CONFIG = REPO / "configs" / "llama70b_slice_1gpu.yaml"
GPU_PHASES = ("convert", "grpo_step", "save", "load", "export")


class GpuMeter:
    """Each phase's peak GPU memory (the allocator's) and host memory (VmHWM), absolute and above the phase's start."""

    def __init__(self, out: Path) -> None:
        self.out, self.results = out, {}  # type: ignore[var-annotated]

    def wrap(self, name: str, fn: Any) -> Any:
        import functools

        import torch

        cuda = torch.cuda.is_available()  # --smoke runs on a CPU: no GPU figures

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            gpu0, _ = torch.cuda.memory_allocated() if cuda else 0, _reset_peak()
            host0, t0 = _status_kib("VmRSS") * 1024.0, time.perf_counter()
            value = fn(*args, **kwargs)
            gpu_peak = 0
            if cuda:
                torch.cuda.synchronize()
                gpu_peak = torch.cuda.max_memory_allocated()
            self.results[name] = {"seconds": time.perf_counter() - t0, "gpu_peak_gib": gpu_peak / 2**30,
                                  "gpu_above_start_gib": (gpu_peak - gpu0) / 2**30,
                                  "host_peak_gib": _status_kib("VmHWM") / 2**20, "host_start_gib": host0 / 2**30,
                                  "host_above_start_gib": (_status_kib("VmHWM") * 1024.0 - host0) / 2**30}
            self.out.write_text(json.dumps(self.results, indent=1))
            return value

        return measured


def gpu_worker(args: argparse.Namespace) -> None:
    """run_grpo (the trainer) with each phase measured."""
    import runpy

    from oumi_megatron.engine.state import conversion
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.trainer import grpo_trainer

    out = Path(args.work) / f"phases_{args.launch}.json"
    meter = GpuMeter(out)
    conversion.ensure_converted = meter.wrap("convert", conversion.ensure_converted)  # type: ignore[assignment]
    trainer = grpo_trainer.OumiMegatronGrpoTrainer
    trainer.grpo_step = meter.wrap("grpo_step", trainer.grpo_step)  # type: ignore[method-assign]
    grpo_trainer.save_checkpoint = meter.wrap("save", grpo_trainer.save_checkpoint)  # type: ignore[assignment]
    grpo_trainer.load_checkpoint = meter.wrap("load", grpo_trainer.load_checkpoint)  # type: ignore[assignment]
    HFWeightExporter.save = meter.wrap("export", HFWeightExporter.save)  # type: ignore[method-assign]
    sys.argv = [str(RUN_GRPO), args.slice_config, args.work, "--rows", args.rows,
                "--no-eval", "--export"]
    runpy.run_path(sys.argv[0], run_name="__main__")


def run_gpu(args: argparse.Namespace) -> None:
    import yaml

    from oumi_megatron.examples.scale_task import build_scale_model, write_scale_rows

    out = Path(args.out)
    state = Path(args.state_dir) if args.state_dir else out
    # --smoke: the same path at a width a CPU runs in a minute
    small = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)
    hf = build_scale_model(out / "hf_llama70b_slice", shape="llama-3.1-70b", num_hidden_layers=args.layers,
                           **(small if args.smoke else {}))
    rows = write_scale_rows(out / "rows").parent
    raw = yaml.safe_load(SLICE_CONFIG.read_text())
    raw["model"]["model_name"] = str(hf)
    raw["training"]["output_dir"] = str(state / "run")
    raw["grpo"]["reward_functions"] = [{"name": "char_diversity"}]  # the scale task's cheap reward (run_grpo)
    apply_settings(raw, args.set)  # e.g. training.use_peft=true: the plan's table reads the same config
    cfg = out / "slice.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    work = state / "slice"
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for launch in ("first", "resumed"):  # convert, step, save, export; then the resume's load
        cmd = [sys.executable, __file__, "--gpu-worker", "--launch", launch, "--slice-config", str(cfg), "--work", str(work),
               "--rows", str(rows)]
        with (out / f"slice_{launch}.log").open("w") as f:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode != 0:
                raise SystemExit(f"bench_scale_laws --gpu: the {launch} launch failed; see {out / f'slice_{launch}.log'}")
    measured = json.loads((work / "phases_first.json").read_text())
    measured["load"] = json.loads((work / "phases_resumed.json").read_text())["load"]  # the resume's (it converts nothing)
    print(gpu_table(cfg, hf, measured))
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": measured, "card": card_name()}, indent=1))


def gpu_table(cfg: Path, hf: Path, measured: dict[str, dict[str, float]]) -> str:
    """The phases against the plan: GPU (the training peak for the step), host above each phase's start."""
    from oumi_megatron.config.standalone import load_config
    from oumi_megatron.engine.parallel.layout import resolve_layout
    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.plan import estimate_memory, plan_state, rank_params

    config = load_config(cfg, oumi=False)  # as run_grpo reads it on the GPU image
    shape = ModelShape.from_file(hf)
    layout = resolve_layout(config, 1).require()
    memory = estimate_memory(config, shape, layout)
    state = plan_state(config, shape, layout, 1)  # as `oumi-megatron plan` (the adapters' share under LoRA)
    plan_host = {"convert": state.transient_per_rank["convert"], "save": state.transient_per_rank["checkpoint_save"],
                 "load": state.transient_per_rank["checkpoint_load"], "export": state.transient_per_rank["hf_export"]}
    lines = [f"Llama-3.1-70B-wide slice: {shape.num_layers} layers, {rank_params(config, shape, layout) / 1e9:.2f}B "
             f"parameters, card {card_name()}",
             "| phase | s | GPU peak GiB | plan's GPU GiB | host above start GiB | plan's host GiB | host peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for phase in GPU_PHASES:
        r = measured.get(phase)
        if r is None:
            continue
        gpu_plan = f"{memory.training_peak:.1f} (training peak)" if phase == "grpo_step" else ""
        host_plan = f"{plan_host[phase]:.1f}" if phase in plan_host else ""
        lines.append(f"| {phase} | {r['seconds']:.1f} | {r['gpu_peak_gib']:.1f} | {gpu_plan} | {r['host_above_start_gib']:.1f} | "
                     f"{host_plan} | {r['host_peak_gib']:.1f} |")
    lines.append(f"plan: resident host per rank {state.resident_per_rank:.1f} GiB (measured at the step's start: "
                 f"{measured.get('grpo_step', {}).get('host_start_gib', float('nan')):.1f}); disk per checkpoint "
                 f"{state.checkpoint:.1f} GiB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="27m,110m,554m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--layouts", default="1,pp2,dp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--out", default=str(REPO / "output" / "bench_scale_laws"))
    p.add_argument("--json", default=None, help="also write the runs and the fitted rows here")
    p.add_argument("--gpu", action="store_true", help="the 70B-wide slice on one GPU (see the module docstring)")
    p.add_argument("--layers", type=int, default=2, help="--gpu: the slice's layers")
    p.add_argument("--state-dir", default=None, help="--gpu: where the run writes (default --out)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="--gpu: a setting of the slice's config (YAML value), e.g. training.use_peft=true")
    p.add_argument("--smoke", action="store_true", help="--gpu at a small width (a CPU check of the script)")
    p.add_argument("--gpu-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launch", help=argparse.SUPPRESS)
    p.add_argument("--slice-config", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--export-cli", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-shard-bytes", type=int, default=5 * 10**9, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.gpu_worker:
        gpu_worker(args)
        return
    if args.gpu:
        if args.out == p.get_default("out"):
            args.out = str(REPO / "output" / "bench_scale_laws_gpu")
        run_gpu(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes, layouts = args.sizes.split(","), args.layouts.split(",")
    for name, table_ in (("size", SIZES), ("layout", LAYOUTS)):
        unknown = [x for x in (sizes if name == "size" else layouts) if x not in table_]
        if unknown:
            raise SystemExit(f"bench_scale_laws: unknown {name}(s) {unknown}; choose from {', '.join(table_)}")
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for size in sizes:
        hf = build_model(out, size)
        for layout in layouts:
            t0 = time.perf_counter()
            runs[(size, layout)] = run_one(out, size, layout, args.paths, hf)
            print(f"{size} ({model_params(SIZES[size]) / 1e6:.0f}M parameters) {layout}: {time.perf_counter() - t0:.0f} s",
                  flush=True)
    rows = laws(runs)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": {f"{s}/{lay}": r for (s, lay), r in runs.items()}, "laws": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
