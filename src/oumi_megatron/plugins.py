"""``grpo.plugins``: your Python modules, imported before anything reads a registry.

A plugin registers what a config then selects by name: GRPO variants (``@register_policy_loss``,
``@register_advantage_estimator``, grpo/registry.py) and Oumi datasets and reward functions (Oumi's
``@register``); the CPU demo's task (oumi_megatron/examples/demo_task.py) is one, named in configs/tiny_cpu_grpo.yaml.
Validation, data loading and the trainer each import them first (idempotent: Python imports a module once).
"""

from __future__ import annotations

import importlib


def load_plugins(modules: list[str] | None) -> None:
    """Import the modules named in ``grpo.plugins`` (their decorators register their functions)."""
    for module in modules or []:
        importlib.import_module(module)
