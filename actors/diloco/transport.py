"""How the replicas of a DiLoCo run average their pseudo-gradients: the contract of a transport.

Each replica's syncer hands its transport the pseudo-gradient of one round (its share of it:
one trainer rank's parameters) and gets back the mean over the replicas that took part.
Two transports implement it: ``torchft`` (a lighthouse, one ``torchft.Manager`` per trainer
rank, ``Manager.allreduce``; ``actors/diloco/torchft.py``) and ``object_store`` (fsspec: each
replica writes its share, reads the others'; ``actors/diloco/object_store.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class RoundResult:
    """What one round of averaging gave this replica."""

    mean: dict[str, Tensor]  # the mean pseudo-gradient over ``members``: the names, shapes and dtypes given
    members: tuple[int, ...]  # the replica ids averaged, sorted (this replica's unless it came too late)
    bytes_sent: int
    bytes_received: int
    seconds: float  # from the call until the mean was ready


class Transport(Protocol):
    def average(self, round: int, delta: dict[str, Tensor]) -> RoundResult:
        """The mean of ``delta`` over the replicas present in ``round`` (rounds count from 1)."""

    def close(self) -> None:
        """Release connections and servers; the transport is not used again."""
