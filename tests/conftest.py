"""Shared fixtures: offline env, a tiny local model, YAML helpers, GPU skipping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# No network, no telemetry: everything the tests need is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The longest tests (1-2 minutes each on CI's 2 cores) start first: with two xdist workers the run ends when the
# later worker does, and one of these started last would leave the other worker idle for its whole length.
# (Tests that share an expensive module fixture with their neighbours stay where they are.)
LONGEST_FIRST = (  # by their time in the last clean-clone CI run (2026-12-02: 95-270 s each), longest first
    "test_two_engine_fleet_runs_one_step_off_policy_and_replaces_killed_engines",
    "test_two_nodes_on_one_host_convert_once_resume_and_match_one_node",
    "test_context_and_sequence_parallel_equal_one_rank_on_any_width", "test_state_paths_hold_a_rank_s_own_share",
    "test_asynchronous_grpo_one_step_off_policy_learns_and_resumes",
    "test_an_engine_with_two_tensor_parallel_workers_takes_every_push_from_both_pipeline_stages",
    "test_two_rank_data_parallel_packed_moe_run_learns", "test_oumi_distributed_torchrun_forms_zb_h1_and_module_queue",
    "test_grpo_with_vllm_rollouts_learns", "test_single_rank_run_learns",
    "test_expert_parallel_equals_local_experts_on_any_width", "test_resume_mid_training_continues_exactly",
    "test_lora_run_learns_resumes_exactly_and_checkpoints_the_adapters_alone",
    "test_lora_adapter_sync_sends_the_adapter_alone_and_the_engine_follows_it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST_FIRST) if item.name.startswith(name)),
                                     len(LONGEST_FIRST)))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (GPU test); run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def shared_path(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run sees (the run's base temp without xdist)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwK/
    folder = root / name
    folder.mkdir(exist_ok=True)
    return folder


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[], Any]) -> Any:
    """``build()``'s JSON value, built once in the whole run. A module fixture is built by every xdist worker that
    runs one of its tests, and the two CI workers did build the same references twice (a 2-rank training run, KV
    cache generations: ~2 min of CI); here the first worker builds under a file lock and the others read its result.
    ``build`` writes below a ``shared_path`` so that what it returns is valid on every worker."""
    from filelock import FileLock

    done = shared_path(tmp_path_factory, "shared_once") / f"{name}.json"
    with FileLock(str(done) + ".lock"):
        if not done.is_file():
            done.write_text(json.dumps(build()))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from oumi_megatron.examples.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (4 experts, 2 per token)."""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), arch="qwen3_moe")


def base_config_dict(model_dir: Path | str, **sections: dict[str, Any]) -> dict[str, Any]:
    """A minimal valid MEGATRON_GRPO config as a dict; ``sections`` are merged one level deep."""
    cfg: dict[str, Any] = {
        "model": {"model_name": str(model_dir), "torch_dtype_str": "float32"},
        "data": {
            "train": {
                "datasets": [
                    {"dataset_name": "oumi-megatron/char-class", "dataset_path": str(REPO / "data/char_class_train.jsonl")}
                ]
            }
        },
        "training": {"trainer_type": "MEGATRON_GRPO", "max_steps": 2, "output_dir": "output/tests_unused"},
        "megatron": {"micro_batch_size": 2, "global_batch_size": 8},
        "grpo": {
            "plugins": ["oumi_megatron.examples.demo_task"],  # the char-class dataset
            "num_generations": 4,
            "max_prompt_length": 32,
            "max_completion_length": 16,
            "reward_functions": [{"name": "soft_5tokens_completions"}],
        },
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def make_config(tmp_path: Path, tiny_model_dir: Path):  # noqa: ANN201
    """Builds a MegatronTrainingConfig through Oumi's own loader (the patched TrainingConfig)."""
    from oumi.core.configs import TrainingConfig

    def _make(overrides: list[str] | None = None, **sections: dict[str, Any]):  # noqa: ANN202
        path = write_yaml(tmp_path / "cfg.yaml", base_config_dict(tiny_model_dir, **sections))
        return TrainingConfig.from_yaml_and_arg_list(str(path), overrides or [])

    return _make


def run_cli(args: list[str], timeout: int = 600, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # COLUMNS: Oumi's rich console wraps long messages at the terminal width; keep them on one line.
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "400", **(env or {})}
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _process_tree(root: int) -> set[int]:
    """``root`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def run_cli_watching_listeners(args: list[str], timeout: int = 600, env: dict[str, str] | None = None,
                               every_s: float = 0.2) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``run_cli`` that also reads, every ``every_s`` while the command runs, the TCP listening sockets of its
    processes (``ss -ltnp``): (the finished process, every local address:port seen listening)."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "400", **(env or {})}
    seen: set[str] = set()
    with subprocess.Popen(args, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        import threading

        out: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
                   for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            pids = _process_tree(proc.pid)
            listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
            for line in listing.splitlines():
                fields = line.split()
                if len(fields) >= 6 and any(f"pid={pid}," in fields[-1] for pid in pids):
                    seen.add(fields[3])
            time.sleep(every_s)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for r in readers:
            r.join()
    return subprocess.CompletedProcess(args, proc.returncode, out.get("stdout", ""), out.get("stderr", "")), seen


def is_loopback(address: str) -> bool:
    """A listening address of ``ss`` (``127.0.0.1:5000``, ``[::1]:5000``, ``*:5000``) on the loopback interface only."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def free_port() -> int:
    from oumi_megatron.engine.parallel.distributed import free_port as below_ephemeral_range

    return below_ephemeral_range()
