"""The launch recipes in configs/launch/ (README.md): every Oumi job config loads through Oumi's own ``JobConfig``, and
the training config its run command names validates for the job's world size (nodes x GPUs per node), with the
command's overrides; the same for the plain sbatch script. The Slurm jobs' scripts as Oumi's launcher writes them
start one launcher per node and carry the placeholders a user fills in; the README's `oumi launch up` line is complete
for Oumi's Slurm launcher. (The two-node job itself runs in tests/test_two_nodes.py, on a stand-in Slurm.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from oumi_megatron.validation import validate_config

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "configs" / "launch"
SHAPES = {"train_70b_grpo.yaml": "llama-3.1-70b-instruct", "train_70b_grpo_lora.yaml": "llama-3.1-70b-instruct"}


def _train_command(text: str) -> tuple[str, list[str]]:
    """(the training config, its dotted overrides as Oumi's dotlist) of the `oumi ... train -c CFG --a.b v` line."""
    line = next(x for x in text.splitlines() if re.search(r"\boumi\b.* train -c ", x))
    words = shlex.split(line.split(" train ", 1)[1])
    config, rest = words[1], words[2:]
    overrides = [f"{rest[i][2:]}={rest[i + 1]}" for i in range(0, len(rest), 2)]
    return config, overrides


def _validates(config: str, overrides: list[str], nodes: int, per_node: int) -> None:
    from oumi.core.configs import TrainingConfig

    cfg = TrainingConfig.from_yaml_and_arg_list(str(REPO / config), overrides)
    assert cfg.training.output_dir == "$OUTPUT_DIR"  # the job's shared folder, from its environment
    cfg.training.output_dir = "/tmp/oumi_megatron_launch_check"  # a writable stand-in (validation checks it is)
    shape = REPO / "configs" / "model_shapes" / SHAPES[Path(config).name] / "config.json"
    report = validate_config(cfg, world_size=nodes * per_node, gpus_per_node=per_node, model_config_path=str(shape),
                             check_bridge=False)
    assert report.ok, report.format_problems()


@pytest.mark.parametrize("job", sorted(p.name for p in LAUNCH.glob("*_job.yaml")))
def test_oumi_job_configs_load_and_their_run_command_validates(job: str) -> None:
    from oumi.core.configs import JobConfig

    config = JobConfig.from_yaml(LAUNCH / job)
    assert config.num_nodes >= 1 and config.resources.accelerators and config.run
    per_node = int(str(config.resources.accelerators).split(":")[1])
    train, overrides = _train_command(config.run)
    assert "oumi distributed torchrun" in config.run  # the launcher's rendezvous: one torchrun per node
    _validates(train, overrides, config.num_nodes, per_node)


def test_the_sbatch_script_validates_for_its_nodes() -> None:
    text = (LAUNCH / "sbatch_llama70b.sh").read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))  # type: ignore[union-attr]
    per_node = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))  # type: ignore[union-attr]
    assert "srun" in text and "#SBATCH --ntasks-per-node=1" in text  # one torchrun per node
    train, overrides = _train_command(text)
    _validates(train, overrides, nodes, per_node)


def test_the_shipped_job_configs_cover_slurm_and_skypilot() -> None:
    from oumi.core.configs import JobConfig

    clouds = {JobConfig.from_yaml(p).resources.cloud for p in LAUNCH.glob("*_job.yaml")}
    assert {"slurm", "gcp"} <= clouds, clouds


SLURM_JOBS = sorted(p.name for p in LAUNCH.glob("*_slurm_job.yaml"))


@pytest.mark.parametrize("job", SLURM_JOBS)
def test_slurm_job_scripts_start_one_launcher_per_node_and_reuse_one_venv(job: str) -> None:
    """The script Oumi's launcher writes (its own builder): sbatch reads the account, partition and one task per node
    from its top; the run starts `oumi distributed torchrun` under `srun --ntasks-per-node=1` (Slurm runs the script on
    the first node only); setup reuses the venv on the shared filesystem."""
    from oumi.core.configs import JobConfig
    from oumi.launcher.clusters.slurm_cluster import _create_job_script

    from slurm_standin import parse_options, script_directives

    config = JobConfig.from_yaml(LAUNCH / job)
    script = _create_job_script(config)
    directives, _ = parse_options("sbatch", script_directives(script))
    assert directives["account"] == "<account>" and directives["partition"] == "<partition>", directives
    assert directives["ntasks-per-node"] == "1", directives
    launch = next(line for line in script.splitlines() if line.strip().startswith("srun "))
    assert "--ntasks-per-node=1" in launch and launch.rstrip().endswith("\\"), launch  # continued by the launcher
    assert script.index(launch) < script.index("oumi distributed torchrun")
    assert {"OUMI_MEGATRON_VENV", "OUTPUT_DIR", "HF_HOME", "DO_NOT_TRACK"} <= set(config.envs), config.envs
    assert 'if [ -x "$OUMI_MEGATRON_VENV/bin/oumi" ]' in script and 'source "$OUMI_MEGATRON_VENV/bin/activate"' in script


def test_the_readme_launch_line_is_complete_for_oumi_s_slurm_launcher() -> None:
    """README.md's `oumi launch up` line: a Slurm job needs --cluster user@host and --user (the same user); the README
    says what OUMI_SLURM_CONNECTIONS holds."""
    import shlex

    from oumi.core.configs import JobConfig
    from oumi.launcher.clusters.slurm_cluster import SlurmCluster, _validate_job_config

    readme = (REPO / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.strip().startswith("oumi launch up -c configs/launch/llama70b_slurm_job"))
    words = shlex.split(line.split("#")[0])
    args = dict(zip(words[3::2], words[4::2]))
    assert set(args) == {"-c", "--cluster", "--user"}, words
    config = JobConfig.from_yaml_and_arg_list(str(REPO / args["-c"]), [f"user={args['--user']}"])
    _validate_job_config(config)  # Oumi's own check: "User must be provided for Slurm jobs." without --user
    assert SlurmCluster.parse_cluster_name(args["--cluster"]).user == config.user
    assert re.search(r"OUMI_SLURM_CONNECTIONS=\S+@\S+", readme), "the README says what OUMI_SLURM_CONNECTIONS holds"


@pytest.mark.parametrize("script", sorted(str(p.relative_to(REPO)) for p in [*(REPO / "configs" / "launch").glob("*.sh"),
                                                                            *(REPO / "scripts").glob("*.sh")]))
def test_shipped_shell_scripts_parse(script: str) -> None:
    """``bash -n``: every shipped script at least parses (the Ray recipe did not: an apostrophe inside ${2:?...})."""
    import subprocess

    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_ray_recipe_starts_an_authenticated_cluster_on_one_interface_and_stops_it() -> None:
    """Whoever reaches a Ray cluster runs code on its nodes: the recipe turns Ray's token authentication on, makes the
    token on the head, binds each node to RAY_NODE_IP (the dashboard to the loopback), and has a `down` (ray stop)."""
    text = (REPO / "configs" / "launch" / "ray_fleet_up.sh").read_text()
    code = [line.split("#")[0] for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert "export RAY_AUTH_MODE=token" in code
    assert any("ray get-auth-token --generate" in line for line in code)
    starts = [line for line in code if "ray start" in line]
    assert len(starts) == 2 and all('--node-ip-address="$node_ip"' in line for line in starts), starts
    assert any("--dashboard-host=127.0.0.1" in line for line in starts)
    assert any(line.strip() == "ray stop" for line in code)
