"""Two nodes simulated on one host (issue 43): two ``torchrun --nnodes 2 --nproc_per_node 2`` agents on 127.0.0.1, each
"node" a folder of its own (its working directory, HF cache and TMPDIR, and its own copy of the tiny model, with its
own modification times, found through the config's relative ``model.model_name``), one shared ``output_dir``.

- The run converts exactly once (global rank 0 decides), trains, checkpoints, is killed, resumes (rank 0's view of
  the model decides again: the nodes' copies differ in their modification times, which made node 1 re-convert while
  node 0 went on, a hang) and exports; its metrics and its exported weights equal a one-node 4-rank run's.
- With a node-local ``output_dir`` (a relative path: each node's own folder) every rank stops at start with the
  shared-filesystem error naming training.output_dir, before anything is converted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.slow
TORCHRUN = str(VENV_BIN / "torchrun")
STEPS = 4  # killed after the checkpoint of step 2, resumed for steps 3 and 4


def _config(output_dir: str) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "tiny_cpu_grpo.yaml").read_text())
    cfg["model"]["model_name"] = "model"  # each node's own copy, relative to its working directory
    cfg["data"]["train"]["datasets"][0]["dataset_path"] = str(REPO / "data" / "char_class_train.jsonl")
    cfg["training"].update(output_dir=output_dir, max_steps=STEPS, save_steps=2, try_resume_from_last_checkpoint=True)
    cfg["megatron"].update(micro_batch_size=2, global_batch_size=16)  # 4 data-parallel ranks, 2 prompts x 8 each step
    return cfg


def _node(root: Path, rank: int, model: Path, cfg: dict) -> Path:
    folder = root / f"node{rank}"
    (folder / "tmp").mkdir(parents=True)
    shutil.copytree(model, folder / "model", copy_function=shutil.copyfile)  # fresh modification times
    stamp = time.time() - 1000 * (rank + 1)  # and each node's its own
    for path in (folder / "model").iterdir():
        os.utime(path, (stamp, stamp))
    (folder / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def _launch(nodes: list[Path], port: int, per_node: int = 2) -> list[subprocess.Popen]:
    procs = []
    for rank, folder in enumerate(nodes):
        env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "400",
               "HF_HOME": str(folder / "hf_home"), "TMPDIR": str(folder / "tmp")}
        log = (folder / f"launch_{len(list(folder.glob('launch_*.log')))}.log").open("w")
        procs.append(subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1",
             "--master_port", str(port), "-m", "oumi", "train", "-c", "cfg.yaml"],
            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], nodes: list[Path], timeout: float = 900) -> str:
    """Both agents' exit; their newest logs, node 0's first."""
    deadline = time.time() + timeout
    for p in procs:
        p.wait(timeout=max(deadline - time.time(), 1))
    return "".join(sorted(n.glob("launch_*.log"))[-1].read_text() for n in nodes)


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line)}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_two_nodes_on_one_host_convert_once_resume_and_match_one_node(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    shared = tmp_path / "shared_run"
    nodes = [_node(tmp_path, r, tiny_model_dir, _config(str(shared))) for r in (0, 1)]
    first = _launch(nodes, free_port())
    ckpt = shared / "checkpoints" / "step_000002" / "trainer_state.json"
    deadline = time.time() + 900
    while not ckpt.is_file() and time.time() < deadline and all(p.poll() is None for p in first):
        time.sleep(0.1)
    for p in first:  # killed mid-run, both nodes
        os.killpg(p.pid, signal.SIGKILL)
    text = _wait(first, nodes)
    assert ckpt.is_file(), text[-4000:]
    assert not (shared / "hf_model").exists(), "the run finished before it was killed"
    assert text.count("to a Megatron-Core checkpoint in") == 1, text[-4000:]  # converted once, by rank 0's decision
    converted = json.loads((shared / "megatron_checkpoint" / "oumi_megatron.json").read_text())
    node0_times = sorted(int(p.stat().st_mtime_ns) for p in (nodes[0] / "model").iterdir() if p.suffix == ".safetensors")
    assert [w[2] for w in converted["weight_files"]] == node0_times  # rank 0's view of the source

    resumed = _launch(nodes, free_port())
    text = _wait(resumed, nodes)
    assert all(p.returncode == 0 for p in resumed), text[-6000:]
    assert "Reusing the converted checkpoint" in text and "Re-converting" not in text and "Resumed from" in text, text[-4000:]

    reference = tmp_path / "one_node"
    cfg = _config(str(reference / "run"))
    cfg["model"]["model_name"] = str(tiny_model_dir)
    (tmp_path / "one_node.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli([TORCHRUN, "--nproc_per_node", "4", "--master-port", str(free_port()), "-m", "oumi", "train", "-c",
                    str(tmp_path / "one_node.yaml")], timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    got, want = _metrics(shared), _metrics(reference / "run")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert (got[step]["reward/mean"], got[step]["loss"]) == (want[step]["reward/mean"], want[step]["loss"]), step
    # the network preflight (engine/parallel/network.py) ran before conversion and measured across the two "nodes";
    # its numbers are in the first step each process logged (step 1: the first run's)
    assert "network preflight: 2 node(s), gloo over TCP" in text, text[-4000:]
    assert got[1]["preflight/nodes"] == 2.0 and got[1]["preflight/inter_node_busbw_gbps"] > 0, got[1]
    assert got[1]["preflight/intra_node_busbw_gbps"] > 0 and got[1]["preflight/sockets"] == 1.0
    assert want[1]["preflight/nodes"] == 1.0 and "preflight/inter_node_busbw_gbps" not in want[1]
    w, ref = _weights(shared / "hf_model"), _weights(reference / "run" / "hf_model")
    assert set(w) == set(ref) and all(torch.equal(w[k], ref[k]) for k in ref)


def test_node_local_output_dirs_are_refused_before_conversion(tmp_path: Path, tiny_model_dir: Path) -> None:
    nodes = [_node(tmp_path, r, tiny_model_dir, _config("run_local")) for r in (0, 1)]  # relative: each node's own
    procs = _launch(nodes, free_port(), per_node=1)  # one rank per node is enough to disagree (and half the start-up)
    text = _wait(procs, nodes)
    assert all(p.returncode != 0 for p in procs), text[-4000:]
    assert "training.output_dir: run_local is not one folder every rank shares: rank 1" in text, text[-4000:]
    assert "so every node must see the same folder: set training.output_dir to a path on a" in text
    assert not any((n / "run_local" / "megatron_checkpoint").exists() for n in nodes)
