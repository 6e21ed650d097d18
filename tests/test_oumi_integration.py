"""Subprocess tests: the real `oumi` CLI, torchrun (gloo, 2 ranks) and `oumi-megatron` reach the plugin,
and stock Oumi keeps working."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, base_config_dict, free_port, run_cli, shared_once, shared_path, write_yaml

pytestmark = pytest.mark.slow

PY = str(VENV_BIN / "python")
LAYOUT_PP2 = "TP 1 x PP 2 x CP 1 x DP 1 = world size 2"


@pytest.fixture(scope="module")
def good_yaml(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """One config for every xdist worker (its output_dir holds ``pp2_run``'s run, built once)."""
    def build() -> str:
        folder = shared_path(tmp_path_factory, "integration_good")
        data = base_config_dict(tiny_model_dir, training={"output_dir": str(folder / "out")})
        return str(write_yaml(folder / "good.yaml", data))

    return Path(shared_once(tmp_path_factory, "integration_good_yaml", build))


@pytest.fixture(scope="module")
def bad_yaml(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("cfg")
    data = base_config_dict(tiny_model_dir, grpo={"temperature": 3.0}, megatron={"tensor_model_parallel_size": 4},
                            training={"output_dir": str(folder / "out")})
    return write_yaml(folder / "bad.yaml", data)


def test_python_start_does_not_import_oumi() -> None:
    out = run_cli([PY, "-c", "import sys; print('oumi' in sys.modules, any(isinstance(f, type) for f in sys.meta_path))"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False"
    out = run_cli([PY, "-c", "import sys, oumi; print('oumi.train' in sys.modules, 'oumi_megatron' in sys.modules)"])
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_oumi_megatron_validate_cli_prints_layout() -> None:
    shape = REPO / "configs/model_shapes/llama-3.1-70b-instruct/config.json"
    out = run_cli(["oumi-megatron", "validate", "-c", "configs/train_70b_grpo.yaml", "--world-size", "16",
                   "--gpus-per-node", "8", "--model-config", str(shape)])
    assert out.returncode == 0, out.stderr
    assert "TP 8 x PP 2 x CP 1 x DP 1 = world size 16" in out.stdout
    assert "nodes: 2 x 8 GPUs" in out.stdout
    assert "microbatches per step per DP rank: 4" in out.stdout
    assert "pipeline schedule: 1f1b" in out.stdout
    assert "memory not checked: GPU memory unknown" in out.stdout  # no GPU here and no --gpu-memory-gib
    small = run_cli(["oumi-megatron", "validate", "-c", "configs/train_70b_grpo.yaml", "--world-size", "16",
                     "--gpus-per-node", "8", "--model-config", str(shape), "--gpu-memory-gib", "24"])
    assert small.returncode == 2 and "will not fit" in small.stdout, small.stdout + small.stderr  # valid, too big
    assert "Skipping import of cpp extensions" not in out.stdout + out.stderr  # third-party chatter silenced


def test_python_m_validate_with_overrides_reports_every_problem(good_yaml: Path) -> None:
    out = run_cli([PY, "-m", "oumi_megatron", "validate", "-c", str(good_yaml), "--world-size", "2",
                   "--megatron.tensor_model_parallel_size", "4", "--grpo.num_generations=1"])
    assert out.returncode == 1
    assert "world_size (2) must be divisible by the product of all model parallel sizes (4)" in out.stderr
    assert "grpo.num_generations: must be at least 2" in out.stderr


def test_oumi_train_reaches_the_plugin_with_a_bad_config(bad_yaml: Path) -> None:
    out = run_cli(["oumi", "train", "-c", str(bad_yaml)])
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "MEGATRON_GRPO config has" in text
    assert "grpo.temperature" in text and "megatron.tensor_model_parallel_size" in text


@pytest.fixture(scope="module")
def pp2_run(good_yaml: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``torchrun -m oumi train`` with PP=2 and the default 1F1B schedule into good_yaml's output_dir: the
    conversion and the reference metrics the launch-form test compares against (run once for every xdist worker:
    conftest.shared_once)."""
    def build() -> str:
        out = run_cli(["torchrun", "--nproc_per_node", "2", "--master-port", str(free_port()), "-m", "oumi", "train",
                       "-c", str(good_yaml), "--megatron.pipeline_model_parallel_size", "2"])
        return out.stdout + out.stderr

    return shared_once(tmp_path_factory, "integration_pp2_run", build)


def test_torchrun_two_ranks_reach_the_plugin(good_yaml: Path, pp2_run: str) -> None:
    text = pp2_run
    assert LAYOUT_PP2 in text, text[-3000:]
    # the trainer converted the model once with Megatron-Bridge and built the engine on both ranks
    checkpoint = good_yaml.parent / "out" / "megatron_checkpoint"
    assert (checkpoint / "oumi_megatron.json").is_file() and (checkpoint / "model").is_dir()
    assert "Megatron-Core engine ready: 1 model chunk(s) per rank" in text, text[-3000:]
    # (two ranks stopping at validation on a bad config: the stock `oumi distributed torchrun` form below)


def test_oumi_distributed_torchrun_forms_zb_h1_and_module_queue(good_yaml: Path, bad_yaml: Path, pp2_run: str,
                                                               tmp_path: Path) -> None:
    """Both ``oumi distributed torchrun`` forms reach the plugin on 2 ranks: the stock form
    (``-m oumi train -c``) stops at validation on a bad config; the seed's form (``-c``) trains with PP=2,
    ZB-H1 (``--megatron.pipeline_schedule zb_h1``) and ModuleQueue on the last stage. The metrics name the
    schedule that ran (and ZB-H1's deferred weight-gradient GEMMs) and whether ModuleQueue streamed
    weights, and the run learns exactly like the 1F1B run of ``pp2_run`` (same config, plain torchrun):
    ZB-H1 changes when weight gradients are computed and ModuleQueue where weights wait, not what they
    are (rewards equal, losses and grad norms within 1e-6)."""
    # launched from a folder holding a file named like the module torchrun runs: the ranks run Oumi, not the file
    shadow = tmp_path / "launch"
    shadow.mkdir()
    (shadow / "oumi.py").write_text("import sys\nprint('SHADOWED: the launch folder came first')\nsys.exit(3)\n")
    stock = run_cli(["oumi", "distributed", "torchrun", "--nproc-per-node", "2", "-m", "oumi", "train", "-c", str(bad_yaml)],
                    env={"MASTER_PORT": str(free_port())}, cwd=shadow)
    assert stock.returncode != 0
    stock_output = stock.stdout + stock.stderr
    assert "SHADOWED" not in stock_output, stock_output[-2000:]
    assert "MEGATRON_GRPO config has" in stock_output and "megatron.tensor_model_parallel_size" in stock_output
    # a new output_dir (a used one is refused), with the conversion of the pp2 run copied in
    out_dir = tmp_path / "seed"
    shutil.copytree(good_yaml.parent / "out" / "megatron_checkpoint", out_dir / "megatron_checkpoint")
    out = run_cli(["oumi", "distributed", "torchrun", "--nproc-per-node", "2", "-c", str(good_yaml),
                   "--megatron.pipeline_model_parallel_size", "2", "--megatron.pipeline_schedule", "zb_h1",
                   "--megatron.enable_module_queue", "true", "--training.output_dir", str(out_dir)],
                  env={"MASTER_PORT": str(free_port())})
    text = out.stdout + out.stderr
    assert "unrecognized arguments" not in text
    assert LAYOUT_PP2 in text and "pipeline schedule: zb_h1" in text, text[-3000:]
    assert "Reusing the converted checkpoint" in text, text[-3000:]
    runs = {}
    for schedule, folder in (("1f1b", good_yaml.parent / "out"), ("zb_h1", out_dir)):
        module_queue = schedule == "zb_h1"
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert records and all(r["pipeline/schedule"] == schedule for r in records), records
        assert all((r["pipeline/deferred_wgrad_ops"] > 0) == (schedule == "zb_h1") for r in records), records
        assert all(r["module_queue/active"] == module_queue and (r["module_queue/offloaded_mib"] > 0) == module_queue
                   for r in records), records
        runs[schedule] = records
    ref, zb = runs["1f1b"], runs["zb_h1"]
    assert len(zb) == len(ref) and [r["reward/mean"] for r in zb] == [r["reward/mean"] for r in ref]
    for a, b in zip(zb, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * max(abs(b["loss"]), 1e-12)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * b["grad_norm"]


def test_stock_oumi_sft_still_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
            for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {"model_name": str(tiny_model_dir), "torch_dtype_str": "float32", "model_max_length": 64},
        "data": {"train": {"datasets": [{"dataset_name": "text_sft_jsonl", "dataset_path": str(data)}]}},
        "training": {"trainer_type": "TRL_SFT", "max_steps": 2, "per_device_train_batch_size": 2,
                     "output_dir": str(tmp_path / "out"), "save_final_model": False, "logging_steps": 1,
                     "enable_wandb": False, "enable_tensorboard": False, "dataloader_num_workers": 0},
    }
    path = write_yaml(tmp_path / "sft.yaml", cfg)
    out = run_cli(["oumi", "train", "-c", str(path)])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "MEGATRON" not in out.stdout + out.stderr
