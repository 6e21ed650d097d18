"""The environments a config selects by name (``grpo.environment``), the built-in ``calculator`` among them.

Your own: ``@register_environment("my_env")`` on a class with environments/base.py's ``Environment`` interface (or a
factory returning one) in a module named in ``grpo.plugins``; validation checks the name against this live table.
"""

from __future__ import annotations

from collections.abc import Callable

from oumi_megatron.environments.base import Environment
from oumi_megatron.environments.calculator import CalculatorEnvironment
from oumi_megatron.utils.registry import Registry

EnvironmentFactory = Callable[[], Environment]
"""Builds a fresh environment for a run (a class is one)."""

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment", "grpo.environment", "your own: @register_environment in a module in grpo.plugins, see environments/registry.py")


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    return ENVIRONMENTS.register(name)


def build_environment(name: str) -> Environment:
    """A fresh environment registered as ``name``; the error names the field and what is registered."""
    return ENVIRONMENTS.get(name)()


ENVIRONMENTS.add("calculator", CalculatorEnvironment)
