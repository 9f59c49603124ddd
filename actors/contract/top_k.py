"""A teacher's top-k at a completion's tokens: what a distill teacher answers and a trajectory carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class TopK:
    """A teacher's top-k at each completion position, in student ids: ``[T, K]`` each.

    Every row has exactly K distinct ids; where the teacher has fewer than K tokens the
    student knows, the rest are unused ids with logprob ``-inf`` (probability 0), which
    keeps the divergence over ``top-k ∪ tail`` exact (for any K distinct ids: the tail
    holds the rest). A row holds its position's completion token (the one the student
    sampled) in place of the least likely of the top K wherever the teacher scored it
    (``top_k_of``: always; an API's top logprobs: where they include it), since the
    sampled-token divergence needs its exact logprob; a row without it (or with it at
    ``-inf``, a filler) is left out of that divergence.
    """

    ids: np.ndarray  # int64
    logprobs: np.ndarray  # float32
