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


@dataclass
class TrainBatch:
    """One optimizer step's samples: prompts left-padded to a common length ``prompt_len``,
    completions right-padded after it, so every row's completion starts at the same column.

    ``position_ids`` count real tokens only, as the sampler saw them under left padding.
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

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]

    def rows(self, rows: slice) -> TrainBatch:
        """A row slice (a rank's share, a micro-batch); the caller keeps the global counts."""
        return self._map(lambda t: t[rows])

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def __reduce__(self):
        # Monarch pickles each tensor storage through torch.save (about 2 ms for a batch's
        # seven tensors, on every step's critical path); numpy arrays travel as raw bytes.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays = {k: v.cpu().numpy() if isinstance(v, Tensor) else v for k, v in fields.items()}
        return _train_batch_from_arrays, (arrays,)

    def _map(self, fn) -> TrainBatch:
        return dataclasses.replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _train_batch_from_arrays(fields: dict) -> TrainBatch:
    return TrainBatch(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()})


def build_train_batch(rollouts: list[Rollout], advantages: Tensor, pad_id: int, max_completion_len: int) -> TrainBatch:
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
    return TrainBatch(
        input_ids=torch.tensor(ids),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        prompt_len=prompt_len,
        completion_mask=attention_mask[:, prompt_len:].bool(),
        advantages=advantages.float(),
        inference_logprobs=torch.tensor(logprobs),
        versions=torch.tensor([r.version for r in rollouts]),
        max_completion_len=max_completion_len,
    )


def split_rows(rows: int, parts: int) -> list[slice]:
    """Contiguous near-equal shares of ``rows`` (a rank's rows, a generator's prompts);
    the first ``rows % parts`` shares are one larger."""
    base, extra = divmod(rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
