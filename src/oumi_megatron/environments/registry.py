"""The environments a config selects by name (``grpo.environment``): the built-in ``calculator``,
``calculator_inline``, ``python`` and ``python_tests`` among them.

Your own: ``@register_environment("my_env")`` on a class with environments/base.py's ``Environment`` interface (or a
factory returning one) in a module named in ``grpo.plugins``; validation checks the name against this live table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oumi_megatron.environments.base import Environment
from oumi_megatron.environments.calculator import CalculatorEnvironment, InlineCalculatorEnvironment
from oumi_megatron.environments.python import PythonEnvironment, PythonTestsEnvironment
from oumi_megatron.environments.rendering import TemplateCannotRender, check_renders
from oumi_megatron.environments.runner import EnvironmentRunner, observation_char_cap
from oumi_megatron.errors import UserInputError
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


def check_environment(grpo: Any, tokenizer: Any) -> None:
    """Before any heavy work: ``grpo.environment`` is registered and the tokenizer's chat template renders its
    observations (the roles in its ``observation_roles``, default ``("tool",)``); ``UserInputError`` naming the field
    and the fix otherwise."""
    if grpo.environment is None:
        return
    if grpo.environment not in ENVIRONMENTS:
        raise UserInputError(f"grpo.environment: {ENVIRONMENTS.unknown_message(grpo.environment)}")
    roles = getattr(ENVIRONMENTS.get(grpo.environment), "observation_roles", ("tool",))
    try:
        for role in roles:
            check_renders(tokenizer, role)
    except TemplateCannotRender as e:
        raise UserInputError(
            f"grpo.environment: {grpo.environment!r} answers with {', '.join(map(repr, roles))} messages, but {e}. "
            "Use a model whose chat template renders them (ChatML ones render any role: Qwen2.5, SmolLM2-Instruct), "
            "or set model.chat_template to such a template.") from e


def environment_runner(grpo: Any, group: Any = None, ranks: list[int] | None = None) -> EnvironmentRunner | None:
    """``grpo.environment``'s runner for this rank's model replica (``group``/``ranks``: the reward scorer's replica
    group); None without an environment."""
    if grpo.environment is None:
        return None
    return EnvironmentRunner(build_environment(grpo.environment), grpo.environment_timeout_s, group, ranks,
                             workers=grpo.environment_workers,
                             max_observation_chars=observation_char_cap(grpo.max_observation_tokens))


ENVIRONMENTS.add("calculator", CalculatorEnvironment)
ENVIRONMENTS.add("calculator_inline", InlineCalculatorEnvironment)
ENVIRONMENTS.add("python", PythonEnvironment)
ENVIRONMENTS.add("python_tests", PythonTestsEnvironment)
