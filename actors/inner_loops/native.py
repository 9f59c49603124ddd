"""The ``native`` inner loop: an HF model, AdamW, DDP over the trainer mesh, micro-batches.

The loss sees the last hidden states and the LM-head weight (``LinearHead``), so
``[rows, tokens, vocab]`` logits never exist. Each micro-batch's loss is normalized by
the *whole step's* token and sequence counts, so summing micro-batches and ranks gives
exactly the full-batch loss whatever the split; DDP averages gradients over ranks,
hence the ``world`` factor on each rank's loss.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.inner_loops import TrainerConfig
from actors.model import load_policy
from actors.rollout import TrainBatch, split_rows
from losses import (
    Counts,
    DistillInputs,
    LinearHead,
    LossInputs,
    PolicyInputs,
    PreferenceInputs,
    TeacherTopK,
    compose_loss,
    token_logprobs,
)


class HiddenStates(nn.Module):
    """The decoder without its LM head; DDP wraps this so gradients sync in backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: TrainBatch) -> Tensor:
        decoder = self.model.get_decoder()
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        return out.last_hidden_state[:, batch.prompt_len - 1 : -1]  # the states that predict the completion


@dataclass
class PairGradients:
    """d(pair loss)/d(summed logprob) for each row in a pair (``rows``: batch row indices)."""

    rows: Tensor
    grads: Tensor

    def index(self, batch_rows: Tensor) -> Tensor:
        return torch.searchsorted(self.rows, batch_rows)


def _accumulate(totals: dict[str, float], metrics: dict[str, float]) -> None:
    """Sum row-additive metrics; a channel counts as skipped only if every pass skipped it."""
    for name, value in metrics.items():
        if name.endswith("/skipped"):
            totals[name] = min(totals.get(name, 1.0), value)
        else:
            totals[name] = totals.get(name, 0.0) + value


class NativeLoop:
    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device=torch.device("cpu")):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model, _ = load_policy(model_path)
        self.model.to(device).train()
        self.decoder = HiddenStates(self.model)
        self.hidden = self.decoder
        if world > 1:  # buffers are constants (rotary tables): ranks may run different numbers of forwards
            device_ids = [device] if device.type == "cuda" else None
            self.hidden = DistributedDataParallel(self.decoder, device_ids=device_ids, forward_sync_buffers=False)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )

    def train_step(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        batch = batch.to(self.device)
        inputs = self._loss_inputs(batch)
        share = split_rows(len(batch), self.world)[self.rank]
        micro = self.cfg.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        pairs = self._pair_coefficients(batch, totals) if self._has_pairs(batch) else None
        passes = [
            ("rows", slice(start, min(start + micro, share.stop))) for start in range(share.start, share.stop, micro)
        ]
        if pairs is not None:
            mine = pairs.rows[split_rows(len(pairs.rows), self.world)[self.rank]]
            passes += [("pairs", mine[start : start + micro]) for start in range(0, len(mine), micro)]
        for i, (kind, rows) in enumerate(passes):
            sync = nullcontext() if i == len(passes) - 1 or self.world == 1 else self.hidden.no_sync()
            with sync:
                if kind == "rows":
                    out = compose_loss(self._head(batch.rows(rows)), inputs(rows), self.cfg.loss, taid_t=taid_t)
                    (out.loss * self.world).backward()
                    _accumulate(totals, out.metrics)
                else:
                    logps = self._sequence_logprobs(batch.rows(rows))
                    ((logps * pairs.grads[pairs.index(rows)]).sum() * self.world).backward()
        grad_norm = self._clip()
        self.optimizer.step()
        metrics = self._reduce(totals)
        metrics["grad_norm"] = grad_norm
        return metrics

    def _head(self, batch: TrainBatch) -> LinearHead:
        return LinearHead(self.hidden(batch), self.model.get_output_embeddings().weight)

    def _loss_inputs(self, batch: TrainBatch):
        """Channels 1 and 2's inputs for any rows of ``batch``, normalized by the whole step's counts."""
        policy_mask = batch.completion_mask & batch.policy_rows[:, None]
        counts = Counts.from_mask(policy_mask, batch.max_completion_len)
        distill = batch.distill_mask is not None and self.cfg.loss.alpha_sdpo > 0
        distill_counts = Counts.from_mask(batch.distill_mask) if distill else None

        def rows(sl: slice) -> LossInputs:
            part = batch.rows(sl)
            policy = PolicyInputs(
                mask=policy_mask[sl],
                advantages=part.advantages,
                counts=counts,
                old_logprobs=part.inference_logprobs,
                inference_logprobs=part.inference_logprobs,
            )
            teacher = (
                DistillInputs(TeacherTopK(part.distill_ids, part.distill_logprobs), part.distill_mask, distill_counts)
                if distill
                else None
            )
            return LossInputs(targets=part.targets, policy=policy, distill=teacher)

        return rows

    def _has_pairs(self, batch: TrainBatch) -> bool:
        return batch.pairs is not None and len(batch.pairs) > 0 and self.cfg.loss.beta_replay > 0

    def _pair_coefficients(self, batch: TrainBatch, totals: dict[str, float]) -> PairGradients:
        """Channel 3 by gradient caching: the pair loss is a function of each row's summed
        logprob, so take those without a graph, get d(loss)/d(logprob) per row, and let
        each rank backpropagate ``coefficient * logprob`` over its own rows, micro-batch by
        micro-batch. Exact, and no pair ever needs both rows in one micro-batch."""
        rows = batch.pairs.unique()
        mine = split_rows(len(rows), self.world)[self.rank]
        logps = torch.zeros(len(rows), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for start in range(mine.start, mine.stop, self.cfg.micro_batch_size):
                part = slice(start, min(start + self.cfg.micro_batch_size, mine.stop))
                logps[part] = self._sequence_logprobs(batch.rows(rows[part]), self.decoder).double()
        if self.world > 1:
            dist.all_reduce(logps)
        logps = logps.float().requires_grad_()
        chosen, rejected = torch.searchsorted(rows, batch.pairs).unbind(-1)  # positions in the sorted ``rows``
        lengths = batch.completion_mask[rows].sum(-1)
        reference = (batch.inference_logprobs[rows] * batch.completion_mask[rows]).sum(-1)
        pairs = PreferenceInputs(
            chosen_logps=logps[chosen],
            rejected_logps=logps[rejected],
            chosen_lengths=lengths[chosen],
            rejected_lengths=lengths[rejected],
            num_pairs=len(batch.pairs),
            ref_chosen_logps=reference[chosen],
            ref_rejected_logps=reference[rejected],
        )
        out = compose_loss(None, LossInputs(preference=pairs), self.cfg.loss)
        out.loss.backward()
        # every rank computed the same pair loss: count it once (but report the same names everywhere)
        _accumulate(totals, {k: v if self.rank == 0 or k.endswith("/skipped") else 0.0 for k, v in out.metrics.items()})
        return PairGradients(rows, logps.grad)

    def _sequence_logprobs(self, batch: TrainBatch, decoder: nn.Module | None = None) -> Tensor:
        """Each row's completion logprob under the current policy, summed over its tokens."""
        hidden = (decoder or self.hidden)(batch)
        weight = self.model.get_output_embeddings().weight
        logprobs = token_logprobs(hidden, weight, batch.targets, self.cfg.loss.chunk_tokens)
        return torch.where(batch.completion_mask, logprobs, 0.0).sum(-1)

    def _clip(self) -> float:
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        """Sum the row-additive metrics over ranks (a rank with no rows contributes zeros)."""
        if self.world == 1:
            return totals
        names = sorted(totals)
        values = torch.tensor([totals[n] for n in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        return {n: (v / self.world if n.endswith("/skipped") else v) for n, v in zip(names, values.tolist())}

    def state_dict(self) -> dict[str, Tensor]:
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, directory: Path, state: dict) -> None:
        if self.rank == 0:
            save_checkpoint(directory, self.state_dict(), self.optimizer.state_dict(), state)

    def load(self, directory: Path) -> dict:
        model, optimizer, state = load_checkpoint(directory)
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        return state
