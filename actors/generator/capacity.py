"""What a generator reports it plays at once, so the controller starts no more work than it can run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    """How many episodes one generator process plays at once (``episodes``), and what bounds them (``bound``: its
    agent host's places, or its share of the environment's sessions). An episode holds no engine slot while its
    agent or environment works, so the engine's slots bound the turns sampled at once, not the episodes."""

    episodes: int
    bound: str

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"a generator plays at least one episode at once; its {self.bound} are {self.episodes}")
