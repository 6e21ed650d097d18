"""The four small patches that let Oumi 0.9 run MEGATRON_GRPO (applied by ``_oumi_hook``).

Each patch is idempotent and leaves Oumi's behaviour unchanged for every config that does not ask
for MEGATRON_GRPO:

1. ``TrainerType`` gains a ``MEGATRON_GRPO`` member.
2. ``TrainingConfig.from_yaml*`` return a ``MegatronTrainingConfig`` (with ``megatron:`` / ``grpo:``)
   for configs that ask for MEGATRON_GRPO; other configs load as stock ``TrainingConfig``.
3. ``oumi.train.train`` hands MEGATRON_GRPO configs to ``oumi_megatron.train``.
4. ``oumi distributed torchrun -c cfg.yaml`` (the design document's form, which stock Oumi passes
   verbatim to torchrun) becomes ``torchrun ... -m oumi train -c cfg.yaml`` for MEGATRON_GRPO configs,
   and runs on CPU-only machines with gloo (one machine, or each node of a Slurm job).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from oumi_megatron.config.trainer_type import MEGATRON_GRPO, add_megatron_grpo

_PATCHED = "__oumi_megatron_patched__"


def _already_patched(obj: Any) -> bool:
    return bool(getattr(obj, _PATCHED, False))


# --------------------------------------------------------------------------------------------------
# 1. TrainerType.MEGATRON_GRPO
# --------------------------------------------------------------------------------------------------
def patch_trainer_type(module: types.ModuleType) -> None:
    add_megatron_grpo(module.TrainerType)


def _is_megatron_trainer_type(value: Any) -> bool:
    return str(value).strip().split(".")[-1].upper() == MEGATRON_GRPO


def _raw_yaml(config_path: str | os.PathLike | None) -> dict:
    if config_path is None or not Path(config_path).is_file():
        return {}
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except yaml.YAMLError:
        return {}  # Oumi reports the YAML error itself.
    return raw if isinstance(raw, dict) else {}


def config_requests_megatron(config_path: str | os.PathLike | None, arg_list: list[str]) -> bool:
    """True if the YAML or the CLI overrides ask for MEGATRON_GRPO or carry megatron:/grpo: sections."""
    for arg in arg_list or []:
        key, _, value = arg.lstrip("-").partition("=")
        if key.split(".")[0] in ("megatron", "grpo"):
            return True
        if key == "training.trainer_type" and _is_megatron_trainer_type(value):
            return True
    raw = _raw_yaml(config_path)
    if "megatron" in raw or "grpo" in raw:
        return True
    training = raw.get("training")
    return isinstance(training, dict) and _is_megatron_trainer_type(training.get("trainer_type"))


_REWARD_KEYS = ("reward_functions", "reward_function_kwargs")


@contextlib.contextmanager
def _without_training_rewards(config_path: Any, arg_list: list[str]) -> Iterator[tuple[Any, list[str], dict[str, Any]]]:
    """Oumi's TrainingParams rejects training.reward_functions for trainer types other than TRL/VERL while
    the config object is being built, so they are taken out of the YAML and the overrides first (a
    temporary copy of the YAML; yields its path, the remaining overrides and what was taken out) and
    handed to config/oumi_fields.py, which moves them to grpo.reward_functions."""
    raw = _raw_yaml(config_path)
    raw_training = raw.get("training")
    training: dict[str, Any] = raw_training if isinstance(raw_training, dict) else {}
    taken = {k: training.pop(k) for k in _REWARD_KEYS if k in training}
    rest = []
    for arg in arg_list or []:
        key, sep, value = arg.lstrip("-").partition("=")
        section, _, name = key.partition(".")
        if sep and section == "training" and name in _REWARD_KEYS:
            taken[name] = yaml.safe_load(value)
        else:
            rest.append(arg)
    if not taken:
        yield config_path, list(arg_list or []), taken
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(str(config_path or "config.yaml")).name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        yield (str(path) if config_path is not None else None), rest, taken


def _adopt_oumi_fields(config: Any, config_path: Any, arg_list: list[str], taken: dict[str, Any]) -> Any:
    """Record which fields the YAML / overrides set, then take over Oumi's own fields (reward functions,
    training.grpo, ...) into megatron:/grpo: (see config/oumi_fields.py)."""
    from oumi_megatron.config.oumi_fields import adopt_oumi_fields, explicit_keys

    config.__dict__["_explicit_keys"] = explicit_keys(_raw_yaml(config_path), list(arg_list or []))
    config.__dict__["_training_rewards"] = taken
    adopt_oumi_fields(config)
    return config


def _is_ours(cls: type) -> bool:
    return any(c.__name__ == "MegatronTrainingConfig" for c in cls.__mro__)


def patch_training_config(module: types.ModuleType) -> None:
    training_config_cls = module.TrainingConfig
    current = training_config_cls.__dict__.get("from_yaml_and_arg_list")
    if _already_patched(getattr(current, "__func__", current)):  # a classmethod: the mark is on its function
        return
    orig_from_yaml_and_arg_list = training_config_cls.from_yaml_and_arg_list.__func__
    orig_from_yaml = training_config_cls.from_yaml.__func__

    def _target_cls(cls: type, config_path: Any, arg_list: list[str]) -> type:
        from_stock = cls is training_config_cls and config_requests_megatron(config_path, arg_list)
        if not from_stock and not _is_ours(cls):
            return cls
        from oumi_megatron.config.training_config import MegatronTrainingConfig

        return MegatronTrainingConfig

    @functools.wraps(orig_from_yaml_and_arg_list)
    def from_yaml_and_arg_list(cls: type, config_path: Any, arg_list: list[str], *args: Any, **kwargs: Any) -> Any:
        target = _target_cls(cls, config_path, arg_list)
        if not _is_ours(target):
            return orig_from_yaml_and_arg_list(target, config_path, arg_list, *args, **kwargs)
        with _without_training_rewards(config_path, arg_list) as (path, rest, taken):
            config = orig_from_yaml_and_arg_list(target, path, rest, *args, **kwargs)
        return _adopt_oumi_fields(config, config_path, arg_list, taken)

    @functools.wraps(orig_from_yaml)
    def from_yaml(cls: type, config_path: Any, *args: Any, **kwargs: Any) -> Any:
        target = _target_cls(cls, config_path, [])
        if not _is_ours(target):
            return orig_from_yaml(target, config_path, *args, **kwargs)
        with _without_training_rewards(config_path, []) as (path, _, taken):
            config = orig_from_yaml(target, path, *args, **kwargs)
        return _adopt_oumi_fields(config, config_path, [], taken)

    for fn in (from_yaml_and_arg_list, from_yaml):
        setattr(fn, _PATCHED, True)
    training_config_cls.from_yaml_and_arg_list = classmethod(from_yaml_and_arg_list)
    training_config_cls.from_yaml = classmethod(from_yaml)


# --------------------------------------------------------------------------------------------------
# 3. oumi.train.train
# --------------------------------------------------------------------------------------------------
def patch_train(module: types.ModuleType) -> None:
    orig_train = module.train
    if _already_patched(orig_train):
        return

    @functools.wraps(orig_train)
    def train(config: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_megatron_trainer_type(getattr(config.training.trainer_type, "name", "")):
            from oumi_megatron.train import train_megatron_grpo

            trainer = train_megatron_grpo(config, verbose=kwargs.get("verbose", False))
            return trainer.get_last_eval_metrics()  # Oumi's train() returns metrics or None
        return orig_train(config, *args, **kwargs)

    setattr(train, _PATCHED, True)
    module.train = train  # type: ignore[attr-defined]  # oumi.train's function replaced: ModuleType declares no attributes


# --------------------------------------------------------------------------------------------------
# 4. oumi distributed torchrun -c cfg.yaml
# --------------------------------------------------------------------------------------------------
CONFIG_FLAGS = ("-c", "--config")


def find_config_arg(args: list[str]) -> tuple[int, str] | None:
    """Index and value of ``-c PATH`` / ``--config PATH`` / ``--config=PATH`` in ``args``."""
    for i, arg in enumerate(args):
        if arg in CONFIG_FLAGS and i + 1 < len(args):
            return i, args[i + 1]
        if arg.startswith("--config="):
            return i, arg.split("=", 1)[1]
    return None


def rewrite_torchrun_args(args: list[str]) -> list[str]:
    """Turn the design document's ``[torchrun flags] -c cfg.yaml [overrides]`` into
    ``[torchrun flags] -m oumi train -c cfg.yaml [overrides]``; other forms are returned unchanged."""
    if "-m" in args or any(a.endswith(".py") for a in args):
        return list(args)
    found = find_config_arg(args)
    if found is None:
        return list(args)
    index, _ = found
    return [*args[:index], "-m", "oumi", "train", *args[index:]]


def _nproc_from_args(args: list[str]) -> tuple[int | None, list[str]]:
    """Pops ``--nproc-per-node N`` / ``--nproc_per_node=N`` from torchrun flags."""
    rest: list[str] = []
    nproc: int | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg.split("=", 1)[0]
        if key in ("--nproc-per-node", "--nproc_per_node"):
            value = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            nproc = int(value)
            i += 1 if "=" in arg else 2
            continue
        rest.append(arg)
        i += 1
    return nproc, rest


def _slurm_nodes(module: types.ModuleType, env: dict[str, str]) -> tuple[int, int, str, int]:
    """(nodes, this node's rank, master address, master port) from Slurm's variables, read as Oumi's own Slurm detection
    reads them (``scontrol show hostnames $SLURM_NODELIST``, ``SLURM_NODEID``, ``MASTER_PORT``); Oumi's version also
    counts this node's GPUs and refuses none."""
    import subprocess

    nodes = module._parse_nodes_str(subprocess.run(["scontrol", "show", "hostnames", env["SLURM_NODELIST"]],
                                                   capture_output=True, text=True, check=True, timeout=30).stdout)
    if not nodes:
        raise RuntimeError(f"SLURM_NODELIST={env['SLURM_NODELIST']!r} names no node.")
    node_rank = module._get_optional_int_env_var("SLURM_NODEID", env)
    if node_rank is None:
        if len(nodes) > 1:
            raise ValueError(f"SLURM_NODEID is not set on a job of {len(nodes)} nodes: start one launcher per node with "
                             "`srun --ntasks-per-node=1 oumi distributed torchrun ...`.")
        node_rank = 0
    return len(nodes), node_rank, nodes[0], int(env.get("MASTER_PORT", "8007"))


def patch_distributed_torchrun(module: types.ModuleType) -> None:
    orig_torchrun = module.torchrun
    if _already_patched(orig_torchrun):
        return

    @functools.wraps(orig_torchrun)
    def torchrun(ctx: Any, level: Any = None) -> None:
        found = find_config_arg(list(ctx.args))
        if found is None or not config_requests_megatron(found[1], []):
            return orig_torchrun(ctx, level)  # Not ours: stock behaviour, unchanged.
        ctx.args[:] = rewrite_torchrun_args(list(ctx.args))
        # `torchrun -m oumi` would put the launch folder first on every rank's sys.path, where a file named like a
        # module (oumi.py, torch.py) would run instead: the ranks search it no more than `oumi train` does
        os.environ.setdefault("PYTHONSAFEPATH", "1")

        import torch

        backend = module._detect_backend()
        if torch.cuda.is_available() or backend not in ("local", "slurm"):
            return orig_torchrun(ctx, level)
        # Stock Oumi refuses to start without GPUs (it counts them per node). Megatron-Core runs on CPU with gloo (tests,
        # the demo, CPU Slurm nodes), so start N CPU processes on this node; N from --nproc-per-node, default 1.
        nproc, rest = _nproc_from_args(list(ctx.args))
        nnodes, node_rank, master_addr, master_port = (
            _slurm_nodes(module, dict(os.environ)) if backend == "slurm"
            else (1, 0, os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "8007"))))
        cmds = [
            "torchrun",
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc or 1}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            *rest,
        ]
        where = f" on node {node_rank} of {nnodes} (Slurm)" if backend == "slurm" else ""
        module.logger.info(f"No GPU found: starting {nproc or 1} CPU process(es) with gloo{where}.")
        module._run_subprocess(cmds, rank=node_rank)

    setattr(torchrun, _PATCHED, True)
    module.torchrun = torchrun  # type: ignore[attr-defined]  # Oumi's CLI command replaced: ModuleType declares no attributes
