"""Contiguous near-equal shares of a count: the one partition rule of a batch's rows among
a trainer's ranks and of a step's prompts among the generator requests that carry them.

Both sides use the same rule so that a share is a slice of the caller's own list: the trainer
slices its batch per rank, the router its prompts per request. Imports nothing, so the
controller's side reads it without loading torch.
"""

from __future__ import annotations


def split_evenly(count: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(count)`` once; the first ``count % parts``
    are one larger than the rest (some are empty when ``count < parts``)."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
