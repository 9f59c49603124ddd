"""The ``native`` inner loop: an HF model, AdamW, DDP over the trainer mesh, micro-batches.

The loss sees the last hidden states and the LM-head weight (``LinearHead``), so
``[rows, tokens, vocab]`` logits never exist. Each micro-batch's loss is normalized by
the *whole step's* token and sequence counts, so summing micro-batches and ranks gives
exactly the full-batch loss whatever the split; DDP averages gradients over ranks,
hence the ``world`` factor on each rank's loss.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.inner_loops import TrainerConfig
from actors.model import load_policy
from actors.rollout import TrainBatch, split_rows
from losses import Counts, LinearHead, LossInputs, PolicyInputs, compose_loss


class HiddenStates(nn.Module):
    """The decoder without its LM head; DDP wraps this so gradients sync in backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: TrainBatch) -> Tensor:
        decoder = self.model.get_decoder()
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        return out.last_hidden_state[:, batch.prompt_len - 1 : -1]  # the states that predict the completion


class NativeLoop:
    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device=torch.device("cpu")):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model, _ = load_policy(model_path)
        self.model.to(device).train()
        hidden = HiddenStates(self.model)
        if world > 1:
            hidden = DistributedDataParallel(hidden, device_ids=[device] if device.type == "cuda" else None)
        self.hidden = hidden
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        batch = batch.to(self.device)
        counts = Counts.from_mask(batch.completion_mask, batch.max_completion_len)
        share = split_rows(len(batch), self.world)[self.rank]
        micro = self.cfg.micro_batch_size
        starts = range(share.start, share.stop, micro)
        totals: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for i, start in enumerate(starts):
            rows = slice(start, min(start + micro, share.stop))
            last = i == len(starts) - 1
            sync = nullcontext() if last or self.world == 1 else self.hidden.no_sync()
            with sync:
                out = self._loss(batch.rows(rows), counts)
                (out.loss * self.world).backward()
            for name, value in out.metrics.items():
                totals[name] = value if name.endswith("/skipped") else totals.get(name, 0.0) + value
        grad_norm = self._clip()
        self.optimizer.step()
        metrics = self._reduce(totals)
        metrics["grad_norm"] = grad_norm
        return metrics

    def _loss(self, batch: TrainBatch, counts: Counts):
        head = LinearHead(self.hidden(batch), self.model.get_output_embeddings().weight)
        policy = PolicyInputs(
            mask=batch.completion_mask,
            advantages=batch.advantages,
            counts=counts,
            old_logprobs=batch.inference_logprobs,
            inference_logprobs=batch.inference_logprobs,
        )
        return compose_loss(head, LossInputs(targets=batch.targets, policy=policy), self.cfg.loss)

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
