"""The HF export's writer (engine/state/hf_writer.py), without a model: safetensors files byte for byte as
safetensors writes them, shards cut as huggingface_hub cuts them, and the shards of a stage spread over its ranks
with at most one shard held per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oumi_megatron.engine.state.hf_writer import HFExportError, StageShards, _name_files, write_safetensors
from oumi_megatron.utils.disk import parse_size


def _tensors(sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.w", torch.randn(n, generator=g).to(dtype)) for i, n in enumerate(sizes)]


def test_files_are_byte_identical_to_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16, torch.uint16,
              torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
              torch.uint64]
    tensors = {f"t{len(dtypes) - i}.{dt}": (torch.randn(3, 5, generator=g) * 10).to(dt) for i, dt in enumerate(dtypes)}
    tensors.update({"empty": torch.zeros(0, 4), "scalar": torch.tensor(3.0),
                    "strided_view": torch.arange(20.0).reshape(4, 5)[:, 1:3]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", list(tensors.items()), {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def _write_stage(folder: Path, stream: list[tuple[str, torch.Tensor]], ranks: list[int], max_bytes: int,
                 stage: int = 0) -> tuple[list[dict], dict[int, int]]:
    """Every rank of a stage fed the same stream (as each sees it after the TP gather); returns their reports and the
    most bytes each rank held at once."""
    reports, held = [], {}
    for rank in ranks:
        shards = StageShards(folder, stage, ranks, max_bytes, rank)
        most = 0
        for name, t in stream:
            shards.add(name, t)
            buffered = sum(x.numel() * x.element_size() for _, x in (shards.current.tensors if shards.current else []))
            most = max(most, buffered)
        reports.append(shards.finish())
        held[rank] = most
    return reports, held


def test_one_rank_cuts_the_shards_huggingface_hub_cuts(tmp_path: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    # sizes in bf16 elements; the limit is 1000 bytes = 500 elements; 700 elements is larger than a shard
    stream = _tensors([100, 200, 150, 700, 60, 400, 90, 500, 10])
    reports, _ = _write_stage(tmp_path, stream, [0], 1000)
    _name_files(tmp_path, reports)
    plan = split_torch_state_dict_into_shards(dict(stream), max_shard_size=1000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == plan.tensor_to_filename
    assert index["metadata"]["total_size"] == plan.metadata["total_size"]
    from safetensors.torch import load_file

    for filename, names in plan.filename_to_tensors.items():
        loaded = load_file(str(tmp_path / filename))
        assert sorted(loaded) == sorted(names)
        for name in names:
            assert torch.equal(loaded[name], dict(stream)[name])


def test_a_stage_spreads_its_shards_over_its_ranks_one_shard_each_at_a_time(tmp_path: Path) -> None:
    stream = _tensors([300] * 12)  # 600 bytes each, two per 1200-byte shard: 6 shards
    reports, held = _write_stage(tmp_path, stream, [4, 5, 6], 1200, stage=1)
    assert [len(r["mine"]) for r in reports] == [2, 2, 2]  # round robin over the stage's ranks
    assert all(h <= 1200 for h in held.values())
    _name_files(tmp_path, reports)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for n, _ in stream)
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]


def test_stages_are_numbered_in_order_and_one_shard_is_model_safetensors(tmp_path: Path) -> None:
    first, second = _tensors([100, 100]), [(f"late.{n}", t) for n, t in _tensors([100])]
    reports = _write_stage(tmp_path, first, [0], 10**6, stage=0)[0] + _write_stage(tmp_path, second, [1], 10**6, stage=1)[0]
    _name_files(tmp_path, reports)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["late.model.layers.0.w"] == "model-00002-of-00002.safetensors"
    alone = tmp_path / "alone"
    alone.mkdir()
    _name_files(alone, _write_stage(alone, first, [0], 10**6)[0])
    assert sorted(p.name for p in alone.iterdir()) == ["model.safetensors"]


def test_ranks_that_disagree_or_fail_stop_the_export(tmp_path: Path) -> None:
    stream = _tensors([100, 100, 100])
    reports, _ = _write_stage(tmp_path, stream, [0, 1], 200)
    reports[1]["stream"] = "something else"
    with pytest.raises(HFExportError, match="pipeline stage 0 exported different tensors"):
        _name_files(tmp_path, reports)
    other = tmp_path / "other"
    other.mkdir()
    reports, _ = _write_stage(other, stream, [0], 200)
    reports[0]["error"] = "OSError: [Errno 28] No space left on device"
    with pytest.raises(HFExportError, match=r"rank 0: OSError: \[Errno 28\] No space left"):
        _name_files(other, reports)


def test_a_failed_write_is_reported_not_raised(tmp_path: Path) -> None:
    shards = StageShards(tmp_path / "missing_folder", 0, [0], 200, 0)  # writing there fails
    for name, t in _tensors([100, 100, 100]):
        shards.add(name, t)
    report = shards.finish()
    assert report["error"] and "No such file or directory" in report["error"]


def test_sizes_read_as_transformers_reads_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2kb") == 2000
    assert parse_size(1234) == 1234 and parse_size("1234") == 1234
