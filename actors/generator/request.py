"""What a generator is asked to sample: the one request the controller, the router and every generator pass on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from actors.tasks import Problem
from actors.weights.record import WeightVersion


@dataclass(frozen=True)
class SampleRequest:
    """``group_size`` samples of each problem, sampled with ``weights``. ``seeds`` (one per problem) fix each
    problem's sampling, whichever generator serves it, so a request sampled again (a retry, a resumed run) gives
    the same samples; ``greedy``: each problem's argmax continuation instead (the evaluation's); ``hints`` (one per
    problem, or None): each read after its question as a self-hinting teacher reads its hint
    (``actors/models/chat.py``), so the policy samples as its hinted self (the gap check's)."""

    problems: list[Problem]
    group_size: int
    weights: WeightVersion
    seeds: list[int]
    greedy: bool = False
    hints: list[str | None] | None = None

    def __post_init__(self) -> None:
        if len(self.seeds) != len(self.problems) or (self.hints is not None and len(self.hints) != len(self.problems)):
            raise ValueError(
                f"a sample request of {len(self.problems)} problems needs a seed (and a hint, when any) for each: "
                f"got {len(self.seeds)} seeds" + ("" if self.hints is None else f" and {len(self.hints)} hints")
            )

    def part(self, share: slice) -> SampleRequest:
        """The request for the problems of ``share`` (one generator's, as the router splits a request)."""
        hints = None if self.hints is None else self.hints[share]
        return replace(self, problems=self.problems[share], seeds=self.seeds[share], hints=hints)
