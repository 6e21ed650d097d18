"""Files are handled safely: an ``--out`` that holds a folder of the user's is refused (nothing deleted) unless
``--overwrite``; a checkpoint from elsewhere is data (its ``.metadata`` read through an allow-list unpickler, its
manifest confined to its folder, no link followed out of it by the export); output folders are private to the user."""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from oumi_megatron.engine.state import safe_reads
from oumi_megatron.engine.state.checkpoint_manifest import MANIFEST_FILE, STATE_FILE, verify_checkpoint
from oumi_megatron.engine.state.hf_writer import save_hf_folder
from oumi_megatron.errors import UserInputError
from oumi_megatron.utils.atomic import HF_MODEL, OUTPUT_MARKER, check_output_dir, output_kind


def test_an_out_folder_of_the_user_s_is_refused_and_kept(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UserInputError, match="--overwrite"):
        check_output_dir(mine, HF_MODEL)
    check_output_dir(mine, HF_MODEL, overwrite=True)  # said by name
    check_output_dir(tmp_path / "new", HF_MODEL)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", HF_MODEL)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="a file is there"):
        check_output_dir(tmp_path / "file", HF_MODEL, overwrite=True)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / OUTPUT_MARKER).write_text(json.dumps({"kind": HF_MODEL}))
    check_output_dir(ours, HF_MODEL)  # an earlier output of the same kind is replaced
    with pytest.raises(UserInputError, match="megatron_checkpoint"):
        check_output_dir(ours, "megatron_checkpoint")
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_convert_refuses_a_used_folder_then_writes_a_private_marked_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "converted"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    refused = run_cli(["oumi-megatron", "convert", "--hf", str(tiny_model_dir), "--out", str(out)])
    assert refused.returncode == 1 and "--overwrite" in refused.stderr, refused.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "keep me"
    done = run_cli(["oumi-megatron", "convert", "--hf", str(tiny_model_dir), "--out", str(out), "--overwrite"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "notes.txt").exists() and output_kind(out) == "megatron_checkpoint"
    assert stat.S_IMODE(out.stat().st_mode) & 0o007 == 0, oct(out.stat().st_mode)  # others cannot enter
    check_output_dir(out, "megatron_checkpoint")  # a later convert may replace its own output


class _Payload:
    """What a crafted pickle would run: here, a file written where the test looks."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (Path.write_text, (Path(self.path), "ran"))


def test_a_crafted_checkpoint_metadata_is_refused_without_running_anything(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    witness = tmp_path / "witness"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(witness))))
    safe_reads.install()
    with pytest.raises(safe_reads.CheckpointMetadataError, match="pathlib.Path"):
        FileSystemReader(str(folder)).read_metadata()
    assert not witness.exists()
    # what torch writes still reads back (a real .metadata's classes)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    real = Metadata(state_dict_metadata={"x": BytesStorageMetadata(), "y": TensorStorageMetadata(
        properties=torch.distributed.checkpoint.metadata.TensorProperties(dtype=torch.bfloat16), size=torch.Size([2]),
        chunks=[])})
    (folder / ".metadata").write_bytes(pickle.dumps(real))
    assert FileSystemReader(str(folder)).read_metadata().state_dict_metadata.keys() == {"x", "y"}
    # byte items go through torch's weights-only unpickler
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    buffer = io.BytesIO()
    torch.save(_Payload(str(witness)), buffer)
    buffer.seek(0)
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})()})()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buffer)
    assert not witness.exists()


def _checkpoint_with_manifest(root: Path, files: dict) -> Path:
    ckpt = root / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text("{}")
    (ckpt / MANIFEST_FILE).write_text(json.dumps({"files": files}))
    return ckpt


def test_a_manifest_cannot_name_files_outside_its_checkpoint(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s")
    for name in ("../secret", str(secret), "sub/../../secret"):
        ckpt = _checkpoint_with_manifest(tmp_path / name.replace("/", "_"), {name: {"size": 1}})
        assert "not a file inside it" in (verify_checkpoint(ckpt) or ""), name
    ckpt = _checkpoint_with_manifest(tmp_path / "link", {"model": {"size": 1}})
    (ckpt / "model").symlink_to(secret)
    assert "not a file inside it" in (verify_checkpoint(ckpt) or "")


def test_the_export_copies_no_link_out_of_the_checkpoint(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    (hf / "tokenizer_config.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy")
    (hf / "tokenizer.json").symlink_to(secret)
    out = save_hf_folder([("model.embed_tokens.weight", torch.zeros(2, 2))], 0, hf, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "config.json", "model.safetensors",
                                                     "tokenizer_config.json"]
    assert output_kind(out) == HF_MODEL and stat.S_IMODE(os.stat(out).st_mode) & 0o007 == 0


def test_the_dashboard_config_has_its_secrets_redacted(make_config) -> None:  # noqa: ANN001
    """``training.enable_wandb``: the sections W&B shows keep every setting but those named like secrets (a reward's
    ``api_key``, an engine's ``hf-token``); ``max_observation_tokens`` is not a secret."""
    from oumi_megatron.trainer.step_metrics import REDACTED, wandb_settings

    config = make_config(["training.enable_wandb=true"], grpo={
        "reward_functions": [{"name": "char_class", "kwargs": {"api_key": "sk-live", "threshold": 3}}]})
    shown = wandb_settings(config)["config"]
    kwargs = shown["grpo"]["reward_functions"][0]["kwargs"]
    assert kwargs == {"api_key": REDACTED, "threshold": 3}, kwargs
    assert shown["grpo"]["max_observation_tokens"] == config.grpo.max_observation_tokens
    assert "sk-live" not in json.dumps(shown, default=str)
