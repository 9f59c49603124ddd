"""Teacher bindings: each is one file implementing ``Binding`` and one line in the registry."""

from __future__ import annotations

from typing import Protocol

from actors.tasks import Problem


class Binding(Protocol):
    def trace(self, problems: list[Problem]) -> list[str]:
        """A teacher's completion for each problem."""
