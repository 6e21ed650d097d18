"""``Problem``: one thing wrong with a config, named by its field, with the fix in the message; ``Findings``: what the
checks of a config found.

Each feature checks its own fields in its own module (``check_*(config, found)``) and appends to one ``Findings``, so
a user sees every problem at once; validation.py only orders the checks (docs/architecture.md lists who checks what).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted config path (``megatron.tensor_model_parallel_size``) or CLI flag (``--world-size``)."""
    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class Findings:
    """Problems (the config cannot run) and warnings (it runs, perhaps not as meant), in the order the checks found them."""

    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, field_name: str, message: str) -> None:
        self.problems.append(Problem(field_name, message))

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def positive(self, field_name: str, value: object, allow_none: bool = False) -> None:
        """``value`` must be a positive integer (or None, where ``allow_none``)."""
        if value is None and allow_none:
            return
        if not isinstance(value, int) or value < 1:
            self.add(field_name, f"must be a positive integer, got {value!r}.")


def choices(values: tuple[str, ...]) -> str:
    """A field's fixed choices as a problem names them: 'a', 'b', 'c'."""
    return ", ".join(repr(c) for c in values)
