"""The data contract between actors: ``Rollout`` (one sampled completion) and
``TrainBatch`` (the padded tensors one optimizer step consumes).

Both are plain dataclasses of lists and small tensors: they travel as endpoint
arguments, which is fine at kilobytes to megabytes (weights never do).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from actors.bindings import TokenScores
from actors.tasks import Problem


@dataclass
class Rollout:
    problem: Problem
    group: int  # rollouts of one prompt share a group; advantages are relative within it
    prompt_ids: list[int]
    completion_ids: list[int]  # ends with EOS unless the length limit cut it
    logprobs: list[float]  # the sampler's per-token logprobs of completion_ids
    text: str  # the decoded completion, without special tokens
    version: int  # the policy version that sampled (or, for a teacher trace, scored) it
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    teacher: str | None = None  # the teacher binding that wrote it; None for the policy's own samples
    trains_policy: bool = True  # in channel 1 (a replayed trace only enters channel 3's pairs)
    hint: str | None = None  # the Rewarder's feedback for a wrong completion (a self-hinting teacher's context)
    distill: TokenScores | None = None  # the distill teacher's top-k at each completion token (channel 2)


@dataclass
class TrainBatch:
    """One optimizer step's samples: prompts left-padded to a common length ``prompt_len``,
    completions right-padded after it, so every row's completion starts at the same column.

    ``position_ids`` count real tokens only, as the sampler saw them under left padding.
    The ``distill_*`` fields (channel 2) and ``pairs`` (channel 3) are present only when
    the step has them; ``pairs`` index rows, so a row slice leaves them out.
    """

    input_ids: Tensor  # [B, P + T] long
    attention_mask: Tensor  # [B, P + T] long
    position_ids: Tensor  # [B, P + T] long
    prompt_len: int  # P
    completion_mask: Tensor  # [B, T] bool, the tokens that carry loss
    advantages: Tensor  # [B] float
    inference_logprobs: Tensor  # [B, T] float
    versions: Tensor  # [B] long, the policy version that sampled each row
    max_completion_len: int  # the generator's limit (Dr. GRPO's normalizer)
    policy_rows: Tensor  # [B] bool, rows in channel 1
    distill_ids: Tensor | None = None  # [B, T, K] long, the teacher's top-k (student ids)
    distill_logprobs: Tensor | None = None  # [B, T, K] float
    distill_mask: Tensor | None = None  # [B, T] bool, the distilled tokens
    pairs: Tensor | None = None  # [P, 2] long, (chosen row, rejected row)

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]

    def rows(self, rows: slice | Tensor) -> TrainBatch:
        """Some rows (a rank's share, a micro-batch); the caller keeps the global counts."""
        return dataclasses.replace(self._map(lambda t: t[rows], skip=("pairs",)), pairs=None)

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def __reduce__(self):
        # Monarch pickles each tensor storage through torch.save (about 2 ms for a batch's
        # seven tensors, on every step's critical path); numpy arrays travel as raw bytes.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays = {k: v.cpu().numpy() if isinstance(v, Tensor) else v for k, v in fields.items()}
        return _train_batch_from_arrays, (arrays,)

    def _map(self, fn, skip: tuple[str, ...] = ()) -> TrainBatch:
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return dataclasses.replace(self, **{k: fn(v) for k, v in tensors.items() if isinstance(v, Tensor)})

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _train_batch_from_arrays(fields: dict) -> TrainBatch:
    return TrainBatch(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()})


def build_train_batch(
    rollouts: list[Rollout],
    advantages: Tensor,
    pad_id: int,
    max_completion_len: int,
    pairs: list[tuple[int, int]] = (),
) -> TrainBatch:
    """Rows in the order given; ``pairs`` are (chosen, rejected) indices into ``rollouts``."""
    prompt_len = max(len(r.prompt_ids) for r in rollouts)
    completion_len = max(max(len(r.completion_ids) for r in rollouts), 1)
    # padded Python rows, then one tensor per field: a per-row tensor copy costs more than the rest of a step
    ids, attention, logprobs = [], [], []
    for r in rollouts:
        left, right = prompt_len - len(r.prompt_ids), completion_len - len(r.completion_ids)
        ids.append([pad_id] * left + r.prompt_ids + r.completion_ids + [pad_id] * right)
        attention.append([0] * left + [1] * (len(r.prompt_ids) + len(r.completion_ids)) + [0] * right)
        logprobs.append(r.logprobs + [0.0] * right)
    attention_mask = torch.tensor(attention)
    completion_mask = attention_mask[:, prompt_len:].bool()
    return TrainBatch(
        input_ids=torch.tensor(ids),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        prompt_len=prompt_len,
        completion_mask=completion_mask,
        advantages=advantages.float(),
        inference_logprobs=torch.tensor(logprobs),
        versions=torch.tensor([r.version for r in rollouts]),
        max_completion_len=max_completion_len,
        policy_rows=torch.tensor([r.trains_policy for r in rollouts]),
        **_distill_fields(rollouts, completion_mask),
        pairs=torch.tensor(pairs, dtype=torch.long).reshape(-1, 2) if pairs else None,
    )


def _distill_fields(rollouts: list[Rollout], completion_mask: Tensor) -> dict[str, Tensor]:
    """The teacher's top-k per token as ``[B, T, K]``; rows without a teacher signal are masked out."""
    scored = [r.distill for r in rollouts if r.distill is not None]
    if not scored:
        return {}
    rows, width, k = len(rollouts), completion_mask.shape[1], scored[0].ids.shape[1]
    ids = torch.arange(k).expand(rows, width, k).clone()  # distinct ids keep a masked row's support valid
    logprobs = torch.full((rows, width, k), float("-inf"))
    has_teacher = torch.zeros(rows, width, dtype=torch.bool)
    for row, rollout in enumerate(rollouts):
        if rollout.distill is not None:
            length = len(rollout.completion_ids)
            if rollout.distill.ids.shape != (length, k):
                raise ValueError(
                    f"teacher scores of shape {rollout.distill.ids.shape} for a completion of {length} tokens "
                    f"(expected ({length}, {k})): a binding returned misaligned scores"
                )
            ids[row, :length] = torch.from_numpy(rollout.distill.ids)
            logprobs[row, :length] = torch.from_numpy(rollout.distill.logprobs)
            has_teacher[row, :length] = True
    return {"distill_ids": ids, "distill_logprobs": logprobs, "distill_mask": completion_mask & has_teacher}


def preference_pairs(rollouts: list[Rollout]) -> list[tuple[int, int]]:
    """Channel 3's pairs: per prompt, each replayed teacher trace against each of the policy's samples.

    The rule: the one with the higher verified reward is chosen; ties make no pair.
    Duplicates are removed first: the policy's samples count once per distinct text, a
    trace once per distinct text (credited to the first teacher that wrote it), and a
    trace the policy itself sampled is dropped (channel 1 already learns from it).
    Returns (chosen, rejected) indices into ``rollouts``.
    """
    groups: dict[int, list[int]] = {}
    for i, rollout in enumerate(rollouts):
        groups.setdefault(rollout.group, []).append(i)
    pairs = []
    for members in groups.values():
        own = _first_per_text(rollouts, [i for i in members if rollouts[i].teacher is None])
        traces = _first_per_text(rollouts, [i for i in members if not rollouts[i].trains_policy])
        for trace in traces.values():
            if rollouts[trace].text in own:
                continue
            for sample in own.values():
                if rollouts[trace].reward > rollouts[sample].reward:
                    pairs.append((trace, sample))
                elif rollouts[sample].reward > rollouts[trace].reward:
                    pairs.append((sample, trace))
    return pairs


def _first_per_text(rollouts: list[Rollout], indices: list[int]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i in indices:
        first.setdefault(rollouts[i].text, i)
    return first


def split_rows(rows: int, parts: int) -> list[slice]:
    """Contiguous near-equal shares of ``rows`` (a rank's rows, a generator's prompts);
    the first ``rows % parts`` shares are one larger."""
    base, extra = divmod(rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
