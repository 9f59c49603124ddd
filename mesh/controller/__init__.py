"""The controller and its parts (``controller.py`` draws them)."""

from mesh.controller.admission import StalenessError
from mesh.controller.collected import Collected
from mesh.controller.collection import Collection, EpisodeCollection, RecordedCollection, SampleCollection
from mesh.controller.controller import Controller, RunContext
from mesh.controller.groups import EnvironmentDown
from mesh.controller.services import (
    ReferenceInTrainer,
    ReferenceScoring,
    RemoteReference,
    RemoteRewarder,
    RewardedInGenerators,
    Rewarding,
    Services,
)
from mesh.controller.settings import CollectSettings, LoopSettings

__all__ = [
    "CollectSettings",
    "Collected",
    "Collection",
    "EpisodeCollection",
    "RecordedCollection",
    "SampleCollection",
    "Controller",
    "EnvironmentDown",
    "LoopSettings",
    "ReferenceInTrainer",
    "ReferenceScoring",
    "RemoteReference",
    "RemoteRewarder",
    "RewardedInGenerators",
    "Rewarding",
    "RunContext",
    "Services",
    "StalenessError",
]
