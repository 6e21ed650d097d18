"""The launch recipes in configs/launch/ (README.md): every Oumi job config loads through Oumi's own ``JobConfig``, and
the training config its run command names validates for the job's world size (nodes x GPUs per node), with the
command's overrides; the same for the plain sbatch script."""

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
