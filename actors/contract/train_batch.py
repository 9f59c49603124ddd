"""``TrainBatch``: the padded tensors one optimizer step consumes, built once from a step's
rollout groups (``actors/contract/rollouts.py``) and read by every inner loop.

The controller splits a step's batch among the trainer's ranks by tokens (``TrainBatch.shares``) and sends each
rank its own share, as an endpoint argument, which is fine at kilobytes to megabytes (weights never do).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from actors.basics.shares import token_shares
from actors.contract.rollouts import RolloutGroup, Row, RowKind, Trajectory
from actors.models.packing import PackedRows, pack_rows
from losses import covariance_selection, group_advantages
from losses.config import AdvantageEstimator, CovariancePolicyConfig


@dataclass
class Sequences:
    """Trajectories as one forward pass reads them: prompts left-padded to ``prompt_len``,
    completions right-padded after it, ``position_ids`` counting real tokens only."""

    input_ids: Tensor  # [B, P + T] long
    attention_mask: Tensor  # [B, P + T] long
    position_ids: Tensor  # [B, P + T] long
    prompt_len: int  # P

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]

    def rows(self, rows: slice | Tensor) -> Sequences:
        return dataclasses.replace(self, **{k: getattr(self, k)[rows] for k in TOKEN_FIELDS})

    def packed(self, lane: int | None = None) -> PackedRows:
        """These rows packed for one forward pass, each shared prompt once, in lanes of ``lane`` tokens
        (``actors/models/packing.py``)."""
        return pack_rows(self.input_ids, self.attention_mask, self.position_ids, self.prompt_len, lane)

    def to(self, device: torch.device) -> Sequences:
        return dataclasses.replace(self, **{k: getattr(self, k).to(device) for k in TOKEN_FIELDS})

    def shared_prefixes(self) -> list[int]:
        """Per row, the real tokens it shares with the row before it: its prompt, when that row's is the same (a
        group's rows), else 0 (``micro_batches`` counts a shared prefix once per micro-batch, as packing computes
        it)."""
        prompts = self.input_ids[:, : self.prompt_len] * self.attention_mask[:, : self.prompt_len]
        same = torch.zeros(len(self), dtype=torch.bool)
        same[1:] = (prompts[1:] == prompts[:-1]).all(-1) & (self.attention_mask[1:, : self.prompt_len]
                                                          == self.attention_mask[:-1, : self.prompt_len]).all(-1)
        return torch.where(same, self.attention_mask[:, : self.prompt_len].sum(-1), 0).tolist()

    def __len__(self) -> int:
        return self.input_ids.shape[0]


TOKEN_FIELDS = ("input_ids", "attention_mask", "position_ids")
# a ``TrainBatch``'s fields laid out by completion token, [B, T] or [B, T, K]
PER_TOKEN_FIELDS = ("completion_mask", "inference_logprobs", "ref_logprobs", "distill_ids", "distill_logprobs",
                    "distill_mask", "after_update", "held_back")
# the fields that travel as their values at real tokens only (``TrainBatch.__reduce__``)
SENT_AT_REAL_TOKENS = ("input_ids", "position_ids", *PER_TOKEN_FIELDS)


@dataclass(frozen=True)
class Share:
    """Which rows of a step a ``TrainBatch`` holds when it is one rank's share of it: the step's rows
    ``first`` to ``first + len(batch)`` of ``step_rows``. A step's counts (the losses' normalizers) are the sums of
    its shares', taken by the ranks together (``MicroBatchLoop``)."""

    rank: int
    world: int
    first: int  # the step's index of this share's first row
    step_rows: int


@dataclass
class TrainBatch:
    """One optimizer step's rows: prompts left-padded to a common length ``prompt_len``,
    completions right-padded after it, so every row's completion starts at the same column.

    ``position_ids`` count real tokens only, as the sampler saw them under left padding.
    ``ref_logprobs`` (the KL penalty's), the ``distill_*`` fields and ``group_spread`` (channel 2) and ``pairs``
    (channel 3) are present only when the step has them; ``pairs`` index the step's rows, so a micro-batch's row
    slice leaves them out and a rank's share (``share``) keeps them whole.
    """

    input_ids: Tensor  # [B, P + T] long
    attention_mask: Tensor  # [B, P + T] long
    position_ids: Tensor  # [B, P + T] long
    prompt_len: int  # P
    completion_mask: Tensor  # [B, T] bool, the tokens that carry loss (the model's own, not padding)
    advantages: Tensor  # [B] float
    inference_logprobs: Tensor  # [B, T] float
    max_completion_len: int  # the generator's limit (Dr. GRPO's normalizer)
    policy_rows: Tensor  # [B] bool, rows in channel 1
    ref_logprobs: Tensor | None = None  # [B, T] float, the reference's (loss.policy.kl_coef > 0)
    distill_ids: Tensor | None = None  # [B, T, K] long, the teacher's top-k (student ids)
    distill_logprobs: Tensor | None = None  # [B, T, K] float
    distill_mask: Tensor | None = None  # [B, T] bool, the distilled tokens
    group_spread: Tensor | None = None  # [B] float, sqrt(p (1 - p)) of the row's group (channel 2's sample_weight)
    pairs: Tensor | None = None  # [P, 2] long, (chosen row, rejected row)
    after_update: Tensor | None = None  # [B, T] bool, tokens sampled after a weight update interrupted their turn
    held_back: Tensor | None = None  # [B, T] bool, Clip-Cov/KL-Cov's tokens, chosen over the whole step (``shares``)
    share: Share | None = None  # None: the whole step
    packing: PackedRows | None = None  # these rows packed on the host before they moved to a device; never travels

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]

    def sequences(self) -> Sequences:
        return Sequences(self.input_ids, self.attention_mask, self.position_ids, self.prompt_len)

    def packed(self, lane: int | None = None) -> PackedRows:
        return self.sequences().packed(lane)

    def rows(self, rows: slice | Tensor) -> TrainBatch:
        """Some rows (a micro-batch); the caller keeps the global counts."""
        return dataclasses.replace(self._map(lambda t: t[rows], skip=("pairs",)), pairs=None, packing=None)

    def shares(self, world: int, covariance: CovariancePolicyConfig | None = None) -> list[TrainBatch]:
        """The step's rows among ``world`` ranks, consecutive and balanced by real tokens (``token_shares``), each
        share holding only its rows (and the step's pairs). ``covariance``: the loss's Clip-Cov or KL-Cov rule,
        whose tokens are chosen here, over the whole step, so that every rank applies the same choice."""
        if self.share is not None:
            raise ValueError(f"rank {self.share.rank}'s share of a step cannot be shared again")
        whole = self
        if covariance is not None:
            policy_mask = self.completion_mask & self.policy_rows[:, None]
            chosen = covariance_selection(self.inference_logprobs, self.advantages[:, None], policy_mask, covariance)
            whole = dataclasses.replace(self, held_back=chosen)
        cuts = token_shares(self.attention_mask.sum(-1).tolist(), world)
        return [
            dataclasses.replace(whole._map(lambda t: t[cut], skip=("pairs",)).trimmed(),
                                share=Share(rank, world, cut.start, len(self)))
            for rank, cut in enumerate(cuts)
        ]

    def for_rank(self, rank: int, world: int, covariance: CovariancePolicyConfig | None = None) -> TrainBatch:
        """What rank ``rank`` of ``world`` trains on: its share of this whole step (``shares``), or this batch when
        it is that share already."""
        if self.share is None:
            return self.shares(world, covariance)[rank]
        if (self.share.rank, self.share.world) != (rank, world):
            raise ValueError(
                f"rank {rank} of {world} was sent rank {self.share.rank} of {self.share.world}'s share of the step: "
                "the sender split the step for another trainer mesh (a replaced mesh of another size?)"
            )
        if covariance is not None and self.held_back is None:
            raise ValueError(
                "a share of the step without Clip-Cov's or KL-Cov's chosen tokens for a covariance loss: split the "
                "step with TrainBatch.shares(world, covariance=the loss's policy config)"
            )
        return self

    @property
    def first_row(self) -> int:
        """The step's index of this batch's first row."""
        return 0 if self.share is None else self.share.first

    @property
    def step_rows(self) -> int:
        """The rows of the whole step this batch is (a share of)."""
        return len(self) if self.share is None else self.share.step_rows

    def to(self, device: torch.device) -> TrainBatch:
        packing = None if self.packing is None else self.packing.to(device)
        return dataclasses.replace(self._map(lambda t: t.to(device)), packing=packing)

    @property
    def completion_width(self) -> int:
        return self.input_ids.shape[1] - self.prompt_len

    def trimmed(self) -> TrainBatch:
        """These rows without the columns that are padding in all of them: a micro-batch's rows are often shorter
        than the step's longest, and the loss would score every completion column. It reads the mask: on the host."""
        real = self.attention_mask.bool().any(0)  # columns real in some row
        start = min(int(real.long().argmax()), self.prompt_len - 1)  # the first, within the prompt
        completion = real[self.prompt_len :].nonzero()
        return self.cut(start, int(completion.max()) + 1 if len(completion) else 1)

    def cut(self, start: int, width: int) -> TrainBatch:
        """The columns from ``start`` and ``width`` completion columns (at least one): slicing only, so on a device
        no wait for it."""
        end = self.prompt_len + width
        tokens = {name: getattr(self, name)[:, start:end] for name in TOKEN_FIELDS}
        per_token = {name: value[:, :width] for name in PER_TOKEN_FIELDS if (value := getattr(self, name)) is not None}
        return dataclasses.replace(self, **tokens, **per_token, prompt_len=self.prompt_len - start, packing=None)

    def __reduce__(self):
        # It travels token-major: each [B, P + T] or [B, T] field as the values at its real tokens only, flat, so
        # a share's bytes follow its tokens, not its rows times the longest; padding arrives as ``_padding`` makes
        # it. Numpy arrays travel as raw bytes (Monarch pickles a tensor storage through torch.save, slower).
        real = self.attention_mask.bool()
        completion = real[:, self.prompt_len :]
        fields = {"packing": None}  # the receiver packs for its own model and device
        for f in dataclasses.fields(self):
            if f.name == "packing":
                continue
            value = getattr(self, f.name)
            if f.name in SENT_AT_REAL_TOKENS and value is not None:
                value = value[real if f.name in TOKEN_FIELDS else completion]
            fields[f.name] = value.cpu().numpy() if isinstance(value, Tensor) else value
        fields["attention_mask"] = np.packbits(real.cpu().numpy(), axis=-1)
        return _train_batch_from_wire, (fields, tuple(real.shape))

    def _map(self, fn, skip: tuple[str, ...] = ()) -> TrainBatch:
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return dataclasses.replace(self, **{k: fn(v) for k, v in tensors.items() if isinstance(v, Tensor)})

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _train_batch_from_wire(fields: dict, shape: tuple[int, int]) -> TrainBatch:
    """A ``TrainBatch`` as ``__reduce__`` sent it: its token fields scattered back into the padded layout."""
    fields = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    real = torch.from_numpy(np.unpackbits(fields["attention_mask"].numpy(), axis=-1, count=shape[1]).astype(bool))
    completion = real[:, fields["prompt_len"] :]
    fields["attention_mask"] = real.long()
    for name in SENT_AT_REAL_TOKENS:
        if (values := fields.get(name)) is not None:
            where = real if name in TOKEN_FIELDS else completion
            padded = _padding(name, real, (*where.shape, *values.shape[1:]), values.dtype)
            padded[where] = values
            fields[name] = padded
    return TrainBatch(**fields)


def _padding(name: str, real: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A field's values at padding as ``build_train_batch`` makes them (no loss reads them)."""
    if name == "position_ids":
        return (real.long().cumsum(-1) - 1).clamp(min=0)
    if name == "distill_ids":  # distinct ids keep a masked row's support valid
        return torch.arange(shape[-1]).expand(shape).clone()
    if name == "distill_logprobs":
        return torch.full(shape, float("-inf"), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def trajectory_sequences(trajectories: list[Trajectory], pad_id: int) -> Sequences:
    return pad_sequences([t.prompt_ids for t in trajectories], [t.completion_ids for t in trajectories], pad_id)


def pad_sequences(prompts: list[Sequence[int]], completions: list[Sequence[int]], pad_id: int) -> Sequences:
    """Prompts left-padded and completions right-padded after them, one row each (``Sequences``)."""
    prompts, prompt_lens = _padded(prompts, pad_id, np.int64, right_aligned=True)
    completions, lengths = _padded(completions, pad_id, np.int64, minimum_width=1)
    prompt_len, width = prompts.shape[1], completions.shape[1]
    attention_mask = torch.from_numpy(
        np.concatenate(
            [np.arange(prompt_len) >= prompt_len - prompt_lens[:, None], np.arange(width) < lengths[:, None]], axis=1
        ).astype(np.int64)
    )
    return Sequences(
        input_ids=torch.from_numpy(np.concatenate([prompts, completions], axis=1)),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        prompt_len=prompt_len,
    )


def build_train_batch(
    groups: list[RolloutGroup], advantages: Tensor, pad_id: int, max_completion_len: int
) -> TrainBatch:
    """Rows group by group, each group's rows in order; ``advantages`` one per row in that order
    (``row_advantages``); channel 3's pairs from every group that has replayed traces."""
    rows = [row for group in groups for row in group.rows]
    trajectories = [row.trajectory for row in rows]
    sequences = trajectory_sequences(trajectories, pad_id)
    width = sequences.targets.shape[1]
    loss_mask, _ = _padded([t.loss_mask for t in trajectories], False, np.bool_, minimum_width=width)
    logprobs, _ = _padded([t.logprobs for t in trajectories], 0.0, np.float32, minimum_width=width)
    completion_mask = torch.from_numpy(loss_mask)
    return TrainBatch(
        **{k: getattr(sequences, k) for k in (*TOKEN_FIELDS, "prompt_len")},
        completion_mask=completion_mask,
        advantages=advantages.float(),
        inference_logprobs=torch.from_numpy(logprobs),
        max_completion_len=max_completion_len,
        policy_rows=torch.tensor([r.kind.trains_policy for r in rows]),
        **_reference_field(rows, width),
        **_distill_fields(groups, completion_mask),
        pairs=_pairs(groups),
        **_after_update_field(trajectories, width),
    )


def _after_update_field(trajectories: list[Trajectory], width: int) -> dict[str, Tensor]:
    """Which tokens a weight update inside their turn handed to a newer version, when any was."""
    marks = [t.after_update() for t in trajectories]
    if not any(any(row) for row in marks):
        return {}
    values, _ = _padded(marks, False, np.bool_, minimum_width=width)
    return {"after_update": torch.from_numpy(values)}


def _reference_field(rows: list[Row], width: int) -> dict[str, Tensor]:
    """The reference's logprobs as ``[B, T]``, when a ``Reference`` actor gave them (0 at padding,
    and in the rows that do not train the policy, which it is not asked about)."""
    if all(row.reference_logprobs is None for row in rows):
        return {}
    values, _ = _padded([row.reference_logprobs or () for row in rows], 0.0, np.float32, minimum_width=width)
    return {"ref_logprobs": torch.from_numpy(values)}


def row_advantages(groups: list[RolloutGroup], estimator: AdvantageEstimator = "group_std") -> Tensor:
    """One advantage per row, in batch order: group-relative among the episodes and rows that train the
    policy (``group_advantages``), 0 for the others. The rows of one episode (``Row.episode``: an agent's
    episode split into several) count once, and each gets the episode's advantage, so an episode's weight in
    its group's mean and spread does not grow with the rows it became. Groups of equal size share one call."""
    places = [episode_places(g) for g in groups]
    trained = [[g.rows[i].reward.total for i in firsts] for g, (firsts, _) in zip(groups, places)]
    if len({len(t) for t in trained}) == 1:
        flat = group_advantages(torch.tensor(trained).reshape(-1), len(trained[0]), estimator)
        per_group = flat.reshape(len(groups), -1).tolist()
    else:
        per_group = [group_advantages(torch.tensor(t), len(t), estimator).tolist() for t in trained]
    return torch.tensor(
        [0.0 if p is None else advantages[p] for advantages, (_, of_row) in zip(per_group, places) for p in of_row]
    )


def episode_places(group: RolloutGroup) -> tuple[list[int], list[int | None]]:
    """The rows that stand for the group's episodes in its advantages (a row of no episode stands for itself; an
    episode, by its first row), and each row's place among them (None: a row that does not train the policy)."""
    firsts: list[int] = []
    of_row: list[int | None] = []
    episodes: dict[int, int] = {}
    for i, row in enumerate(group.rows):
        if not row.kind.trains_policy:
            of_row.append(None)
        elif row.episode is not None and row.episode in episodes:
            of_row.append(episodes[row.episode])
        else:
            if row.episode is not None:
                episodes[row.episode] = len(firsts)
            of_row.append(len(firsts))
            firsts.append(i)
    return firsts, of_row


def sampled_episodes(groups: list[RolloutGroup]) -> list[Row]:
    """The policy's samples, one row for each: an agent's episode split into several rows (it edited its history)
    is one sample with one reward, as in its group's advantages."""
    return [g.rows[i] for g in groups for i in episode_places(g)[0] if g.rows[i].kind is RowKind.SAMPLE]


def _padded(
    sequences: list[list], fill, dtype, *, right_aligned: bool = False, minimum_width: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``sequences`` padded with ``fill`` into one ``[B, width]`` array (left-padded when
    ``right_aligned``), and their lengths. One flat copy and one scatter: a per-row copy costs
    more than the rest of building a batch."""
    lengths = np.fromiter(map(len, sequences), np.int64, len(sequences))
    width = max(int(lengths.max(initial=0)), minimum_width)
    out = np.full((len(sequences), width), fill, dtype)
    flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype, int(lengths.sum()))
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)  # each element's sequence start in ``flat``
    columns = np.arange(len(flat)) - starts
    if right_aligned:
        columns += np.repeat(width - lengths, lengths)
    out[np.repeat(np.arange(len(sequences)), lengths), columns] = flat
    return out, lengths


def _pairs(groups: list[RolloutGroup]) -> Tensor | None:
    """Every group's (chosen, rejected) pairs as batch row indices."""
    pairs, first = [], 0
    for group in groups:
        pairs += [(first + chosen, first + rejected) for chosen, rejected in group.preference_pairs()]
        first += len(group.rows)
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2) if pairs else None


def _group_spread(groups: list[RolloutGroup]) -> Tensor:
    """Per row, in batch order, ``sqrt(p (1 - p))`` with p the share of its group's policy samples that are correct
    (a reward of 1 or more, as ``reward/exact`` counts; an episode split into rows counts once): channel 2's
    ``sample_weight='group_spread'``, 0 where every sample agrees, 0.5 where half are right."""
    spreads = []
    for group in groups:
        samples = sampled_episodes([group])
        p = sum(row.reward.total >= 1.0 for row in samples) / max(len(samples), 1)
        spreads += [math.sqrt(p * (1 - p))] * len(group.rows)
    return torch.tensor(spreads)


def _distill_fields(groups: list[RolloutGroup], completion_mask: Tensor) -> dict[str, Tensor]:
    """The teacher's top-k per token as ``[B, T, K]``, rows without a teacher signal masked out, and each row's
    ``group_spread``."""
    rows = [row for group in groups for row in group.rows]
    scored = [r.distill for r in rows if r.distill is not None]
    if not scored:
        return {}
    width, k = completion_mask.shape[1], scored[0].ids.shape[1]
    ids = torch.arange(k).expand(len(rows), width, k).clone()  # distinct ids keep a masked row's support valid
    logprobs = torch.full((len(rows), width, k), float("-inf"))
    has_teacher = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row.distill is not None:
            length = len(row.trajectory.completion_ids)
            if row.distill.ids.shape != (length, k):
                raise ValueError(
                    f"teacher top-k of shape {row.distill.ids.shape} for a completion of {length} tokens "
                    f"(expected ({length}, {k})): a binding returned misaligned top-k"
                )
            ids[i, :length] = torch.from_numpy(row.distill.ids)
            logprobs[i, :length] = torch.from_numpy(row.distill.logprobs)
            has_teacher[i, :length] = True
    return {
        "distill_ids": ids,
        "distill_logprobs": logprobs,
        "distill_mask": completion_mask & has_teacher,
        "group_spread": _group_spread(groups),
    }
