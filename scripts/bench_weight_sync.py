"""Weight-sync benchmark on 2 GPUs: the trainer's streaming path vs the raw NCCL broadcast.

    python scripts/bench_weight_sync.py --out result.json      # needs 2 GPUs; run by scripts/gpu_check.py

The trainer (GPU 0) holds a ~0.8B-parameter Llama-style Megatron-Core model (bf16, the shape of
scripts/bench_train_step.py). A receiver process on GPU 1 joins a 2-process NCCL group
(rollout/weight_stream.WeightSyncGroup). Measured in the same run:
- raw: ``broadcast`` of one 1 GiB buffer, GPU 0 -> GPU 1 (median of 5): the ceiling;
- export: Megatron-Bridge's ``export_hf_weights`` alone (HF names, fused tensors split), no transfer;
- sync: export + bucketing + streaming (``weight_stream.send``) into the receiver's
  ``weight_stream.receive``, the code the vLLM engine runs in its weight-transfer engine; for several
  bucket sizes (best reported, all rounds listed).
What is NOT run here: vLLM itself (the GPU image has none), so the receiver unpacks the buckets into
tensors but does not call vLLM's ``load_weights``. On CPU that load is measured by tests/test_vllm.py.
``report`` prints the table of sync.json (scripts/gpu_check.py).
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
    from oumi_megatron.rollout import weight_stream

    group = weight_stream.WeightSyncGroup("127.0.0.1", port, rank=1, backend="nccl")
    buf = torch.empty(raw_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(raw_reps + 1):
        group.broadcast(buf)
    torch.cuda.synchronize()
    for _ in range(rounds):
        n = 0
        for pairs in weight_stream.receive(group):
            n += len(pairs)
        torch.cuda.synchronize()
        group.broadcast(torch.tensor([n], dtype=torch.int64, device="cuda"), src=1)  # ack: all received


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 128.0, 256.0, 512.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
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
    from oumi_megatron.rollout import weight_stream

    cfg = bench_common.hf_config("0.8b", 2048)
    bridge, engine = build_engine_from_hf_config(
        cfg, engine_layout(params := MegatronParams()), params, OptimSettings(), dtype=torch.bfloat16)

    group = weight_stream.WeightSyncGroup("127.0.0.1", port, rank=0, backend="nccl")
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
            stats = weight_stream.send(group, export(), int(bucket_mb * 2**20))
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
