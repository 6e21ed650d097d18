"""Background checkpoint writes under load: is every checkpoint readable the moment it is committed?

    .venv/bin/python scripts/stress_async_checkpoint.py [--saves 50] [--burners 2] [--out result.json]

One process trains a tiny Llama (fp32, world of one) and saves a checkpoint after every step with the asynchronous
writer (``checkpoint_config.use_async_checkpoint``: Megatron-Core stages the tensors, a forked process writes them,
the checkpoint is renamed into place by the finalize step). Meanwhile ``--burners`` processes keep every CPU busy and
write to the same disk. As soon as a checkpoint is committed, a fresh process loads it the way a resumed run does
(``load_checkpoint``: manifests verified, model, optimizer, scheduler and RNG restored) and returns a digest of the
model's parameters and of the optimizer's state; the trainer compares them with digests it took when it scheduled
that save. A checkpoint passes when it loads and both digests match. Prints one line per save and a summary; writes
the numbers to ``--out`` (docs/benchmarks.md, "Background checkpoint writes under load").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _engine(converted: Path) -> Any:
    import torch

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout

    params = MegatronParams()
    params.transformer_config.recompute_granularity = None
    settings = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0, total_steps=1000)
    return build_engine(converted, engine_layout(params), params, settings, dtype=torch.float32)[1]


def _digests(engine: Any) -> dict[str, str]:
    """sha256 of the model's parameters (by name) and of the optimizer's state tensors (in state-dict order)."""
    import torch

    from oumi_megatron.engine.wrappers import unwrap

    model = hashlib.sha256()
    for chunk in engine.model:
        for name, p in sorted(unwrap(chunk).named_parameters()):
            model.update(name.encode())
            model.update(p.detach().float().cpu().numpy().tobytes())
    optim = hashlib.sha256()  # Adam's moments and steps, parameter by parameter in each torch optimizer's order
    chained = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    for megatron_optimizer in chained:
        inner = megatron_optimizer.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                for key, value in sorted(inner.state.get(param, {}).items()):
                    optim.update(key.encode())
                    optim.update(torch.as_tensor(value).detach().float().cpu().numpy().tobytes())
    return {"model": model.hexdigest(), "optimizer": optim.hexdigest()}


def _batch(step: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 300, (8, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    mask[:, -1] = 0
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids.split(4), mask.split(4))]


def _nll(logprobs: Any, batch: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    mask = batch["loss_mask"].float()
    return -(logprobs * mask).sum(), mask.sum().to(torch.int), {}


def read(converted: Path, checkpoint: Path, out: Path) -> None:
    """The reader: load ``checkpoint`` as a resumed run does, write its digests (or the error) to ``out``."""
    from oumi_megatron.engine.state.checkpointing import load_checkpoint

    engine = _engine(converted)
    started = time.perf_counter()
    try:
        load_checkpoint(engine, checkpoint)
        result: dict[str, Any] = {"ok": True, **_digests(engine)}
    except Exception as e:  # noqa: BLE001 - the error is the result
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result["load_s"] = time.perf_counter() - started
    out.write_text(json.dumps(result))


def _burn(stop: Any, folder: str) -> None:
    """Load: a CPU spinning and a file rewritten on the checkpoints' disk, until ``stop`` is set."""
    path, block, x = Path(folder) / f"burn_{os.getpid()}", os.urandom(1 << 20), 0
    while not stop.is_set():
        for _ in range(200_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        with open(path, "wb") as f:
            for _ in range(8):
                f.write(block)
    path.unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=50)
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="processes that keep the CPUs and disk busy")
    p.add_argument("--readers", type=int, default=2, help="checkpoint readers at once")
    p.add_argument("--out", type=Path, default=None, help="the numbers as JSON")
    p.add_argument("--read", nargs=3, metavar=("CONVERTED", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.read:
        read(Path(args.read[0]), Path(args.read[1]), Path(args.read[2]))
        return 0

    from oumi_megatron.engine.state.checkpointing import AsyncCheckpointWriter, list_checkpoints, save_checkpoint
    from oumi_megatron.examples.tiny_models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="stress_async_ckpt_"))
    hf = build_tiny_model(work / "hf", arch="llama")
    converted = work / "megatron"
    subprocess.run([sys.executable, "-m", "oumi_megatron", "convert", "--hf", str(hf), "--out", str(converted),
                    "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
    engine = _engine(converted)
    writer, root = AsyncCheckpointWriter(), work / "checkpoints"
    stop = mp.get_context("spawn").Event()
    burners = [mp.get_context("spawn").Process(target=_burn, args=(stop, str(work)), daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    expected: dict[int, dict[str, str]] = {}
    readers: dict[int, subprocess.Popen[bytes]] = {}
    seen: set[int] = set()
    # each reader a world of one of its own: without the rendezvous variables this process's world of one set
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                           "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"

    def start_readers(block: bool) -> None:
        for step, path in list_checkpoints(root):
            if step in seen:
                continue
            while sum(r.poll() is None for r in readers.values()) >= args.readers:
                time.sleep(0.05)
            seen.add(step)
            readers[step] = subprocess.Popen([sys.executable, __file__, "--read", str(converted), str(path),
                                              str(work / f"read_{step}.json")], env=env, cwd=REPO,
                                             stdout=subprocess.DEVNULL, stderr=open(work / f"read_{step}.log", "wb"))
        if block:
            for r in readers.values():
                r.wait()

    started = time.perf_counter()
    try:
        for step in range(1, args.saves + 1):
            engine.train_step(_batch(step), _nll)
            expected[step] = _digests(engine)  # what the checkpoint of this step must hold
            save_checkpoint(engine, root, step, {"data_position": step}, converted / "hf", keep_last=0, async_writer=writer)
            writer.poll()  # commits the writes that finished
            start_readers(block=False)
        writer.close()
        start_readers(block=True)
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=30)
    rows = []
    for step in sorted(expected):
        f = work / f"read_{step}.json"
        got = json.loads(f.read_text()) if f.is_file() else {"ok": False, "error": (work / f"read_{step}.log").read_text()[-400:]}
        good = got["ok"] and got["model"] == expected[step]["model"] and got["optimizer"] == expected[step]["optimizer"]
        rows.append({"step": step, "loaded": got["ok"], "identical": good, "error": got.get("error"),
                     "load_s": got.get("load_s")})
        print(f"step {step:3d}: {'ok' if good else 'FAILED'}" + (f" ({got.get('error')})" if got.get("error") else
                                                                  "" if good else " (digests differ)"))
    passed = sum(r["identical"] for r in rows)
    summary = {"saves": args.saves, "passed": passed, "burners": args.burners, "cpus": os.cpu_count(),
               "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    print(f"{passed} of {args.saves} checkpoints loaded the moment they were committed, each holding exactly its step's "
          f"model and optimizer ({args.burners} burners on {os.cpu_count()} CPUs, {summary['seconds']} s)")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0 if passed == args.saves else 1


if __name__ == "__main__":
    sys.exit(main())
