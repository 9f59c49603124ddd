"""PRIME-RL custom-loss adapter backed by this library's policy kernels.

Contract of PrimeIntellect-ai/prime-rl @559b44772 (2026-08-21),
``src/prime_rl/trainer/rl/loss.py``: the trainer calls ``fn(LossInputs, **kwargs)`` once
per sample on 1-D tensors and expects ``LossOutputs`` whose ``loss`` is the *masked sum*
of per-token losses; it divides by the global loss-token count itself. The ratio is
trainer vs inference logprobs (PRIME-RL does not recompute pi_old).

Use it from PRIME-RL's own trainer (prime-rl need not be installed to import this)::

    [trainer.loss]
    type = "custom"
    import_path = "losses.prime_rl.composer_loss"
    [trainer.loss.kwargs]
    name = "dppo"          # any field of the method's config; the default reproduces PRIME-RL's default loss

Only token-sum aggregation fits the contract, so ``aggregation`` must stay ``token_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from torch import Tensor

from losses.batch import Counts, PolicyInputs
from losses.config import PolicyConfig, policy_config
from losses.policy import policy_loss

UPSTREAM_COMMIT = "559b44772"

try:  # use PRIME-RL's own dataclasses when it is installed
    from prime_rl.trainer.rl.loss import LossInputs, LossOutputs
except ImportError:

    @dataclass
    class LossInputs:
        """Mirror of ``prime_rl.trainer.rl.loss.LossInputs`` (one sample, 1-D tensors)."""

        trainer_logprobs: Tensor
        inference_logprobs: Tensor
        ref_logprobs: Tensor | None
        advantages: Tensor
        loss_mask: Tensor
        loss_weights: Tensor | None = field(default=None)

    @dataclass
    class LossOutputs:
        """Mirror of ``prime_rl.trainer.rl.loss.LossOutputs``."""

        loss: Tensor
        metrics: dict[str, Tensor]


@lru_cache(maxsize=16)
def _config(items: tuple) -> PolicyConfig:
    kwargs = dict(items)
    kwargs.setdefault("name", "dppo")
    cfg = policy_config(**kwargs)
    if cfg.aggregation != "token_mean":
        raise ValueError(
            f"PRIME-RL divides the returned sum by its global token count, so only token_mean aggregation fits; "
            f"{cfg.name!r} resolved to {cfg.aggregation!r}. Set aggregation='token_mean' in [trainer.loss.kwargs]."
        )
    return cfg


def composer_loss(inputs: LossInputs, **kwargs) -> LossOutputs:
    """PRIME-RL custom loss: the masked token sum of a ``policy_config(**kwargs)`` loss."""
    cfg = _config(tuple(sorted(kwargs.items())))
    mask = inputs.loss_mask.bool()[None]
    batch = PolicyInputs(
        mask=mask,
        advantages=inputs.advantages[None],
        counts=Counts(tokens=1.0, sequences=1, max_len=mask.shape[-1]),  # sum, not mean
        inference_logprobs=inputs.inference_logprobs[None],
        ref_logprobs=None if inputs.ref_logprobs is None else inputs.ref_logprobs[None],
        token_weights=None if inputs.loss_weights is None else inputs.loss_weights[None],
    )
    loss, metrics = policy_loss(inputs.trainer_logprobs[None], batch, cfg)
    tokens = mask.sum().clamp(min=1)  # metrics are sums here; PRIME-RL averages per-sample means
    return LossOutputs(loss=loss, metrics={name: (value / tokens).detach() for name, value in metrics.items()})
