"""Weight-sync benchmark on 2 GPUs: the trainer's streaming path vs the raw NCCL broadcast.

    python scripts/bench_weight_sync.py --out result.json      # needs 2 GPUs; run by scripts/gpu_check.py

The trainer (GPU 0) holds a ~0.8B-parameter Llama-style Megatron-Core model (bf16, the shape of
scripts/bench_train_step.py). A receiver process on GPU 1 joins a 2-process NCCL group
(rollout/weight_sync/stream.py WeightSyncGroup). Measured in the same run:
- raw: ``broadcast`` of one 1 GiB buffer, GPU 0 -> GPU 1 (median of 5): the ceiling;
- export: Megatron-Bridge's ``export_hf_weights`` alone (HF names, fused tensors split), no transfer;
- sync: export + bucketing + streaming (``stream.send``) into the receiver's
  ``stream.receive``, the code the vLLM engine runs in its weight-transfer engine; for several
  bucket sizes (best reported, all rounds listed).
What is NOT run here: vLLM itself (the GPU image has none), so the receiver unpacks the buckets into
tensors but does not call vLLM's ``load_weights``. On CPU that load is measured by tests/test_vllm.py.
``report`` prints the table of sync.json (scripts/gpu_check.py).

    python scripts/bench_weight_sync.py --slice --out slice.json    # one GPU; scripts/gpu_check.py mode sync_slice

``--slice``: what one sender does per push at the real widths, on one GPU: Llama-3.1-70B and -405B (their
configs/model_shapes/ configs, random bf16 weights) cut to 1 and 2 layers, built in the trainer's engine. Timed:
the export alone (``HFWeightExporter``, what a colocated sync feeds the engine; at TP 1 mostly views, the TP
all-gathers of a real layout are not in it), and an asynchronous push's snapshot (rollout/weight_sync/push.py
``host_snapshot`` of the stage's export, pinned host memory; the steady state, after the first push pinned the
memory), each with its peak GPU memory above the trainer's state. The difference between 2 and 1 layers is the per-layer cost; 1 layer minus
that is the embeddings' and head's. ``slice_report`` extrapolates them to the whole models and to one sender's
share at the configs' layouts (70B: TP8 x PP2, 16 senders; 405B: TP8 x PP16, 128).

    python scripts/bench_weight_sync.py --colocated-slice --out colocated.json   # one GPU + vLLM; gpu_check mode sync_colocated

``--colocated-slice``: the colocated sync itself at the 70B width: Llama-3.1-70B cut to 1 and 2 layers, a random HF
folder of that shape (examples/scale_task.py) started as a colocated vLLM engine in the trainer's process
(rollout/vllm_backend.py ``ColocatedVllmBackend``, what ``oumi train`` builds), and its ``sync_weights`` of the
trainer's engine timed (first and best of 5 more), with the bytes loaded, the peak GPU memory above the trainer's state
and the engine's, and a check that the engine then holds the trainer's weights. At TP 1 a rank's shard is the whole
slice; at the 70B config's TP 8 each rank loads 1/8 of it (engine/state/tp_shards.py), which ``colocated_report``
extrapolates to, with the engine kept awake (``vllm_sleep: false``: the sleep/wake costs are not in it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import torch

import bench_common


def receiver(port: int, rounds: int, raw_bytes: int, raw_reps: int) -> None:
    torch.cuda.set_device(1)
    from oumi_megatron.rollout.weight_sync import stream

    group = stream.WeightSyncGroup("127.0.0.1", port, rank=1, backend="nccl")
    buf = torch.empty(raw_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(raw_reps + 1):
        group.broadcast(buf)
    torch.cuda.synchronize()
    for _ in range(rounds):
        n = 0
        for pairs in stream.receive(group):
            n += len(pairs)
        torch.cuda.synchronize()
        group.broadcast(torch.tensor([n], dtype=torch.int64, device="cuda"), src=1)  # ack: all received


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 128.0, 256.0, 512.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--slice", action="store_true", help="one GPU: the 70B- and 405B-wide slices (module docstring)")
    p.add_argument("--colocated-slice", action="store_true", help="one GPU + vLLM: the colocated sync at the 70B width")
    p.add_argument("--layers", type=int, default=0, help="--colocated-slice: this slice alone, in this process")
    args = p.parse_args()
    if args.slice:
        slice_main(args.out)
        return
    if args.colocated_slice:
        colocated_slice_main(args.out, args.layers)
        return
    raw_bytes, raw_reps = 2**30, 5

    from oumi_megatron.engine.parallel.distributed import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=receiver, args=(port, args.rounds * len(args.bucket_mb), raw_bytes, raw_reps), daemon=True)
    child.start()

    torch.cuda.set_device(0)
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.rollout.weight_sync import stream

    cfg = bench_common.hf_config("0.8b", 2048)
    bridge, engine = build_engine_from_hf_config(
        cfg, engine_layout(params := MegatronParams()), params, OptimSettings(), dtype=torch.bfloat16)

    group = stream.WeightSyncGroup("127.0.0.1", port, rank=0, backend="nccl")
    buf = torch.empty(raw_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(raw_reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        group.broadcast(buf)
        torch.cuda.synchronize()
        if i:  # the first one sets up the communicator
            times.append(time.perf_counter() - t0)
    raw_gbps = raw_bytes / sorted(times)[len(times) // 2] / 1e9

    export = HFWeightExporter(bridge, engine.model)
    export_s = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = sum(t.numel() * t.element_size() for _, t in export())
        torch.cuda.synchronize()
        export_s.append(time.perf_counter() - t0)

    syncs = []
    for bucket_mb in args.bucket_mb:
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = stream.send(group, export(), int(bucket_mb * 2**20))
            ack = group.broadcast(torch.zeros(1, dtype=torch.int64, device="cuda"), src=1)
            torch.cuda.synchronize()
            syncs.append((time.perf_counter() - t0, stats, bucket_mb))
            assert int(ack.item()) == stats.tensors, (int(ack.item()), stats.tensors)
    child.join(timeout=60)

    best_s, best, best_bucket = min(syncs, key=lambda x: x[0])
    result = {
        "card": bench_common.card_name(), "gpus": 2, "model_params_b": total / 2 / 1e9, "bytes": best.bytes,
        "tensors": best.tensors, "bucket_mb": best_bucket, "raw_broadcast_gbps": raw_gbps,
        "export_first_s": export_s[0], "export_only_s": min(export_s[1:]), "sync_s": best_s, "sync_gbps": best.bytes / best_s / 1e9,
        "fraction_of_raw": best.bytes / best_s / 1e9 / raw_gbps,
        "rounds_s": {f"{b:g} MiB": [round(s, 4) for s, _, bb in syncs if bb == b] for b in args.bucket_mb},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result))


SLICE_SHAPES = {"llama-3.1-70b": ("llama-3.1-70b-instruct", 80, 16), "llama-3.1-405b": ("llama-3.1-405b-instruct", 126, 128)}
"""name: (configs/model_shapes folder, layers of the whole model, senders at configs/train_70b|405b_grpo.yaml's layout)."""


def slice_main(out: str) -> None:
    import gc
    import os

    import transformers

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import free_port
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.rollout.weight_sync.push import host_snapshot

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    runs = []
    for shape, (folder, _, _) in SLICE_SHAPES.items():
        for layers in (1, 2):
            os.environ["MASTER_PORT"] = str(free_port())  # a world of one per model, the last one's port may linger
            cfg = transformers.AutoConfig.from_pretrained(bench_common.REPO / "configs" / "model_shapes" / folder)
            cfg.num_hidden_layers = layers
            params = MegatronParams()
            params.transformer_config.recompute_granularity = None
            bridge, engine = build_engine_from_hf_config(cfg, engine_layout(params), params, OptimSettings(),
                                                         dtype=torch.bfloat16)
            exporter = HFWeightExporter(bridge, engine.model)
            sum(1 for _ in exporter())  # the first export builds the conversion plan
            row: dict = {"shape": shape, "layers": layers}

            def exported(e: HFWeightExporter = exporter) -> int:
                return sum(t.numel() * t.element_size() for _, t in e())

            def snapshot(e: HFWeightExporter = exporter) -> int:
                return sum(t.numel() * t.element_size() for _, t in host_snapshot(e.stage_tensors()))

            # three rounds each: the first snapshot pays for pinning fresh host memory (cudaHostAlloc), later ones
            # reuse the caching host allocator's blocks, as every push after the first does
            for name, fn in (("export", exported), ("snapshot", snapshot)):
                times, peaks = [], []
                for _ in range(3):
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    nbytes = fn()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
                    gc.collect()
                row[f"{name}_first_s"], row[f"{name}_s"] = times[0], min(times[1:])
                row[f"{name}_peak_above_gib"] = max(peaks)
                row["bytes"] = nbytes
            print(json.dumps(row), flush=True)
            runs.append(row)
            del bridge, engine, exporter, exported, snapshot, fn  # the closures hold the exporter, and so the model
            gc.collect()
            torch.cuda.empty_cache()
            from oumi_megatron.engine.parallel.distributed import destroy

            destroy()
    result = {"card": bench_common.card_name(), "runs": runs}
    print(json.dumps(result, indent=1))
    if out:
        Path(out).write_text(json.dumps(result))


def colocated_slice_main(out: str, layers: int = 0, shape: str = "llama-3.1-70b") -> None:
    """``layers`` 0: each slice (1 and 2 layers) in a process of its own (vLLM's parallel state outlives an engine in
    its process, so a second engine there fails), then the table's file; else that slice, here."""
    import os
    import subprocess
    import sys
    import tempfile

    if not layers:
        runs = []
        for n in (1, 2):
            part = Path(tempfile.mkdtemp()) / "run.json"
            subprocess.run([sys.executable, __file__, "--colocated-slice", "--layers", str(n), "--out", str(part)],
                           check=True)
            runs.append(json.loads(part.read_text()))
        result = {"card": bench_common.card_name(), "runs": runs}
        print(json.dumps(result, indent=1))
        if out:
            Path(out).write_text(json.dumps(result))
        return

    from oumi_megatron.config.grpo_params import MegatronGrpoParams
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine_from_hf_config
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.distributed import destroy, free_port
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.examples.scale_task import build_scale_model
    from oumi_megatron.rollout.vllm_backend import ColocatedVllmBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    os.environ["MASTER_PORT"] = str(free_port())
    work = Path(tempfile.mkdtemp(prefix=f"colocated_{layers}_"))
    hf = build_scale_model(work / "hf", shape=shape, num_hidden_layers=layers)
    torch.cuda.empty_cache()
    import transformers

    # eager decoding: no graph capture at start-up (the sync does not depend on it)
    params = MegatronParams(inference_backend="vllm", vllm_sleep=False, vllm_kv_cache_gib=1.0,
                            vllm_gpu_memory_utilization=0.3, rollout_cuda_graphs="false")
    params.transformer_config.recompute_granularity = None
    grpo = MegatronGrpoParams(max_prompt_length=64, max_completion_length=64)
    bridge, engine = build_engine_from_hf_config(transformers.AutoConfig.from_pretrained(hf), engine_layout(params),
                                                 params, OptimSettings(), dtype=torch.bfloat16)
    exporter = HFWeightExporter(bridge, engine.model)
    backend = ColocatedVllmBackend(str(hf), torch.bfloat16, params, grpo, seed=0, work_dir=work)
    row: dict = {"shape": shape, "layers": layers}
    times, peaks = [], []
    for _ in range(6):  # the first builds the conversion plan; the best of the other 5
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        stats = backend.sync_weights(exporter)
        torch.cuda.synchronize()  # the copies into the engine's parameters run asynchronously
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    row.update(method=stats.method, bytes=stats.bytes, tensors=stats.tensors, sync_first_s=times[0],
               sync_s=min(times[1:]), export_s=stats.export_seconds, peak_above_gib=max(peaks))
    # the engine now holds the trainer's weights: compare the embedding and the last layer's down projection
    ours = dict(exporter())

    def diff(worker: object, last: int, embed: torch.Tensor, down: torch.Tensor) -> float:
        model = worker.model_runner.model  # type: ignore[attr-defined]
        return max(float((model.model.embed_tokens.weight.float() - embed.float()).abs().max()),
                   float((model.model.layers[last].mlp.down_proj.weight.float() - down.float()).abs().max()))

    row["max_diff"] = backend.host.llm.collective_rpc(diff, args=(
        layers - 1, ours["model.embed_tokens.weight"], ours[f"model.layers.{layers - 1}.mlp.down_proj.weight"]))[0]
    print(json.dumps(row), flush=True)
    Path(out).write_text(json.dumps(row))
    destroy()


def _by_layer(one: dict, two: dict, keys: tuple[str, ...], layers: int) -> tuple[dict, dict, dict]:
    """From a 1- and a 2-layer run: (per layer, the fixed rest (embeddings and head), the whole model of ``layers``)."""
    per = {k: two[k] - one[k] for k in keys}
    fixed = {k: one[k] - per[k] for k in keys}
    return per, fixed, {k: fixed[k] + layers * per[k] for k in keys}


def colocated_report(results_dir: Path) -> str:
    """The table of ``results_dir``/sync_colocated.json: per layer, fixed, and one rank's share of a whole 70B sync at
    the config's TP 8 (bytes / 8, time in proportion)."""
    path = results_dir / "sync_colocated.json"
    if not path.is_file():
        return ""
    r = json.loads(path.read_text())
    one, two = (next(x for x in r["runs"] if x["layers"] == n) for n in (1, 2))
    layers, tp = SLICE_SHAPES[one["shape"]][1], 8
    per, fixed, whole = _by_layer(one, two, ("bytes", "sync_s"), layers)
    return "\n".join([
        "| colocated sync, vLLM in the trainer's process (card) | method | per layer: GB / s | embeddings + head: GB / s "
        "| first sync s (2 layers) | peak GPU above, GiB | max diff | whole model at TP 1: GB / s | one rank at TP 8: GB / s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {one['shape']}, 1 and 2 layers ({r['card']}) | {two['method']} | {per['bytes']/1e9:.2f} / {per['sync_s']:.3f} "
        f"| {fixed['bytes']/1e9:.2f} / {fixed['sync_s']:.3f} | {two['sync_first_s']:.2f} | {two['peak_above_gib']:.2f} "
        f"| {max(one['max_diff'], two['max_diff']):.1e} | {whole['bytes']/1e9:.0f} / {whole['sync_s']:.2f} "
        f"| {whole['bytes']/tp/1e9:.1f} / {whole['sync_s']/tp:.2f} |",
    ])


def slice_report(results_dir: Path) -> str:
    """The table of ``results_dir``/sync_slice.json: per layer, fixed, and extrapolated to the whole models."""
    path = results_dir / "sync_slice.json"
    if not path.is_file():
        return ""
    r = json.loads(path.read_text())
    lines = ["| shape (card) | per layer: GB / export s / snapshot s | embeddings + head: GB / export s / snapshot s "
             "| whole model: GB / export s / snapshot s | one sender's share: senders / GB / snapshot s "
             "| peak GPU above training, GiB (export / snapshot, 2 layers) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for shape, (_, layers, senders) in SLICE_SHAPES.items():
        one, two = (next(x for x in r["runs"] if x["shape"] == shape and x["layers"] == n) for n in (1, 2))
        per, fixed, whole = _by_layer(one, two, ("bytes", "export_s", "snapshot_s"), layers)
        lines.append(f"| {shape} ({r['card']}) | {per['bytes']/1e9:.2f} / {per['export_s']:.3f} / {per['snapshot_s']:.3f} "
                     f"| {fixed['bytes']/1e9:.2f} / {fixed['export_s']:.3f} / {fixed['snapshot_s']:.3f} "
                     f"| {whole['bytes']/1e9:.0f} / {whole['export_s']:.1f} / {whole['snapshot_s']:.1f} "
                     f"| {senders} / {whole['bytes']/senders/1e9:.1f} / {whole['snapshot_s']/senders:.2f} "
                     f"| {two['export_peak_above_gib']:.2f} / {two['snapshot_peak_above_gib']:.2f} |")
    return "\n".join(lines)


def report(results_dir: Path) -> str:
    """The markdown table of ``results_dir``/sync.json (this script's ``--out`` in scripts/gpu_check.py), or ""."""
    path = results_dir / "sync.json"
    if not path.is_file():
        return ""
    r = json.loads(path.read_text())
    return "\n".join([
        "| weight sync (trainer GPU 0 -> receiver GPU 1, NCCL) | card | GB | tensors | bucket MiB | raw broadcast GB/s "
        "| export only s | sync s | sync GB/s | of raw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| Bridge export -> buckets -> weight_stream | {r['card']} | {r['bytes']/1e9:.2f} | {r['tensors']} | {r['bucket_mb']:.0f} "
        f"| {r['raw_broadcast_gbps']:.1f} | {r['export_only_s']:.2f} | {r['sync_s']:.2f} | {r['sync_gbps']:.1f} "
        f"| {100*r['fraction_of_raw']:.0f}% |",
    ])


if __name__ == "__main__":
    main()
