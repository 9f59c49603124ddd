"""The TeacherPool actor: named teacher bindings behind one endpoint.

Bindings are looked up by name in the registry and built when the pool starts; the
controller asks a binding by the name the topology gave it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monarch.actor import Actor, endpoint

from actors import registry
from actors.tasks import Problem


@dataclass(frozen=True)
class BindingConfig:
    kind: str

    def __post_init__(self) -> None:
        registry.load("teacher", self.kind)


@dataclass(frozen=True)
class TeachersConfig:
    mesh: str
    bindings: dict[str, BindingConfig] = field(default_factory=dict)


class TeacherPool(Actor):
    def __init__(self, cfg: TeachersConfig):
        self.bindings = {name: registry.load("teacher", b.kind)() for name, b in cfg.bindings.items()}

    @endpoint
    def trace(self, teacher: str, problems: list[Problem]) -> list[str]:
        if teacher not in self.bindings:
            raise KeyError(f"no teacher bound as {teacher!r}; bound: {sorted(self.bindings)}")
        return self.bindings[teacher].trace(problems)
