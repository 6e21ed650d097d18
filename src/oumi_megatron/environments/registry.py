"""The environments a config selects by name (``grpo.environment``): the built-in ``calculator``,
``calculator_inline``, ``python`` and ``python_tests`` among them.

Your own: ``@register_environment("my_env")`` on a class with environments/base.py's ``Environment`` interface (or a
factory returning one) in a module named in ``grpo.plugins``; validation checks the name against this live table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oumi_megatron.environments.base import Environment
from oumi_megatron.environments.calculator import CalculatorEnvironment, InlineCalculatorEnvironment
from oumi_megatron.environments.python import PythonEnvironment, PythonTestsEnvironment
from oumi_megatron.environments.rendering import TemplateCannotRender, check_renders
from oumi_megatron.environments.runner import EnvironmentRunner, observation_char_cap
from oumi_megatron.errors import UserInputError
from oumi_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.data import DatasetHead

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


def check_environment_settings(config: MegatronTrainingConfig, found: Findings) -> None:
    """``grpo.environment`` (the live registry, after ``grpo.plugins``) and its limits; what its episodes do not run
    under (the rollout mode says)."""
    g = config.grpo
    if g.environment is None:
        return
    if g.environment not in ENVIRONMENTS:
        found.add("grpo.environment", ENVIRONMENTS.unknown_message(g.environment) + " Or leave it unset (single-turn).")
    for name in ("max_turns", "max_observation_tokens"):
        value = getattr(g, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            found.add(f"grpo.{name}", f"must be an integer >= 1, got {value!r}."
                                      + (" Typical: 2-8 turns (1: one tool-free answer)." if name == "max_turns" else " Typical: 256."))
    turn = g.max_turn_tokens
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or not 0 < turn <= g.max_completion_length):
        found.add("grpo.max_turn_tokens", f"must be an integer in [1, grpo.max_completion_length = {g.max_completion_length}] "
                                          f"or null (a turn may use the whole budget), got {turn!r}.")
    timeout = g.environment_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        found.add("grpo.environment_timeout_s", f"must be > 0 seconds, got {timeout!r}. Typical: 60.")
    workers = g.environment_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        found.add("grpo.environment_workers", f"must be an integer >= 0 (0: each turn answered in line; N: on N threads "
                                              f"in the background), got {workers!r}.")


def check_environment_data(config: MegatronTrainingConfig, heads: list[DatasetHead], found: Findings) -> None:
    """``grpo.environment``'s needs of the data (``oumi-megatron validate``): an episode starts from each first row of
    ``heads``, and the model's chat template renders the environment's observations (where the tokenizer can be read
    here; training checks it in any case: ``check_environment``)."""
    g = config.grpo
    if g.environment is None or g.environment not in ENVIRONMENTS:
        return
    environment = build_environment(g.environment)
    for head in heads:
        for index, row in enumerate(head.rows):
            try:
                environment.start(row)
            except Exception as e:  # noqa: BLE001 - the environment's own failure on the user's row
                missing = f" (the rows have no {e} column: return it from the dataset's transform)" if isinstance(e, KeyError) else ""
                found.add("grpo.environment", f"{g.environment!r} cannot start an episode from row {index} of {head.where} "
                                              f"({head.name}): {type(e).__name__}: {e}{missing}.")
                break
    try:
        from oumi.builders import build_tokenizer

        tokenizer = build_tokenizer(config.model)
    except Exception as e:  # noqa: BLE001 - offline, gated: this check waits for training
        found.warn(f"grpo.environment: whether the chat template of {config.model.model_name} renders {g.environment!r}'s "
                   f"observations was not checked: its tokenizer cannot be read here ({type(e).__name__}); training checks it.")
        return
    try:
        check_environment(g, tokenizer)
    except UserInputError as e:
        found.add("grpo.environment", str(e).removeprefix("grpo.environment: "))


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
