"""The one follower API generators and teachers use, whatever the transport (chosen in ``actors/weights/config.py``).

The record's transport names the slot backend whose receiving end attaches (``transports/``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import Tensor

from actors.weights.errors import StaleWeightsError
from actors.weights.record import WeightVersion
from actors.weights.transports.backend import Receiver, slot_backend


class WeightFollower:
    """Keeps a model on the trainer's published versions (a generator engine, a self-hinting teacher).

    ``hold`` adopts a version unless it is already held; ``check_intact`` must follow
    the work done with it, so that nothing computed with overwritten or unverified
    weights leaves. The record's transport picks the receiving end, so callers never
    know where the trainer runs.
    """

    def __init__(self) -> None:
        self.subscriber: Receiver | None = None
        self.held: WeightVersion | None = None

    def hold(self, weights: WeightVersion, load: Callable[[dict[str, Tensor]], None]) -> float:
        """Adopt ``weights`` through ``load``; the seconds it took (0 when already held).

        A version the receiving end refuses is never handed to ``load``: the model keeps
        the version it held (over ``rdma`` its bytes stay untouched too).
        """
        if self.held == weights:
            return 0.0
        start = time.perf_counter()
        if not self._attached(weights):
            self.close()
            self.subscriber = slot_backend(weights.transport).attach(weights)
        load(self.subscriber.load(weights))
        self.subscriber.start_verification(weights)  # hashes while the caller samples; check_intact waits
        self.held = weights
        return time.perf_counter() - start

    def _attached(self, weights: WeightVersion) -> bool:
        s = self.subscriber
        return s is not None and (s.store, s.transport, s.nbytes) == (weights.store, weights.transport, weights.nbytes)

    def check_intact(self, weights: WeightVersion) -> None:
        """Raise unless the work just done used exactly ``weights``, verified (call after each batch)."""
        if self.subscriber is None:
            raise StaleWeightsError(f"this follower holds no weights yet, not version {weights.version}")
        self.subscriber.check_intact(weights)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None
        self.held = None
