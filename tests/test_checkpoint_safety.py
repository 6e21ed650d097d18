"""Checkpoint and conversion-cache safety, without a training run: no pickle of ours is ever loaded, the
manifest catches truncated and changed files, the newest complete checkpoint is found, and weights
changed in place are re-converted; the conversion frees the model it converted."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import VENV_BIN, run_cli
from oumi_megatron.engine.state.checkpoint_manifest import write_manifest, write_rank_manifest
from oumi_megatron.engine.state.checkpointing import CheckpointError, _read_rank_state, newest_valid_checkpoint, verify_checkpoint


def _fake_checkpoint(root: Path, step: int) -> Path:
    """The file layout of a checkpoint (small stand-in contents), written the way save_checkpoint commits."""
    path = root / f"step_{step:06d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(os.urandom(64 * 1024))
    (path / "model" / ".metadata").write_bytes(b"meta" * 10)
    (path / "rank_00000.json").write_text(json.dumps({"engine_step": step}))
    write_rank_manifest(path, 0)
    write_manifest(path, world_size=1)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "data_position": 4 * step}))
    return path


class _Payload:
    """Unpickling this runs os.system: what a crafted checkpoint could do to torch.load(weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_rank_file_is_never_loaded(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    marker = tmp_path / "pwned"
    with (ckpt / "rank_00000.pt").open("wb") as f:
        pickle.dump({"rng": _Payload(marker)}, f)
    pickle.loads(pickle.dumps(_Payload(tmp_path / "proof")))  # the payload does run when unpickled ...
    assert (tmp_path / "proof").exists()
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt, a pickle, which is not loaded"):
        _read_rank_state(ckpt, 0)
    assert not marker.exists()  # ... but never from a checkpoint


def test_rng_and_scheduler_state_round_trips_through_json(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from oumi_megatron.engine.cpu_shims import install_cpu_shims
    from oumi_megatron.engine.state import checkpointing

    install_cpu_shims()
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(checkpointing._rng_state()))  # plain JSON, nothing else
    draws = (random.random(), np.random.rand(), torch.rand(3))
    checkpointing._set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])
    assert set(state["megatron_tracker"]) == {"model-parallel-rng"}


def test_manifest_catches_truncated_changed_and_missing_files(tmp_path: Path) -> None:
    good = _fake_checkpoint(tmp_path, 2)
    assert verify_checkpoint(good) is None
    shard = good / "model" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    assert "has 65535 bytes, 65536 were written" in verify_checkpoint(good)
    shard.write_bytes(data)
    (good / "rank_00000.json").write_text(json.dumps({"engine_step": 3}))  # same size, other content
    assert "does not match the checksum" in verify_checkpoint(good)
    (good / "rank_00000.json").unlink()
    assert "rank_00000.json is missing" in verify_checkpoint(good)
    (good / "trainer_state.json").unlink()
    assert "trainer_state.json is missing" in verify_checkpoint(good)


def test_newest_valid_checkpoint_skips_damaged_ones(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_checkpoint(root, step)
    for step in (4, 6):
        shard = root / f"step_{step:06d}" / "model" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    assert newest_valid_checkpoint(root) == root / "step_000002"
    assert "step_000006 is damaged" in caplog.text and "step_000004 is damaged" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004", "step_000006"]  # read-only
    shutil.rmtree(root / "step_000002")
    assert newest_valid_checkpoint(root) is None


def test_weights_changed_in_place_are_reconverted(tmp_path: Path, tiny_model_dir: Path) -> None:
    from oumi_megatron.engine.state.conversion import META_FILE, checkpoint_matches_source, source_fingerprint

    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    converted = tmp_path / "megatron_checkpoint"
    converted.mkdir()
    (converted / META_FILE).write_text(json.dumps({"format_version": 1, **source_fingerprint(src)}))
    assert checkpoint_matches_source(converted, src) == (True, "matches")
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # other weights, same size (was: silently not re-converted)
    weights.write_bytes(bytes(data))
    ok, why = checkpoint_matches_source(converted, src)
    assert not ok and "weight_files" in why


def _fake_world_checkpoint(root: Path, world: int) -> Path:
    """A checkpoint as `world` ranks write it: each rank its rank state, one model and one optimizer file (the same
    sizes on every rank) and its manifest; rank 0 the shared files and the shared manifest. Like torch's, the
    distributed checkpoint's global ``.metadata`` grows with the ranks (their shards' offsets)."""
    path = root / f"step_world{world}"
    for sub in ("model", "optimizer"):
        (path / sub).mkdir(parents=True)
        (path / sub / ".metadata").write_bytes(b"m" * (4096 + 64 * world))
        (path / sub / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / "hf").mkdir()
    (path / "hf" / "config.json").write_text("{}")
    for rank in range(world):
        (path / "model" / f"__{rank}_0.distcp").write_bytes(bytes([rank % 251]) * 20_000)
        (path / "optimizer" / f"__{rank}_0.distcp").write_bytes(bytes([rank % 251]) * 60_000)
        (path / f"rank_{rank:05d}.json").write_text(json.dumps({"engine_step": 3, "rank": rank}))
        write_rank_manifest(path, rank)
    write_manifest(path, world_size=world)
    (path / "trainer_state.json").write_text(json.dumps({"step": 3, "data_position": 12}))
    return path


def test_each_rank_verifies_only_its_own_files(tmp_path: Path) -> None:
    """The resume check reads O(a rank's own files) per rank: at 64 ranks each rank reads what it read at 4 (within
    10%; rank 0 also the shared metadata, which grows with the ranks); every file is checked by exactly one rank; a
    damaged shard of one rank is found by that rank alone."""
    from oumi_megatron.engine.state.checkpoint_manifest import verify_share

    small, large = _fake_world_checkpoint(tmp_path, 4), _fake_world_checkpoint(tmp_path, 64)
    reads = {w: [verify_share(ckpt, r, w) for r in range(w)] for w, ckpt in ((4, small), (64, large))}
    assert all(s.problem is None for shares in reads.values() for s in shares)
    for rank in (1, 3):
        assert reads[64][rank].bytes_read <= 1.1 * reads[4][rank].bytes_read, (rank, reads[64][rank], reads[4][rank])
    assert max(s.bytes_read for s in reads[64][1:]) <= 1.1 * min(s.bytes_read for s in reads[4][1:])
    metadata_growth = 2 * 64 * (64 - 4)  # the two .metadata files, rank 0's
    assert reads[64][0].bytes_read - metadata_growth <= 1.1 * reads[4][0].bytes_read
    # resumed on fewer ranks: rank r checks the saved ranks r, r + 4, ...: still every file once
    assert all(verify_share(large, r, 4).problem is None for r in range(4))
    shard = large / "optimizer" / "__37_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    problems = {r: verify_share(large, r, 64).problem for r in range(64)}
    assert [r for r, p in problems.items() if p] == [37]
    assert "__37_0.distcp has 59999 bytes, 60000 were written" in problems[37]
    assert "__37_0.distcp" in verify_share(large, 1, 4).problem  # 37 = 1 + 9 x 4
    (large / "manifest_rank_00012.json").unlink()
    assert "manifest_rank_00012.json is missing (rank 12 of the 64 that saved did not finish)" in verify_share(large, 12, 64).problem


def test_a_disk_too_small_for_the_run_stops_it_before_conversion(tmp_path: Path) -> None:
    """The start check compares output_dir's real free space with what the run will write (the converted model, the
    checkpoints that coexist, the export): Llama-3.1-70B's ~3 TB does not fit this disk, a tiny model does."""
    from types import SimpleNamespace

    from oumi_megatron.model_shape import ModelShape
    from oumi_megatron.trainer.run_dir import OutputDirSpaceError, StartPoint, check_space

    repo = Path(__file__).resolve().parent.parent
    training = SimpleNamespace(output_dir=str(tmp_path / "run"), max_steps=100, save_steps=10, save_final_model=True)
    config = SimpleNamespace(training=training, megatron=SimpleNamespace(checkpoint_config=SimpleNamespace(keep_last_n_checkpoints=2)))
    big = ModelShape.from_file(repo / "configs" / "model_shapes" / "llama-3.1-70b-instruct" / "config.json")
    with pytest.raises(OutputDirSpaceError, match=r"training.output_dir: .*run has [\d.]+ [KMGT]iB free and this run \(3 checkpoint"
                                                  r".*lower megatron.checkpoint_config.keep_last_n_checkpoints"):
        check_space(config, big, StartPoint(None, 0))
    assert not (tmp_path / "run").exists()  # nothing written
    small = ModelShape(source="tiny", model_type="llama", architectures=("LlamaForCausalLM",), num_layers=2, hidden_size=64,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320, intermediate_size=128)
    check_space(config, small, StartPoint(None, 0))


_SAVE_WITHOUT_ROOM = """
import sys
from pathlib import Path

import pytest
import torch

from oumi_megatron.config.megatron_params import MegatronParams
from oumi_megatron.engine.builder import build_engine_from_hf_config
from oumi_megatron.engine.optimizer import OptimSettings
from oumi_megatron.engine.parallel.layout import engine_layout
from oumi_megatron.engine.state import checkpointing
from oumi_megatron.examples.tiny_models import build_tiny_model, tiny_config

tmp = Path(sys.argv[1])
hf = build_tiny_model(tmp / "hf", arch="llama")
cfg = tiny_config("llama")
cfg.architectures = ["LlamaForCausalLM"]
params = MegatronParams()
_, engine = build_engine_from_hf_config(cfg, engine_layout(params), params, OptimSettings(), dtype=torch.float32)
checkpointing._materialize_adam_state(engine.optimizer)
root = tmp / "checkpoints"
first = checkpointing.save_checkpoint(engine, root, 1, {"data_position": 0}, hf, keep_last=2)
assert 0 < checkpointing.checkpoint_bytes(engine) < 50 * 2**20
checkpointing.checkpoint_bytes = lambda _engine: 10.0**18  # more than any disk
with pytest.raises(checkpointing.CheckpointSpaceError, match=r"checkpoint step 2 \\(the 2 newest are kept until it is "
                                                             r"complete\\) needs ~909494.7 TiB: free space there") as e:
    checkpointing.save_checkpoint(engine, root, 2, {"data_position": 4}, hf, keep_last=2)
assert sorted(p.name for p in root.iterdir()) == ["step_000001"], sorted(root.iterdir())
assert checkpointing.verify_checkpoint(first) is None
print("OK", e.value)
"""


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A save whose checkpoint the disk cannot take stops before its folder exists; the checkpoint already there stays
    complete. (The engine's checkpoint size is made larger than any disk: filling a real disk is not a unit test.)
    Its own process: it sets up Megatron's parallel state."""
    import sys

    from conftest import free_port, run_cli

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = run_cli([sys.executable, "-c", _SAVE_WITHOUT_ROOM, str(tmp_path)], env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout and "keep_last_n_checkpoints" in proc.stdout, \
        (proc.stdout + proc.stderr)[-4000:]


_CONVERT_AND_COUNT = """
import gc, sys, weakref
from pathlib import Path
from oumi_megatron.engine.state import conversion
from oumi_megatron.examples.tiny_models import build_tiny_model
refs = []
build = conversion.build_model_chunks
def watched(*args, **kwargs):
    chunks = build(*args, **kwargs)
    refs.extend(weakref.ref(p) for c in chunks for p in c.parameters())
    return chunks
conversion.build_model_chunks = watched
work = Path(sys.argv[1])
conversion.convert_hf_to_megatron(build_tiny_model(work / "hf", arch="qwen2"), work / "mc")
gc.collect()
print("alive", sum(r() is not None for r in refs), "of", len(refs))
"""


def test_conversion_frees_the_model_it_converted(tmp_path: Path) -> None:
    """A fresh process (the first import of Megatron-Bridge happens inside the conversion, as in a run): once
    convert_hf_to_megatron returns, none of the converted model's parameters is alive. Before bridge_utils imported
    Bridge on a thread of its own, pulp's stored import errors (through nvidia-modelopt) pinned the conversion's
    frame, and with it the whole model: a bf16 model of GPU memory per rank through training (the 70B-wide slice's
    GRPO step started at 14.2 GiB where the plan has 7.1)."""
    proc = run_cli([str(VENV_BIN / "python"), "-c", _CONVERT_AND_COUNT, str(tmp_path)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    alive, _, total = proc.stdout.strip().splitlines()[-1].split()[1:]
    assert int(total) > 0 and int(alive) == 0, proc.stdout[-500:]
