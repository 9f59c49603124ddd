"""``compose_loss``: total = policy + alpha_sdpo * distill + beta_replay * preference.

Channel 2 with ``distill.signal: rlsd`` adds no term: it rescales channel 1's token advantages.

Each channel is normalized by its own global token or pair count (as PRIME-RL's
``compute_loss``), so the channels do not dilute each other and alpha/beta keep their
meaning as batches change. A channel whose inputs are absent, or whose weight is 0, is
not computed: it contributes exactly 0 and is reported as skipped.

Channel 3 comes in one of two forms: ``preference`` pairs (summed logprobs, the loss itself),
or ``pair_grads``, its gradient cached by the inner loop (``losses.batch.PairGrads``), which
rides on the token logprobs channels 1 and 2 already take, so a micro-batch's rows are
forwarded once for all three channels.

The policy's distribution comes in one of three forms (the ``Head``):
- ``Logits``: full ``[B, T, V]`` logits at the completion positions (simple, memory-hungry);
- ``LinearHead``: last hidden states and LM-head weight; channels 1 and 2 are then
  evaluated chunk by chunk and ``[B, T, V]`` logits never exist;
- ``TokenLogprobs``: only the sampled tokens' logprobs (what TRL or PRIME-RL compute);
  enough for channel 1, not for distillation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from losses.batch import DistillInputs, PairGrads, PolicyInputs, PreferenceInputs, masked_sum_per_row
from losses.config import COVARIANCE, CovariancePolicyConfig, LossConfig
from losses.distill import distill_loss, rlsd_advantages
from losses.logprobs import (
    RowChunk,
    fused_linear_loss,
    selective_logprobs,
    selective_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
)
from losses.policy import MISMATCH_MAX, aggregate, covariance_selection, old_policy_logprobs, policy_loss
from losses.preference import preference_loss

CHANNELS = ("policy", "distill", "preference")


@dataclass(frozen=True)
class Logits:
    logits: Tensor  # [B, T, V]


@dataclass(frozen=True)
class LinearHead:
    hidden: Tensor  # [B, T, H]
    weight: Tensor  # [V, H]


@dataclass(frozen=True)
class TokenLogprobs:
    logprobs: Tensor  # [B, T]
    entropy: Tensor | None = None  # [B, T], when the backend computed it (logged, never trained on)


Head = Logits | LinearHead | TokenLogprobs


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch for the loss. ``targets`` are the completion token ids ``[B, T]``
    (not needed with ``TokenLogprobs``); channels 1 and 2 share that grid."""

    targets: Tensor | None = None
    policy: PolicyInputs | None = None
    distill: DistillInputs | None = None
    preference: PreferenceInputs | None = None
    pair_grads: PairGrads | None = None  # channel 3's cached gradient (its loss and metrics come with ``preference``)


@dataclass
class LossOutput:
    loss: Tensor
    metrics: dict[str, float]


def _token_channels(inputs: LossInputs, cfg: LossConfig, taid_t: float | None, active: set[str]):
    """The channels that read the policy's distribution, as a loss of some rows' logits."""

    def loss_of_rows(logits: Tensor, chunk: RowChunk) -> tuple[Tensor, dict[str, Tensor]]:
        total, metrics, logprobs = None, {}, None
        rows, width = chunk.rows, chunk.width
        targets = inputs.targets[rows, :width]
        if "policy" in active:
            policy = inputs.policy.rows(rows, width)
            logprobs, entropy = selective_logprobs_and_entropy(logits, targets)
            if "rlsd" in active:
                policy, rlsd = _rlsd(policy, logprobs, inputs.distill.rows(rows, width), targets, cfg)
                metrics |= {f"distill/{k}": v for k, v in rlsd.items()}
            total, parts = policy_loss(logprobs, policy, cfg.policy)
            if cfg.policy.entropy_coef:  # the bonus needs the entropy's gradient: log_softmax's temporaries
                bonus = aggregate(token_entropy(logits), policy.mask, cfg.policy.aggregation, policy.counts)
                total = total - cfg.policy.entropy_coef * bonus
            parts["entropy"] = mean_entropy(entropy, policy)
            if policy.split is not None:
                parts |= policy.split.means("entropy", entropy)
            metrics |= {"policy/loss": total.detach()} | {f"policy/{k}": v for k, v in parts.items()}
        if "distill" in active and "rlsd" not in active:
            distill_rows = inputs.distill.rows(rows, width)
            distill, parts = distill_loss(logits, distill_rows, cfg.distill, taid_t, targets=targets)
            metrics |= {"distill/loss": distill.detach()} | {f"distill/{k}": v for k, v in parts.items()}
            total = _plus(total, cfg.alpha_sdpo * distill)
        if inputs.pair_grads is not None:
            if logprobs is None:
                logprobs = selective_logprobs(logits, targets)
            total = _plus(total, _cached_pair_loss(logprobs, inputs.pair_grads.rows(rows, width)))
        return total, metrics

    return loss_of_rows


def _read_lengths(inputs: LossInputs) -> list[int]:
    """Per row, the completion columns the token channels read: up to its last token in any channel's mask (at
    least 1). A channel's tokens are masked, so the columns after them change nothing but the logits' cost."""
    channels = (inputs.policy, inputs.distill, inputs.pair_grads)
    read = functools.reduce(torch.logical_or, [channel.mask.bool() for channel in channels if channel is not None])
    columns = torch.arange(1, read.shape[1] + 1, device=read.device)
    return torch.where(read, columns, 0).amax(-1).clamp(min=1).tolist()


def _rlsd(
    policy: PolicyInputs, logprobs: Tensor, distill: DistillInputs, targets: Tensor, cfg: LossConfig
) -> tuple[PolicyInputs, dict[str, Tensor]]:
    """Channel 2 as RLSD (``distill.signal: rlsd``): the policy inputs with the teacher-scaled advantages."""
    advantages, metrics = rlsd_advantages(
        policy.advantages, logprobs, distill, targets, cfg.distill.rlsd_clip, cfg.alpha_sdpo
    )
    return replace(policy, advantages=advantages), metrics


def _plus(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total + term


def _cached_pair_loss(logprobs: Tensor, grads: PairGrads) -> Tensor:
    """Exactly 0, with channel 3's gradient (``PairGrads``): the pair loss itself is reported where the pairs are."""
    term = (grads.coefficients * masked_sum_per_row(logprobs, grads.mask)).sum()
    return term - term.detach()


def _with_held_back(head: Head, inputs: LossInputs, cfg: CovariancePolicyConfig) -> PolicyInputs:
    """The policy inputs with Clip-Cov's or KL-Cov's tokens chosen over all their rows, before the
    head is evaluated chunk by chunk (each chunk choosing its own would depend on the chunking).
    Without old or sampler logprobs the old policy is the current one: a no-grad pass gives them."""
    policy = inputs.policy
    logprobs = old_policy_logprobs(policy)
    if logprobs is None:
        with torch.no_grad():
            if isinstance(head, TokenLogprobs):
                logprobs = head.logprobs
            elif isinstance(head, Logits):
                logprobs = selective_logprobs(head.logits, inputs.targets)
            else:
                logprobs = token_logprobs(head.hidden, head.weight, inputs.targets)
    advantages = policy.advantages if policy.advantages.dim() == 2 else policy.advantages[:, None]
    return replace(policy, held_back=covariance_selection(logprobs, advantages, policy.mask, cfg))


def mean_entropy(entropy: Tensor, policy: PolicyInputs) -> Tensor:
    """The policy's token entropy over its loss tokens, as a row-additive metric (a global count)."""
    return masked_sum_per_row(entropy.detach(), policy.mask.bool()).sum() / policy.counts.tokens


def _active_channels(head: Head, inputs: LossInputs, cfg: LossConfig) -> set[str]:
    active = set()
    if inputs.policy is not None:
        active.add("policy")
        if cfg.policy.entropy_coef and isinstance(head, TokenLogprobs):
            raise ValueError(
                "the entropy bonus (entropy_coef > 0) needs the policy's whole distribution, but the head only "
                "gives sampled-token logprobs; pass Logits or LinearHead instead of TokenLogprobs"
            )
    if inputs.distill is not None and cfg.alpha_sdpo > 0 and cfg.distill.signal == "rlsd":
        if inputs.policy is None:
            raise ValueError(
                "distill.signal 'rlsd' rescales the policy gradient's token advantages, so the batch needs policy "
                "inputs (channel 1) beside the teacher's; or use signal 'divergence' to distil alone"
            )
        if inputs.targets is None:
            raise ValueError("distill.signal 'rlsd' reads the teacher at the sampled tokens: pass LossInputs.targets")
        active |= {"distill", "rlsd"}
    elif inputs.distill is not None and cfg.alpha_sdpo > 0:
        if isinstance(head, TokenLogprobs):
            raise ValueError(
                "distillation (alpha_sdpo > 0) needs the student's whole distribution, but the head only "
                "gives sampled-token logprobs; pass Logits or LinearHead instead of TokenLogprobs"
            )
        active.add("distill")
    if inputs.preference is not None and cfg.beta_replay > 0 and inputs.preference.chosen_logps.numel():
        active.add("preference")
    if active - {"preference"} and head is None:
        raise ValueError("channels 1 and 2 read the policy's distribution: pass a head (only pairs need none)")
    if active - {"preference"} and not isinstance(head, TokenLogprobs) and inputs.targets is None:
        raise ValueError("LossInputs.targets (the completion token ids) are needed to score the policy's tokens")
    return active


def compose_loss(head: Head | None, inputs: LossInputs, cfg: LossConfig, *, taid_t: float | None = None) -> LossOutput:
    """The three-channel loss of one micro-batch and its per-channel metrics.

    ``head`` may be None when the inputs hold only preference pairs (their logprobs come summed).

    ``taid_t`` is the TAID schedule's current t (only for ``divergence='taid'``).
    With ``alpha_sdpo = beta_replay = 0`` the result is bit-identical to ``policy_loss``.
    """
    active = _active_channels(head, inputs, cfg)
    if "policy" in active and cfg.policy.name in COVARIANCE and inputs.policy.held_back is None:
        inputs = replace(inputs, policy=_with_held_back(head, inputs, cfg.policy))
    total: Tensor | None = None
    metrics: dict[str, Tensor] = {}

    if isinstance(head, TokenLogprobs):
        if "policy" in active:
            policy = inputs.policy
            if "rlsd" in active:
                policy, rlsd = _rlsd(policy, head.logprobs, inputs.distill, inputs.targets, cfg)
                metrics |= {f"distill/{k}": v for k, v in rlsd.items()}
            total, parts = policy_loss(head.logprobs, policy, cfg.policy)
            if head.entropy is not None:
                parts["entropy"] = mean_entropy(head.entropy, inputs.policy)
                if policy.split is not None:
                    parts |= policy.split.means("entropy", head.entropy)
            metrics |= {"policy/loss": total.detach()} | {f"policy/{k}": v for k, v in parts.items()}
        if inputs.pair_grads is not None:
            total = _plus(total, _cached_pair_loss(head.logprobs, inputs.pair_grads))
    elif active & {"policy", "distill"} or inputs.pair_grads is not None:
        loss_of_rows = _token_channels(inputs, cfg, taid_t, active)
        if isinstance(head, Logits):
            total, metrics = loss_of_rows(head.logits, RowChunk(slice(None), head.logits.shape[1]))
        else:
            lengths = _read_lengths(inputs)
            total, metrics = fused_linear_loss(
                head.hidden, head.weight, loss_of_rows, cfg.chunk_tokens, lengths, maxima={f"policy/{MISMATCH_MAX}"}
            )

    if "preference" in active:
        preference, parts = preference_loss(inputs.preference, cfg.preference)
        metrics |= {"preference/loss": preference.detach()} | {f"preference/{k}": v for k, v in parts.items()}
        total = _plus(total, cfg.beta_replay * preference)

    if total is None:
        raise ValueError("the batch has no loss inputs: give at least one of policy, distill or preference")
    scalars = {name: float(value) for name, value in metrics.items()}
    scalars |= {f"{name}/skipped": float(name not in active) for name in CHANNELS}
    scalars["loss"] = float(total.detach())
    return LossOutput(total, scalars)
