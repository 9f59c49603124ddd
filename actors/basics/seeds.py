"""Seeds made from names: a sampling seed is a function of what it seeds (a run's seed, a stream, a place in it),
never of what ran before, so a retried or resumed request draws exactly what the first one did."""

from __future__ import annotations

import hashlib


def seed_of(key: str) -> int:
    """A 63-bit seed of ``key`` (blake2b), the same on every machine and in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
