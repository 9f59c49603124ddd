"""The ``prime_rl`` inner loop: PRIME-RL's trainer semantics around our loss kernels.

As PRIME-RL's trainer (PrimeIntellect-ai/prime-rl @559b44772, ``trainer/rl/train.py`` and
``trainer/rl/loss.py``), the policy loss is a function called **once per sample on 1-D
tensors**, ``fn(LossInputs, **kwargs) -> LossOutputs``, returning the masked *sum* of its
per-token losses; the trainer divides by the token count of the whole step, across
micro-batches and ranks, and averages the per-sample metrics. The function is
``losses.prime_rl.composer_loss`` over the topology's ``loss.policy`` (``name: dppo`` is
PRIME-RL's default DPPO + KL loss), or any PRIME-RL custom loss named by ``custom_loss``.
PRIME-RL's own ``LossInputs``/``LossOutputs`` are used when prime-rl is importable.

PRIME-RL divides by tokens only; the other aggregations (sequence mean, Dr. GRPO's
constant) ride on its per-token weight stream, ``loss_weights``. Its contract sees the
sampled tokens' logprobs only, so channels 2 and 3 (which need the whole distribution
or summed sequences) are separate components here, as PRIME-RL's ``ce``/``ref_kl`` are:
``compose_loss`` with their own normalizers. The model, DDP and AdamW are the native
loop's (PRIME-RL's FSDP2 trainer is CUDA-only and not installable here), and so is bf16:
autocast over fp32 weights, where PRIME-RL's trainer gathers bf16 parameters with FSDP2's
``MixedPrecisionPolicy`` over fp32 shards; either way the loss function gets fp32 logprobs.

Each sample's tensors cover its completion positions (prompt tokens carry no loss).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from torch import Tensor

from actors.contract.train_batch import TrainBatch
from actors.inner_loops.base import CPU
from actors.inner_loops.config import TrainerConfig
from actors.inner_loops.native import NativeLoop
from losses import (
    LinearHead,
    LossInputs,
    LossOutput,
    PolicyConfig,
    PolicyInputs,
    compose_loss,
    mean_entropy,
    prime_rl,
    token_logprobs_and_entropy,
)

LossFn = Callable[..., prime_rl.LossOutputs]


def import_loss(path: str) -> LossFn:
    """PRIME-RL's ``import_path`` ("package.module.function") to the function."""
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"custom_loss.import_path {path!r} does not name a function ({error}); give it as "
            "'package.module.function', importable in the trainer's environment"
        ) from None


class PrimeRLLoop(NativeLoop):
    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device = CPU):
        super().__init__(model_path, cfg, rank, world, device)
        if cfg.custom_loss is not None:
            self.loss_fn, self.loss_kwargs = import_loss(cfg.custom_loss.import_path), cfg.custom_loss.kwargs
        else:  # the sum over a sample, so token_mean; the true aggregation rides on loss_weights
            self.loss_fn = prime_rl.composer_loss
            self.loss_kwargs = asdict(cfg.loss.policy) | {"aggregation": "token_mean"}
        self._samples = 1  # the step's samples with policy tokens (set per step)

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        batch = self.share_of(batch)
        samples = (batch.completion_mask & batch.policy_rows[:, None]).any(-1).sum()
        self._samples = max(int(self.step_sums(samples[None])[0]), 1)  # the step's, every share's summed
        return super().forward_backward(batch, taid_t)

    def micro_loss(self, batch: TrainBatch, inputs: LossInputs, taid_t: float | None) -> LossOutput:
        head = self.head(batch)
        total, metrics = self._policy_loss(head, batch, inputs.policy)
        metrics |= {"distill/skipped": 1.0, "preference/skipped": 1.0}  # as compose_loss reports them
        if inputs.distill is not None or inputs.pair_grads is not None:  # channels 2 and 3 as compose_loss takes them
            out = compose_loss(head, replace(inputs, policy=None), self.cfg.loss, taid_t=taid_t)
            total = total + out.loss
            metrics |= {name: value for name, value in out.metrics.items() if not name.startswith("policy/")}
        metrics |= {"loss": float(total.detach()), "policy/skipped": 0.0}
        return LossOutput(total, metrics)

    def _policy_loss(self, head: LinearHead, batch: TrainBatch, policy: PolicyInputs) -> tuple[Tensor, dict]:
        """PRIME-RL's ``compute_loss`` for the rl component: per-sample sums over the step's tokens."""
        logprobs, entropy = token_logprobs_and_entropy(
            head.hidden, head.weight, batch.targets, self.cfg.loss.chunk_tokens
        )
        weights = loss_weights(policy, self.cfg.loss.policy)
        total = logprobs.sum() * 0.0  # in the graph even for rows without policy tokens: DDP syncs in backward
        metrics = {}
        for row in torch.nonzero(policy.mask.any(-1)).flatten().tolist():
            sample = prime_rl.LossInputs(
                trainer_logprobs=logprobs[row],
                inference_logprobs=policy.inference_logprobs[row],
                ref_logprobs=None if policy.ref_logprobs is None else policy.ref_logprobs[row],
                advantages=policy.advantages[row].expand_as(logprobs[row]),
                loss_mask=policy.mask[row],
                loss_weights=weights[row],
            )
            out = self.loss_fn(sample, **self.loss_kwargs)
            total = total + out.loss
            for name, value in out.metrics.items():  # averaged over the step's samples
                key = f"policy/{name}"
                metrics[key] = metrics.get(key, 0.0) + float(value.float().mean()) / self._samples
        total = total / policy.counts.tokens
        metrics["policy/loss"] = float(total.detach())
        metrics["policy/entropy"] = float(mean_entropy(entropy, policy))
        return total, metrics


def loss_weights(policy: PolicyInputs, cfg: PolicyConfig) -> Tensor:
    """Per-token weights that turn PRIME-RL's token-count normalization into ``cfg.aggregation``."""
    counts, mask = policy.counts, policy.mask
    if cfg.aggregation == "token_mean":
        return torch.ones_like(mask, dtype=torch.float32)
    if cfg.aggregation == "seq_mean_token_mean":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        return (counts.tokens / (counts.sequences * lengths)).float().expand(mask.shape)
    return torch.full(mask.shape, counts.tokens / (counts.sequences * counts.max_len))
