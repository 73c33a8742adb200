"""An immutable name -> policy table, so a policy is chosen by a config string.

Immutable on purpose: no module-level mutable state, and a typo in the config fails at
startup with the list of what exists instead of falling back to some default.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Generic, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to policy classes for one kind of policy (its `kind` names it in errors)."""

    def __init__(self, kind: str, entries: Mapping[str, T]) -> None:
        self.kind = kind
        self._entries = MappingProxyType(dict(entries))

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))
