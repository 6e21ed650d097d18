"""Checkpoint and conversion-cache safety, without a training run: no pickle of ours is ever loaded, the
manifest catches truncated and changed files, the newest complete checkpoint is found, and weights
changed in place are re-converted."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from oumi_megatron.engine.state.checkpointing import (
    CheckpointError,
    _read_rank_state,
    newest_valid_checkpoint,
    verify_checkpoint,
    write_manifest,
)


def _fake_checkpoint(root: Path, step: int) -> Path:
    """The file layout of a checkpoint (small stand-in contents), written the way save_checkpoint commits."""
    path = root / f"step_{step:06d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(os.urandom(64 * 1024))
    (path / "model" / ".metadata").write_bytes(b"meta" * 10)
    (path / "rank_00000.json").write_text(json.dumps({"engine_step": step}))
    write_manifest(path)
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
