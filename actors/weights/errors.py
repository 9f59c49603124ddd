"""The weight store's errors: every refusal a follower or publisher can raise is one of these."""


class WeightSyncError(RuntimeError):
    """The weight store cannot serve the request."""


class StaleWeightsError(WeightSyncError):
    """The slot does not hold the requested version (overwritten or never published)."""


class TornWeightsError(WeightSyncError):
    """The bytes or the layout do not match the version's checksum, or the slot changed while in use."""
