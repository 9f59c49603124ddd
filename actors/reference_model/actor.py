"""The reference model: a frozen policy whose logprobs of the sampled tokens feed the KL penalty
(``loss.policy.kl_coef``).

``ReferenceModel`` computes them wherever the topology places it (``actors.reference.mesh``):
on the trainer's own ranks, where each rank fills in its rows of a batch right before its
step, or in a ``Reference`` actor on another mesh, which the controller asks while the batch
is collected, beside the rewards and the teachers. Either way it is a plain HF model in eval
mode that no training wrapper (DDP, FSDP) ever sees: it never changes, so it is held whole.
With LoRA and no reference given it is no second model at all: the trainer's own policy with its
adapters switched off, which is exactly the frozen base.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from monarch.actor import Actor, endpoint
from torch import Tensor, nn

from actors.basics.compute import Compute
from actors.basics.proc_info import ProcInfo, this_proc
from actors.basics.shares import micro_batches
from actors.contract.rollouts import Trajectory
from actors.contract.train_batch import Sequences, trajectory_sequences
from actors.inner_loops.native import HiddenStates
from actors.models.lora import head_weight
from actors.models.packing import lane_tokens
from actors.models.policy import load_policy
from actors.models.source import check_before_loading
from losses import token_logprobs

if TYPE_CHECKING:
    from peft import PeftModel

    from actors.inner_loops.config import TrainerConfig


class ReferenceMismatch(ValueError):
    """The reference cannot score the policy's tokens: its vocabulary is not the policy's."""


@dataclass(frozen=True)
class Batching:
    """How the reference scores rows: in the trainer's micro-batches (at most ``tokens`` real tokens, a longer row
    alone) and its loss's chunks of ``chunk_tokens`` through the LM head."""

    tokens: int
    chunk_tokens: int

    @classmethod
    def of(cls, trainer: TrainerConfig) -> Batching:
        return cls(trainer.micro_batch_tokens, trainer.loss.chunk_tokens)


class ReferenceModel:
    """A frozen model's logprobs of sampled tokens; ``scoring`` wraps each pass (the LoRA base's: adapters off)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        batching: Batching,
        scoring: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.device, self.batching = device, batching
        self.model, self.scoring = model, scoring
        self.hidden = HiddenStates(model)

    @classmethod
    def load(
        cls, path: str, policy_path: str, device: torch.device, dtype: torch.dtype, batching: Batching
    ) -> ReferenceModel:
        """The model in ``path``, held whole in eval mode; refused unless its vocabulary is the policy's."""
        model, tokenizer = load_policy(path, dtype)
        if path != policy_path:
            _check_vocabulary(path, tokenizer, policy_path)
        return cls(model.to(device).eval().requires_grad_(False), device, batching)

    @classmethod
    def base_of(cls, policy: PeftModel, device: torch.device, batching: Batching) -> ReferenceModel:
        """A LoRA policy's own base: the policy's model with its adapters switched off while it scores."""
        return cls(policy, device, batching, scoring=policy.disable_adapter)

    @torch.no_grad()
    def logprobs(self, sequences: Sequences) -> Tensor:
        """``[B, T]``: each completion token's logprob under the reference, micro-batch by micro-batch."""
        weight, batching = head_weight(self.model), self.batching
        sequences = sequences.to(torch.device("cpu"))  # micro-batches cut and packed on the host, scored on the device
        tokens, lane = sequences.attention_mask.sum(-1).tolist(), lane_tokens(self.model.config)
        out = torch.zeros(sequences.targets.shape, device=self.device)
        with self.scoring():
            for rows in micro_batches(tokens, sequences.shared_prefixes(), batching.tokens):
                part = sequences.rows(torch.tensor(rows))
                packed = part.packed(lane)
                hidden = self.hidden(packed.to(self.device))
                targets, lengths = part.targets.to(self.device), list(packed.completion_lengths)
                out[rows] = token_logprobs(hidden, weight, targets, batching.chunk_tokens, lengths)
        return out


def _check_vocabulary(path: str, tokenizer, policy_path: str) -> None:
    from transformers import AutoTokenizer

    if tokenizer.get_vocab() != AutoTokenizer.from_pretrained(policy_path).get_vocab():
        raise ReferenceMismatch(
            f"the reference model at {path} has a tokenizer other than the policy's ({policy_path}), but the KL "
            "penalty compares the two models' logprobs of the same token ids; use a reference with the policy's "
            "tokenizer (e.g. the model the policy was fine-tuned from), or leave actors.reference.path out to use "
            "the policy's initial weights"
        )


@dataclass
class ReferenceReply:
    logprobs: list[list[float]]  # per trajectory, per completion token
    seconds: float


class Reference(Actor):
    """The reference model on a mesh of its own (or beside the teachers), asked once per collection."""

    def __init__(self, path: str, policy_path: str, compute: Compute, batching: Batching):
        self.args = (path, policy_path)  # the model is loaded in ``start`` (actors/basics/proc_info.py)
        self.compute, self.batching = compute, batching

    @endpoint
    def start(self) -> ProcInfo:
        torch.set_num_threads(self.compute.threads)
        dtype = torch.bfloat16 if self.compute.gpus else torch.float32
        for path in self.args:  # its model and the policy's tokenizer; here, so a restarted one checks again
            check_before_loading(path)
        self.model = ReferenceModel.load(*self.args, self.compute.device(), dtype, self.batching)
        return this_proc()

    @endpoint
    def logprobs(self, trajectories: list[Trajectory]) -> ReferenceReply:
        start = time.perf_counter()
        # pad_id 0 is a valid id in every vocabulary, and padding is masked out of attention
        values = self.model.logprobs(trajectory_sequences(trajectories, 0)).cpu()
        rows = [values[i, : len(t.completion_ids)].tolist() for i, t in enumerate(trajectories)]
        return ReferenceReply(rows, time.perf_counter() - start)
