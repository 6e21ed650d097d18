"""Weight-sync benchmark on 2 GPUs: the trainer's streaming path vs the raw NCCL broadcast.

    python scripts/bench_weight_sync.py --out result.json      # needs 2 GPUs; run by scripts/gpu_check.sh

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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import time
from pathlib import Path

import torch


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
    from oumi_megatron.engine.state.hf_weights import HFWeightExporter
    from oumi_megatron.rollout import weight_stream

    spec = importlib.util.spec_from_file_location("bench_train_step", Path(__file__).with_name("bench_train_step.py"))
    bench_train_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_train_step)
    cfg = bench_train_step.model_config(2048)
    bridge, engine = build_engine_from_hf_config(cfg, MegatronParams(), OptimSettings(), dtype=torch.bfloat16)

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
        "card": torch.cuda.get_device_name(), "gpus": 2, "model_params_b": total / 2 / 1e9, "bytes": best.bytes,
        "tensors": best.tensors, "bucket_mb": best_bucket, "raw_broadcast_gbps": raw_gbps,
        "export_first_s": export_s[0], "export_only_s": min(export_s[1:]), "sync_s": best_s, "sync_gbps": best.bytes / best_s / 1e9,
        "fraction_of_raw": best.bytes / best_s / 1e9 / raw_gbps,
        "rounds_s": {f"{b:g} MiB": [round(s, 4) for s, _, bb in syncs if bb == b] for b in args.bucket_mb},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
