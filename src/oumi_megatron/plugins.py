"""``grpo.plugins``: your Python modules, imported before anything reads a registry.

A plugin registers what a config then selects by name: GRPO variants (``@register_policy_loss``,
``@register_advantage_estimator``, grpo/registry.py) and Oumi datasets and reward functions (Oumi's
``@register``); the CPU demo's task (oumi_megatron/examples/demo_task.py) is one, named in configs/tiny_cpu_grpo.yaml.
Validation, data loading and the trainer each import them first (idempotent: Python imports a module once).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig


def load_plugins(modules: list[str] | None) -> None:
    """Import the modules named in ``grpo.plugins`` (their decorators register their functions)."""
    for module in modules or []:
        importlib.import_module(module)


def check_plugins(config: MegatronTrainingConfig, found: Findings) -> None:
    """``grpo.plugins`` import (validation checks them first: they register what the other checks look up)."""
    for module in config.grpo.plugins or []:
        try:
            load_plugins([module])
        except Exception as e:  # noqa: BLE001 - any failure to import is the user's module to fix
            found.add("grpo.plugins", f"cannot import {module!r} ({type(e).__name__}: {e}). Name an importable module "
                                      "(on PYTHONPATH) that registers your functions.")
