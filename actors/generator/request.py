"""What a generator is asked: the requests the controller, the router and every generator pass on, one type each."""

from __future__ import annotations

from dataclasses import dataclass, replace

from actors.agents.task import AgentSpec
from actors.environments.openenv_task import EpisodeSpec
from actors.tasks import Problem
from actors.weights.record import WeightVersion


@dataclass(frozen=True)
class _Prompts:
    """``group_size`` rows of each problem, with ``weights``; ``seeds`` (one per problem) fix each problem's
    sampling, whichever generator serves it, so a request sent again (a retry, a resumed run) gives the same rows."""

    problems: list[Problem]
    group_size: int
    weights: WeightVersion
    seeds: list[int]

    def __post_init__(self) -> None:
        if len(self.seeds) != len(self.problems):
            raise ValueError(
                f"a request of {len(self.problems)} problems needs a seed for each: got {len(self.seeds)} seeds"
            )

    def part(self, share: slice):
        """The request for the problems of ``share`` (one generator's, as the router splits a request)."""
        return replace(self, problems=self.problems[share], seeds=self.seeds[share])


@dataclass(frozen=True)
class SampleRequest(_Prompts):
    """Samples of each problem, sampled with exactly ``weights``. ``greedy``: each problem's argmax continuation
    instead (the evaluation's); ``hints`` (one per problem, or None): each read after its question as a
    self-hinting teacher reads its hint (``actors/models/chat.py``), so the policy samples as its hinted self (the
    gap check's)."""

    greedy: bool = False
    hints: list[str | None] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hints is not None and len(self.hints) != len(self.problems):
            raise ValueError(
                f"a sample request of {len(self.problems)} problems needs a hint for each, when any: "
                f"got {len(self.hints)} hints"
            )

    def part(self, share: slice) -> SampleRequest:
        hints = None if self.hints is None else self.hints[share]
        return replace(super().part(share), hints=hints)


@dataclass(frozen=True)
class PlayRequest(_Prompts):
    """Episodes of each problem, played as ``spec`` says (against an environment, or by the agent), each turn with
    the newest weights the generator holds (``weights`` or newer)."""

    spec: EpisodeSpec | AgentSpec

    def shared_by(self, players: int) -> PlayRequest:
        """This request for one of ``players`` generators: each holds its share of an environment's sessions."""
        return replace(self, spec=self.spec.shared_by(players))
