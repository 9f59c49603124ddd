"""The rollout contract: what a step's sampling produces, row by row and group by group.

    Problem ─ generators ─▶ Trajectory (the policy's samples)     ┐
            ─ teachers ──▶ Trajectory (a teacher's trace)         ├─▶ Row ─▶ RolloutGroup ─▶ TrainBatch
      rewarder ─▶ Reward, teacher ─▶ top-k, reference ─▶ logprobs ┘

A ``RolloutGroup`` is one prompt and every row written for it. A row says what it is
(``RowKind``) instead of being known by its position: the policy's own samples, a
warm-start teacher's trace (which joins the group in channel 1) and replayed teacher
traces (channel 3's preference pairs only). Advantages are relative within a group and
pairs never cross one, so membership is the group itself, kept once.

A ``Trajectory`` is tokens after the prompt with a per-token loss mask: in a
multi-turn episode the environment's turns sit between the model's and are context,
never trained on. Everything here is plain data (lists, small arrays), cheap to send
between actors and to save with a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from actors.contract.top_k import TopK
from actors.tasks import Problem


class RowKind(StrEnum):
    SAMPLE = "sample"  # the policy's own sample: channels 1 and 2, and one side of channel 3's pairs
    WARM_START = "warm_start"  # a teacher's trace that joins its prompt's group in channel 1
    REPLAY = "replay"  # a teacher's trace that only enters channel 3's pairs

    @property
    def trains_policy(self) -> bool:
        """In channel 1: its group-relative advantage is trained on."""
        return self is not RowKind.REPLAY


@dataclass(frozen=True)
class Trajectory:
    """The tokens after a prompt: the model's and, in an episode, the environment's in between."""

    prompt_ids: list[int]
    completion_ids: list[int]  # the model's last turn ends with EOS unless the length limit cut it
    logprobs: list[float]  # the sampler's per token (0.0 at the environment's tokens)
    loss_mask: list[bool]  # True at the model's own tokens, the only ones trained on
    text: str  # the model's text without special tokens: what the rewarder reads
    # per token, the policy version that sampled it (an episode's: an agent's goes on across weight updates, even
    # inside a turn); a context token carries its reply's before it. None (a single-turn sample): the row's version
    versions: list[int] | None = None
    # per sampled token, the engine's most likely tokens there and their logprobs, most likely first, when a
    # request asked for them (``ReplyRequest.top_logprobs``); what an agent is answered, never trained on
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def sampled_versions(self) -> list[int]:
        """The versions of the model's own tokens (empty when ``versions`` is None)."""
        return [v for v, mine in zip(self.versions or [], self.loss_mask) if mine]

    def trained_from(self, version: int) -> Trajectory:
        """This trajectory with the model's tokens that a version older than ``version`` sampled kept as context,
        not trained: the age limit, per token. Itself when ``versions`` is None."""
        if self.versions is None:
            return self
        return replace(self, loss_mask=[mine and v >= version for v, mine in zip(self.versions, self.loss_mask)])

    def after_update(self) -> list[bool]:
        """Per token, whether it was sampled after a weight update interrupted its turn: a newer version than the
        one that sampled its reply's first token (all False when ``versions`` is None)."""
        if self.versions is None:
            return [False] * len(self.loss_mask)
        marks, first = [], None
        for version, mine in zip(self.versions, self.loss_mask):
            first = (version if first is None else first) if mine else None
            marks.append(mine and version != first)
        return marks

    def defect(self) -> str | None:
        """Why this row cannot train, or None: no prompt token (nothing would predict its first completion token),
        no token of the model's, or per-token lists of another length than its tokens. The generator checks every
        row it sends; the trainer's packing checks again."""
        tokens = len(self.completion_ids)
        if not self.prompt_ids:
            return "it has no prompt token"
        if not any(self.loss_mask):
            return "it has no token the model sampled"
        lengths = [len(self.logprobs), len(self.loss_mask)] + ([] if self.versions is None else [len(self.versions)])
        if any(length != tokens for length in lengths):
            return f"its per-token lists ({lengths}) do not match its {tokens} tokens"
        return None

    @staticmethod
    def untrainable(rows: list[Trajectory]) -> str | None:
        """Why an episode's rows cannot train (the first row's ``defect``), or None."""
        for number, row in enumerate(rows):
            if (defect := row.defect()) is not None:
                return f"row {number} of the episode cannot train: {defect}"
        return None

    @classmethod
    def single_turn(cls, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], text: str):
        """A completion the model wrote in one go: every token is its own."""
        return cls(prompt_ids, completion_ids, logprobs, [True] * len(completion_ids), text)


@dataclass(frozen=True)
class ReplyRequest:
    """What a turn's request asks of the engine's reply (an agent's ``max_tokens``, ``stop`` and ``top_logprobs``):
    the engine samples at most ``max_tokens`` tokens (the generator's ``max_new_tokens`` bounds it), ends after the
    token that completes the first of the ``stop`` strings, and reports the ``top_logprobs`` most likely tokens at
    each place. The tokens sampled are what trains, so every limit is the engine's, never a cut afterwards."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0


@dataclass(frozen=True)
class Reward:
    """The rewarder's verdict on one row."""

    total: float  # the sum of the parts
    parts: dict[str, float] = field(default_factory=dict)  # per reward function, each logged on its own
    hint: str | None = None  # feedback on a wrong answer: the context a self-hinting teacher reads


@dataclass(frozen=True)
class EpisodeOutcome:
    """How an environment episode ended, beside its trajectory: its return (the sum of its step
    rewards), the model's turns, whether the environment ended it (else the turn limit did), and
    why it failed, if it did (a failed episode is never trained on)."""

    reward: float
    turns: int
    done: bool
    failure: str | None = None
    # an agent's requests that could not be stitched into the episode's one sequence (it edited its
    # history): each its own trajectory, trained with the episode's reward (``actors/agents/chat_tokens.py``)
    split: tuple[Trajectory, ...] = ()
    updated_tokens: int = 0  # of the model's tokens, those a newer version sampled (the episode went on with it)
    # of those, the tokens sampled after a weight update interrupted their turn (it went on with the new weights)
    updated_in_turn: int = 0


@dataclass(frozen=True)
class Row:
    kind: RowKind
    trajectory: Trajectory
    # the oldest policy version that sampled a token it trains, which its age counts from (a single-turn sample's
    # request's; an agent's row may hold tokens of newer versions after it; a teacher's trace: the version that
    # scored it)
    oldest_version: int
    teacher: str | None = None  # the teacher binding that wrote it; None for the policy's samples
    reward: Reward | None = None  # None only while the step is being collected
    distill: TopK | None = None  # the distill teacher's top-k at each completion token (channel 2)
    reference_logprobs: list[float] | None = None  # a Reference actor's, per completion token (the KL penalty)
    # the episode's place in its group, when the row is (part of) an episode: an agent's episode that could not be
    # stitched into one sequence is several rows of one episode, which count once in the group's advantages
    episode: int | None = None


@dataclass(frozen=True)
class RolloutGroup:
    problem: Problem
    index: int  # the prompt's place in its step, which fixes its sampling seed
    rows: tuple[Row, ...]

    def of_kind(self, kind: RowKind) -> list[Row]:
        return [row for row in self.rows if row.kind is kind]

    def preference_pairs(self) -> list[tuple[int, int]]:
        """Channel 3's pairs: each replayed trace against each of the policy's samples, as
        (chosen, rejected) indices into ``rows``.

        The one with the higher reward is chosen; ties make no pair. The policy's samples
        count once per distinct text, a trace once per distinct text (credited to the first
        teacher that wrote it), and a trace the policy itself sampled is dropped (channel 1
        already learns from it).
        """
        traces = self._first_per_text(RowKind.REPLAY)
        samples = self._first_per_text(RowKind.SAMPLE) if traces else {}
        pairs = []
        for trace in traces.values():
            if self.rows[trace].trajectory.text in samples:
                continue
            for sample in samples.values():
                trace_reward, sample_reward = self.rows[trace].reward.total, self.rows[sample].reward.total
                if trace_reward > sample_reward:
                    pairs.append((trace, sample))
                elif sample_reward > trace_reward:
                    pairs.append((sample, trace))
        return pairs

    def _first_per_text(self, kind: RowKind) -> dict[str, int]:
        first: dict[str, int] = {}
        for i, row in enumerate(self.rows):
            if row.kind is kind:
                first.setdefault(row.trajectory.text, i)
        return first
