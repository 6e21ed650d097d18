"""``Registry``: name -> object tables for everything a config selects by name (pipeline schedules, policy
losses, advantage estimators, rollout backends).

One helper so every seam behaves alike: a name registered twice for different objects is refused, an unknown
name's error names the config field and lists what is registered, and validation checks names against the live
table (so what a ``grpo.plugins`` module registers is accepted like a built-in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator


class Registry[T]:
    """Objects by name for the config field ``field`` (e.g. ``grpo.policy_loss``)."""

    def __init__(self, kind: str, field: str, hint: str = "") -> None:
        self.kind = kind
        """What an entry is, for messages: ``policy loss``."""
        self.field = field
        self.hint = hint
        """How to add your own, appended to the unknown-name message."""
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Registers ``entry`` as ``name``; the same object again is a no-op (a module imported twice)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not entry:
            where = getattr(existing, "__module__", type(existing).__module__)
            raise ValueError(f"a {self.kind} named {name!r} is registered already (from {where}); choose another name")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> None:
        """Forgets ``name`` (tests that register a temporary entry)."""
        self._entries.pop(name, None)

    def unknown_message(self, name: object) -> str:
        """Why ``name`` is refused: the value and every registered name."""
        hint = f" ({self.hint})" if self.hint else ""
        return f"unknown value {name!r}. Registered: {', '.join(repr(n) for n in self.names())}{hint}."

    def get(self, name: str) -> T:
        """The entry named ``name``; ``ValueError`` naming the field and the registered names otherwise."""
        if name not in self._entries:
            raise ValueError(f"{self.field}: {self.unknown_message(name)}")
        return self._entries[name]

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
