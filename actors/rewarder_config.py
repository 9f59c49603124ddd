"""The Rewarder's config: the user reward functions, checked without running their modules."""

from __future__ import annotations

from dataclasses import dataclass

from actors import registry


@dataclass(frozen=True)
class RewarderConfig:
    mesh: str
    functions: tuple[str, ...] = ()  # "package.module:function" each; loaded in the Rewarder

    def __post_init__(self) -> None:
        for path in self.functions:
            if not registry.is_import_path(path):
                raise ValueError(f"reward function {path!r} must be an import path 'package.module:function'")
            registry.resolve("reward", path)
