"""Two nodes simulated on one host: the first run is the Oumi Slurm job configs/launch/llama70b_slurm_job.yaml as a user
submits it, the resumed run two ``torchrun --nnodes 2 --nproc_per_node 2`` agents on 127.0.0.1.

- The first run goes through Oumi's own Slurm launcher (``SlurmCluster.run_job``: its job script, its ``sbatch``
  command, its status and cancel calls), with Slurm replaced by tests/slurm_standin.py (Slurm's commands starting real
  processes with Slurm's variables; two nodes, both this host) and the launcher's ssh hop by this host. The job's
  training config is swapped for the CPU one (2 CPU processes per node) and its placeholders filled in; the rest runs
  as shipped: the script runs once, on the first node, and its ``srun`` must start a launcher on each node; both join,
  convert exactly once (global rank 0 decides) and train until the checkpoint of step 2, when the job is cancelled.
- The resumed run gives each "node" a folder of its own (its working directory, HF cache and TMPDIR, and its own copy
  of the tiny model, with its own modification times, found through the config's relative ``model.model_name``;
  node 0's copy is the one the Slurm job read), one shared ``output_dir``. Rank 0's view of the model decides again
  (the nodes' copies differ in their modification times, which made node 1 re-convert while node 0 went on, a hang);
  it resumes and exports; its metrics and its exported weights equal a one-node 4-rank run's.
- With a node-local ``output_dir`` (a relative path: each node's own folder) every rank stops at start with the
  shared-filesystem error naming training.output_dir, before anything is converted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import slurm_standin
from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.slow
TORCHRUN = str(VENV_BIN / "torchrun")
STEPS = 4  # killed after the checkpoint of step 2, resumed for steps 3 and 4
SLURM_JOB = REPO / "configs" / "launch" / "llama70b_slurm_job.yaml"
JOB_LAUNCH = "oumi distributed torchrun -m oumi train -c configs/train_70b_grpo.yaml"  # the job's line, swapped for CPU


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


def _login_node(home: Path, env: dict[str, str]):  # noqa: ANN202 - Oumi's SlurmClient, imported here
    """Oumi's Slurm client with its ssh hop replaced by this host: the commands it sends to the login node run here, in
    a shell of ``home`` with the stand-in Slurm on PATH, and the working directory is copied as its rsync would copy
    it (the trailing-slash rule, without .gitignore's paths, tests/, docs/ and .git)."""
    import fnmatch

    from oumi.launcher.clients.slurm_client import SlurmClient, SlurmResponse

    class LoginNodeHere(SlurmClient):
        def _refresh_creds(self) -> None:
            return None

        def run_commands(self, commands: list[str]) -> SlurmResponse:
            out = subprocess.run(["bash", "-s"], input="\n".join(commands), cwd=home, env=env, capture_output=True,
                                 text=True, timeout=180)
            return SlurmResponse(stdout=out.stdout, stderr=out.stderr, exit_code=out.returncode)

        def put_recursive(self, source: str, destination: str) -> None:
            dest = Path(destination.replace("~", str(home), 1))
            if not source.endswith("/"):
                dest = dest / Path(source).name
            ignored = [".git", "tests", "docs"]
            if (Path(source) / ".gitignore").is_file():
                ignored += [line.strip().strip("/") for line in (Path(source) / ".gitignore").read_text().splitlines()
                            if line.strip() and not line.startswith("#")]
            shutil.copytree(source, dest, dirs_exist_ok=True,
                            ignore=lambda _, names: [n for n in names if any(fnmatch.fnmatch(n, p) for p in ignored)])

    return LoginNodeHere("user", "localhost", "user@localhost")


def _slurm_job(tmp_path: Path, shared: Path, model: Path):  # noqa: ANN202 - Oumi's JobConfig
    """The shipped job config as a user fills it in (account, partition, the shared venv: this one, the shared folders),
    its training config swapped for the CPU run's (2 processes a node, the tiny model at ``model``)."""
    from oumi.core.configs import JobConfig

    job = JobConfig.from_yaml(SLURM_JOB)
    assert 'if [ -x "$OUMI_MEGATRON_VENV/bin/oumi" ]' in (job.setup or "")  # setup reuses the venv: nothing installed
    cfg = _config(str(shared))
    cfg["model"]["model_name"] = str(model)  # one copy on the "shared filesystem": both nodes read node 0's
    (tmp_path / "slurm_cpu.yaml").write_text(yaml.safe_dump(cfg))
    assert JOB_LAUNCH in job.run, job.run
    job.run = job.run.replace(JOB_LAUNCH, f"oumi distributed torchrun --nproc-per-node=2 -m oumi train -c {tmp_path / 'slurm_cpu.yaml'}")
    for placeholder, value in (("<account>", "rehearsal"), ("<partition>", "cpu")):
        job.run = job.run.replace(placeholder, value)
    job.user, job.working_dir = "user", f"{REPO}/"  # `oumi launch up --user user` from the repository's root
    job.envs.update(OUTPUT_DIR=str(shared), OUMI_MEGATRON_VENV=str(VENV_BIN.parent), HF_HOME=str(tmp_path / "hf_home"))
    return job


def _submit_slurm_job(tmp_path: Path, shared: Path, model: Path) -> tuple[object, str, Path]:
    """(the Oumi cluster, the job id, the stand-in's state folder) of the job submitted through Oumi's launcher."""
    from oumi.launcher.clusters.slurm_cluster import SlurmCluster

    home = tmp_path / "home"
    (home / "oumi_slurm_logs").mkdir(parents=True)  # once per cluster user: Slurm does not make the log's folder
    state = tmp_path / "slurm"
    # the login shell's environment, which sbatch hands to the job (Slurm's --export=ALL); a free rendezvous port
    env = {**os.environ, "HOME": str(home), "COLUMNS": "400", "MASTER_PORT": str(free_port()),
           **slurm_standin.install(tmp_path / "slurm_bin", state, nodes=2)}
    cluster = SlurmCluster("user@localhost", _login_node(home, env))
    status = cluster.run_job(_slurm_job(tmp_path, shared, model))
    assert status.status in ("PENDING", "RUNNING"), status
    return cluster, status.id, state


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
    cluster, job_id, state = _submit_slurm_job(tmp_path, shared, nodes[0] / "model")
    log = Path(slurm_standin.read_job(state, job_id)["output"])

    def job_text() -> str:
        return log.read_text() if log.is_file() else ""

    def running() -> bool:
        return slurm_standin.read_job(state, job_id)["state"] in ("PENDING", "RUNNING")

    started = [f"on node {n} of 2 (Slurm)" for n in (0, 1)]  # each node's launcher, as it starts its 2 CPU ranks
    deadline = time.time() + 240
    while not all(s in job_text() for s in started) and time.time() < deadline and running():
        time.sleep(0.5)
    if not all(s in job_text() for s in started):
        cluster.cancel_job(job_id)
        pytest.fail(f"the job did not start a launcher on every node ({[s in job_text() for s in started]}): Slurm runs "
                    f"the job script once, on the first node; it must srun one launcher per node.\n{job_text()[-4000:]}")
    ckpt = shared / "checkpoints" / "step_000002" / "trainer_state.json"
    deadline = time.time() + 900
    while not ckpt.is_file() and time.time() < deadline and running():
        time.sleep(0.1)
    cancelled = cluster.cancel_job(job_id)  # killed mid-run, both nodes (Oumi's cancel: scancel)
    assert cancelled.status == "CANCELLED", cancelled
    text = job_text()
    assert ckpt.is_file(), text[-4000:]
    assert not (shared / "hf_model").exists(), "the run finished before it was killed"
    job = slurm_standin.read_job(state, job_id)
    assert job["options"]["nodes"] == "2" and job["options"]["account"] == "rehearsal", job["options"]
    assert [step["tasks"] for step in job["steps"]] == [[[0, 0, 0], [1, 0, 1]]]  # one srun: a task on each node
    assert text.count("to a Megatron-Core checkpoint in") == 1, text[-4000:]  # converted once, by rank 0's decision
    converted = json.loads((shared / "megatron_checkpoint" / "oumi_megatron.json").read_text())
    node0_times = sorted(int(p.stat().st_mtime_ns) for p in (nodes[0] / "model").iterdir() if p.suffix == ".safetensors")
    assert [w[2] for w in converted["weight_files"]] == node0_times  # rank 0's view of the source
    steps = _metrics(shared)
    assert sorted(steps)[:2] == [1, 2] and steps[1]["preflight/nodes"] == 2.0, steps  # both nodes trained steps 1-2
    # the long operations said what they did, once (rank 0), in human units
    for line in (f"Writing the converted checkpoint {shared / 'megatron_checkpoint'}: done in ",
                 f"Saving checkpoint step 2 to {shared / 'checkpoints' / 'step_000002'}: done in "):
        assert text.count(line) == 1, (line, text[-4000:])
    assert re.search(r"Saving checkpoint step 2 to \S+: done in [\d.]+ s \([\d.]+ [KMG]iB, [\d.]+ [KMG]iB/s\)", text)

    resumed = _launch(nodes, free_port())
    text = _wait(resumed, nodes)
    assert all(p.returncode == 0 for p in resumed), text[-6000:]
    assert "Reusing the converted checkpoint" in text and "Re-converting" not in text and "Resumed from" in text, text[-4000:]
    assert text.count(f"Loading checkpoint {shared / 'checkpoints' / 'step_000002'}: done in ") == 1, text[-4000:]
    assert text.count(f"Exporting {shared / 'hf_model'}: done in ") == 1, text[-4000:]

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
