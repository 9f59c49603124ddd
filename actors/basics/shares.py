"""How work is shared out: a step's prompts among the generator requests that carry them (``split_evenly``, by
count), a step's rows among a trainer's ranks (``token_shares``, contiguous, by tokens) and a rank's rows in
micro-batches (``micro_batches``, by tokens, balanced). Imports nothing, so the controller's side reads it
without loading torch.
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
        # at least one row for this part and each after it, while there are rows enough
        low, high = min(bounds[-1] + 1, len(tokens)), max(len(tokens) - (parts - part), bounds[-1])
        after = bisect.bisect_left(before, target, lo=bounds[-1])
        nearest = min((min(max(b, low), high) for b in (after - 1, after)), key=lambda b: abs(before[b] - target))
        bounds.append(nearest)
    bounds.append(len(tokens))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batches(tokens: list[int], shared: list[int], budget: int) -> list[list[int]]:
    """Rows (``tokens``: each row's real tokens; ``shared``: how many of them it shares with the row before it, its
    group's prompt) in micro-batches of at most ``budget`` tokens, a prefix that rows of one
    micro-batch share counted once: as few micro-batches as hold them, their tokens as even as placing the longest
    runs first makes them. A run of rows sharing a prefix stays in one micro-batch where it fits, else in as few as it
    must; a row over ``budget`` is a micro-batch alone. Each micro-batch's rows, and the micro-batches by their first
    row, in the rows' order."""
    alone = [[row] for row, held in enumerate(tokens) if held > budget]
    runs = _runs([row for row, held in enumerate(tokens) if held <= budget], shared)
    cost = [tokens[run[0]] + sum(tokens[row] - shared[row] for row in run[1:]) for run in runs]
    longest_first = sorted(range(len(runs)), key=lambda i: -cost[i])
    fewest = max(-(-sum(cost) // budget), 1) if runs else 0
    for count in itertools.count(fewest):
        placed = _place([runs[i] for i in longest_first], tokens, shared, count, budget)
        if placed is not None:
            return sorted(alone + [sorted(members) for members in placed if members])
    raise AssertionError("unreachable: a micro-batch per row always fits")


def _runs(rows: list[int], shared: list[int]) -> list[list[int]]:
    """``rows`` in runs of consecutive rows that share a prefix with the row before them."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and shared[row] and runs[-1][-1] == row - 1:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _place(runs: list[list[int]], tokens: list[int], shared: list[int], count: int, budget: int
           ) -> list[list[int]] | None:
    """``runs`` placed in turn into ``count`` micro-batches, each run as much of it as fits into the least-loaded
    micro-batch that takes its next row, then the rest likewise; None when some row fits none."""
    members: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for run in runs:
        at = 0
        while at < len(run):
            open_to = [b for b in range(count) if loads[b] + tokens[run[at]] <= budget]
            if not open_to:
                return None
            chosen = min(open_to, key=lambda b: loads[b])
            first = True
            while at < len(run):
                row = run[at]
                added = tokens[row] if first else tokens[row] - shared[row]  # the prefix once per micro-batch
                if loads[chosen] + added > budget:
                    break
                members[chosen].append(row)
                loads[chosen] += added
                at, first = at + 1, False
    return members
