"""The Rewarder's config: the user reward functions, checked without running their modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from actors import registry


@dataclass(frozen=True)
class RewarderConfig:
    """``actors.rewarder``: the task's reward plus the user's ``functions``, computed

    - ``placement: in_generator``: inside each generator, on what it writes, in the same call
      (no actor of its own, one actor call per step fewer);
    - ``placement: own_mesh`` (the default): by a Rewarder actor on ``mesh``.
    """

    mesh: str | None = None
    functions: tuple[str, ...] = ()  # "package.module:function" each; loaded in the Rewarder
    placement: Literal["in_generator", "own_mesh"] | None = None

    def __post_init__(self) -> None:
        for path in self.functions:
            if not registry.is_import_path(path):
                raise ValueError(f"reward function {path!r} must be an import path 'package.module:function'")
            registry.resolve("reward", path)
