"""Contiguous shares of a list, each a slice of the caller's own: a step's prompts among the generator requests
that carry them (``split_evenly``, by count), a step's rows among a trainer's ranks (``token_shares``, by tokens) and
a rank's rows in micro-batches (``micro_batches``, by rows and tokens). Every rank computes every rank's share from
the same batch, so they agree without a message. Imports nothing, so the controller's side reads it without loading
torch.
"""

from __future__ import annotations

import bisect
import itertools


def split_evenly(count: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(count)`` once; the first ``count % parts``
    are one larger than the rest (some are empty when ``count < parts``)."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def token_shares(tokens: list[int], parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(len(tokens))`` once, each ending at the row boundary nearest to
    an even share of the rows' ``tokens``: the partition of a step's rows among a trainer's ranks, whose work follows
    their tokens, not their count (some are empty when there are fewer rows than parts)."""
    before = list(itertools.accumulate(tokens, initial=0))  # the tokens of the rows before each boundary
    bounds = [0]
    for part in range(1, parts):
        target = before[-1] * part / parts
        after = bisect.bisect_left(before, target, lo=bounds[-1])
        nearest = min((b for b in (after - 1, after) if bounds[-1] <= b < len(before)),
                      key=lambda b: abs(before[b] - target))
        bounds.append(nearest)
    bounds.append(len(tokens))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batches(tokens: list[int], share: slice, rows: int, budget: int) -> list[slice]:
    """``share`` of a batch's rows (``tokens``: each row's real tokens) in consecutive micro-batches of at most
    ``rows`` rows and ``budget`` tokens, each as full as the next row allows; a row over ``budget`` is one alone.
    Consecutive, so a group's rows, which share their prompt, stay together where they fit."""
    parts: list[slice] = []
    start, held = share.start, 0
    for row in range(share.start, share.stop):
        if row > start and (row - start >= rows or held + tokens[row] > budget):
            parts.append(slice(start, row))
            start, held = row, 0
        held += tokens[row]
    if share.stop > start:
        parts.append(slice(start, share.stop))
    return parts
