"""Tensor inputs of the three loss channels.

Every field is a padded ``[B, T]`` (or ``[B]``) tensor over completion tokens, so one
dataclass serves every inner loop. ``rows(sl)`` slices a sub-batch but keeps the
*global* ``Counts``: each channel is a sum over rows divided by global counts, which is
what lets the memory-lean path evaluate the loss chunk by chunk (and what a
data-parallel trainer all-reduces).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Counts:
    """Global normalizers of one optimizer step (all ranks, all micro-batches)."""

    tokens: float  # completion tokens that carry loss
    sequences: int  # completions
    max_len: int  # the configured max completion length (Dr. GRPO's constant)

    @classmethod
    def from_mask(cls, mask: Tensor, max_len: int | None = None) -> Counts:
        """Counts of a batch that is the whole step; clamped so an empty batch divides by 1."""
        return cls(
            tokens=max(float(mask.sum()), 1.0),
            sequences=max(mask.shape[0], 1),
            max_len=max(max_len if max_len is not None else mask.shape[-1], 1),
        )


def _slice_rows(obj, rows: slice | Tensor, width: int | None = None):
    """Slice every tensor field of a batch dataclass along dim 0 and, given ``width``, every per-token field (two or
    more dims: ``[B, T, ...]``) to its first ``width`` completion columns; keep the rest."""
    changes = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, Tensor):
            changes[field.name] = value[rows] if width is None or value.dim() < 2 else value[rows, :width]
        elif dataclasses.is_dataclass(value) and hasattr(value, "rows"):
            changes[field.name] = value.rows(rows, width)
    return dataclasses.replace(obj, **changes)


@dataclass(frozen=True)
class TokenSplit:
    """A channel's loss tokens in two classes, for metrics only: the number tokens (in a word problem's
    completion, its arithmetic and its answer) and the rest (the wording). OPSD found the wording carrying most
    of a self-teacher's divergence; ``means`` says how much here. Each class has its global count, so its
    metrics add up over row slices like every other."""

    numbers: Tensor  # [B, T] bool, the channel's tokens that spell numbers
    words: Tensor  # [B, T] bool, its other tokens
    counts: tuple[float, float]  # global tokens of each class (at least 1)

    rows = _slice_rows

    @classmethod
    def of(cls, mask: Tensor, numbers: Tensor) -> TokenSplit:
        """The split of a whole step's channel ``mask`` by the ``numbers`` mask of its tokens."""
        numbers, words = mask & numbers, mask & ~numbers
        return cls(numbers, words, (max(float(numbers.sum()), 1.0), max(float(words.sum()), 1.0)))

    def means(self, name: str, per_token: Tensor) -> dict[str, Tensor]:
        """``name``'s mean per token of each class: ``{name}_numbers`` and ``{name}_words``."""
        per_token = per_token.detach()
        return {
            f"{name}_numbers": masked_sum_per_row(per_token, self.numbers).sum() / self.counts[0],
            f"{name}_words": masked_sum_per_row(per_token, self.words).sum() / self.counts[1],
        }


@dataclass(frozen=True)
class TokenClass:
    """Some of a channel's loss tokens, for metrics only (e.g. those sampled after a weight update interrupted
    their turn), with their global count, so that a mean over them adds up over row slices like every other."""

    mask: Tensor  # [B, T] bool
    count: float  # global tokens of the class (at least 1)

    rows = _slice_rows

    @classmethod
    def of(cls, mask: Tensor, members: Tensor) -> TokenClass:
        """The class of a whole step's channel ``mask`` that ``members`` marks."""
        chosen = mask & members
        return cls(chosen, max(float(chosen.sum()), 1.0))

    def cut(self, columns: slice) -> TokenClass:
        """Cut to the completion columns a micro-batch keeps."""
        return dataclasses.replace(self, mask=self.mask[:, columns])

    def mean(self, per_token: Tensor) -> Tensor:
        return masked_sum_per_row(per_token.detach(), self.mask).sum() / self.count


@dataclass(frozen=True)
class PolicyInputs:
    """Channel 1: what the policy-gradient losses need besides the trainer's logprobs."""

    mask: Tensor  # [B, T] bool, completion tokens that carry loss
    advantages: Tensor  # [B] or [B, T]
    counts: Counts
    old_logprobs: Tensor | None = None  # [B, T] the old policy, when the batch is trained on more than once
    inference_logprobs: Tensor | None = None  # [B, T] the sampler's: the old policy or TIS/MIS (see is_mode)
    ref_logprobs: Tensor | None = None  # [B, T] frozen reference, for the KL penalty
    token_weights: Tensor | None = None  # [B, T] per-token loss weights (PRIME-RL's loss_weights)
    held_back: Tensor | None = None  # [B, T] bool, Clip-Cov/KL-Cov's tokens over the step (covariance_selection)
    split: TokenSplit | None = None  # the entropy's mean per token class, logged
    after_update: TokenClass | None = None  # tokens a newer version sampled inside their turn: their mismatch, logged

    rows = _slice_rows


@dataclass(frozen=True)
class TeacherLogits:
    """A teacher's full logits at the completion positions, ``[B, T, V]``, no grad."""

    logits: Tensor

    rows = _slice_rows


@dataclass(frozen=True)
class TeacherHidden:
    """A teacher's last hidden states ``[B, T, H]`` and LM head ``[V, H]``.

    The memory-lean form of ``TeacherLogits``: logits are formed per chunk, never whole.
    A self-teacher (SDPO) passes the student's own LM head weight.
    """

    hidden: Tensor
    weight: Tensor

    def rows(self, rows: slice | Tensor, width: int | None = None) -> TeacherHidden:
        hidden = self.hidden[rows] if width is None else self.hidden[rows, :width].contiguous()  # one GEMM
        return TeacherHidden(hidden, self.weight)


@dataclass(frozen=True)
class TeacherTopK:
    """What an external teacher endpoint returns: top-k ids and logprobs, ``[B, T, K]``."""

    ids: Tensor
    logprobs: Tensor

    rows = _slice_rows


Teacher = TeacherLogits | TeacherHidden | TeacherTopK


@dataclass(frozen=True)
class DistillInputs:
    """Channel 2: a teacher's distribution at the student's own completion tokens."""

    teacher: Teacher
    mask: Tensor  # [B, T] bool, e.g. only the tokens after a hint
    counts: Counts  # tokens = global count of distilled tokens
    weights: Tensor | None = None  # [B] float, each row's weight under sample_weight 'group_spread' (read only then)
    split: TokenSplit | None = None  # the divergence's mean per token class, logged

    rows = _slice_rows


@dataclass(frozen=True)
class PreferenceInputs:
    """Channel 3: chosen/rejected pairs, as summed completion logprobs of each side.

    ``chosen_logps``/``rejected_logps`` carry the gradient; the ``ref_*`` sums come
    from the frozen reference (DPO only; SimPO ignores them).
    """

    chosen_logps: Tensor  # [P]
    rejected_logps: Tensor  # [P]
    chosen_lengths: Tensor  # [P] completion tokens
    rejected_lengths: Tensor  # [P]
    num_pairs: int  # global pair count (the normalizer)
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None


@dataclass(frozen=True)
class PairGrads:
    """Channel 3's gradient, cached (the inner loop's ``_pair_gradients``): the pair loss depends on each
    row only through its summed completion logprob, so once d(loss)/d(sum) is known per row, backpropagating
    ``coefficients x sum`` through the rows' own forward gives the channel's exact gradient, in the same pass
    as channels 1 and 2 (no second forward over the rows)."""

    coefficients: Tensor  # [B] d(pair loss)/d(row's summed logprob); 0 for a row in no pair
    mask: Tensor  # [B, T] bool, the completion tokens each sum runs over

    rows = _slice_rows


def masked_sum_per_row(values: Tensor, mask: Tensor) -> Tensor:
    """Row sums of ``values`` where ``mask``; a ``where`` so that inf/NaN at padding cannot leak."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(-1)
