"""What every inner loop's step shares, whatever library owns the model and optimizer.

A step is: zero the gradients, run micro-batch passes over this rank's rows (channels 1
and 2) and over its preference rows (channel 3, by gradient caching), then clip and take
one optimizer step, unless the step's loss or gradient norm is not finite: then no weight
changes and ``NonFiniteLoss`` names the first input of the step that is not finite, whichever
rank holds it (or, all being finite, the model). Both numbers are global (summed over ranks), so every rank refuses
the same step, and checking them costs nothing: they are already on the host.

A rank holds only its share of the step's rows (``TrainBatch.shares``, balanced by tokens).
Each micro-batch's loss is normalized by the *whole step's* token, sequence and pair
counts (the sums of every share's, one all-reduce), so summing micro-batches and ranks
gives exactly the full-batch loss whatever the split. That is what makes the four inner
loops agree to float error: they differ only in the hooks below (how the model computes
the policy's distribution, how gradients sync, which optimizer steps).

Precision: ``compute_dtype`` is the dtype of the model's matmuls (``TrainerConfig.precision``
resolved for this loop's device). In bf16 every loop keeps fp32 weights, gradients and
optimizer state (mixed precision, each the way its library does it), so checkpoints hold
fp32 masters whatever the precision, and the loss kernels, which upcast to fp32, run
outside any autocast region on whatever dtype the head hands them.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from actors.basics.shares import micro_batches
from actors.contract.train_batch import TrainBatch
from actors.inner_loops.checkpoint import load_checkpoint, save_checkpoint
from actors.inner_loops.config import TrainerConfig
from actors.models.lora import adapter_state, load_adapter_state, saved_name
from actors.models.packing import PackedRows, lane_tokens
from actors.models.policy import number_tokens
from losses import (
    Counts,
    DistillInputs,
    Head,
    LinearHead,
    Logits,
    LossInputs,
    LossOutput,
    PairGrads,
    PolicyInputs,
    PreferenceInputs,
    TeacherTopK,
    TokenClass,
    TokenLogprobs,
    TokenSplit,
    compose_loss,
    selective_logprobs,
    token_logprobs,
)
from losses.config import COVARIANCE
from losses.policy import MISMATCH_MAX

CPU = torch.device("cpu")


RowInputs = Callable[[slice | Tensor, int | None], LossInputs]  # (rows, completion width to keep, or all of it)


@dataclass(frozen=True)
class ParameterShard:
    """A parameter's values on this rank: a sharded (FSDP2) parameter's local shard, or a whole
    replicated (DDP) parameter, which every rank of the trainer mesh holds the same."""

    values: Tensor  # changing it in place changes the parameter
    sharded: bool


class InnerLoop(Protocol):
    """Built inside a trainer process after ``torch.distributed`` is initialized."""

    device: torch.device  # where the policy's parameters live

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device) -> None: ...

    def train_step(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of the step (``batch``: that share, or the whole step's rows);
        metrics are global (already reduced over ranks). ``taid_t``: the TAID schedule's t."""

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """``train_step`` without the optimizer step: the step's gradients, synced over ranks."""

    def share_of(self, batch: TrainBatch) -> TrainBatch:
        """This rank's share of the step ``batch`` (the batch itself when it is that share)."""

    def gradients(self) -> dict[str, Tensor]:
        """The gradients ``forward_backward`` left, full (not sharded), named as in ``state_dict``."""

    def state_dict(self) -> dict[str, Tensor]:
        """The policy's full weights under the names the generator engines load (HF naming); with LoRA
        (``TrainerConfig.lora``) its adapters only, under PEFT's saved names (``actors/models/lora.py``)."""

    def parameter_shards(self) -> dict[str, ParameterShard]:
        """This rank's part of every parameter (``ParameterShard``), changed in place by DiLoCo's outer step."""

    def save(self, directory: Path, state: dict) -> None:
        """Policy, optimizer and the caller's ``state`` (rank 0 writes; every rank must call)."""

    def load(self, directory: Path) -> dict:
        """Restore policy and optimizer; return the ``state`` saved with them."""


class MicroBatchLoop(ABC):
    """An ``InnerLoop`` whose backends supply the model's head, gradient sync and optimizer.

    ``lockstep``: every forward is a collective (FSDP2 gathers the parameters in it), so
    every rank must run as many as the busiest one, even when rows split unevenly; the
    others run idle passes that contribute nothing.
    """

    lockstep = False
    model: nn.Module
    lane: int  # the tokens a dense lane of this model's packed rows holds (``actors/models/packing.py``)

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model_path = model_path
        bf16 = cfg.precision_on(device.type == "cuda") == "bf16"
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32

    def autocast(self) -> AbstractContextManager:
        """The model's forward in ``compute_dtype`` (AMP: torch casts each matmul's inputs; the
        parameters stay fp32). A no-op in fp32."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def parameter_shards(self) -> dict[str, ParameterShard]:
        """This rank's part of every trained parameter, to change in place between steps (DiLoCo's outer step)."""
        shards = {}
        for name, param in self.model.named_parameters():
            if not param.requires_grad:  # a frozen base (LoRA): only the adapters train and sync
                continue
            sharded = isinstance(param, DTensor)
            shards[name] = ParameterShard((param.to_local() if sharded else param).detach(), sharded)
        return shards

    # -- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def head(self, batch: TrainBatch) -> Head:
        """The policy's distribution at the completion positions of ``batch``'s rows (``packed`` for the pass),
        computed through the gradient-syncing wrapper (DDP, FSDP2, Accelerate)."""

    def pack(self, rows: TrainBatch) -> PackedRows:
        """``rows`` packed for one forward pass of this loop's model, on the host."""
        return rows.packed(self.lane)

    def packed(self, batch: TrainBatch) -> PackedRows:
        """``batch``'s rows packed as ``on_device`` packed them before they moved, or now (a batch made elsewhere)."""
        return batch.packing if batch.packing is not None else self.pack(batch).to(self.device)

    def on_device(self, rows: TrainBatch) -> TrainBatch:
        """A micro-batch's ``rows`` (on the host) packed there and moved to the loop's device: packing reads every
        token id, and reading them on a GPU would wait for it."""
        return dataclasses.replace(rows, packing=self.pack(rows)).to(self.device)

    @abstractmethod
    def no_sync(self) -> AbstractContextManager:
        """Backward passes inside accumulate gradients locally, without syncing ranks."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def clip_gradients(self) -> float:
        """Clip the global gradient norm; return the norm before clipping."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Step the optimizer and the LR schedule on the clipped gradients."""

    @abstractmethod
    def gradients(self) -> dict[str, Tensor]:
        """The accumulated full gradients, under the same names as ``state_dict``."""

    def micro_loss(self, batch: TrainBatch, inputs: LossInputs, taid_t: float | None) -> LossOutput:
        """One micro-batch's loss over rows ``batch`` (already normalized by the step's counts)."""
        return compose_loss(self.head(batch), inputs, self.cfg.loss, taid_t=taid_t)

    def backward(self, loss: Tensor) -> None:
        """DDP and FSDP2 average gradients over ranks; the losses are parts of one global sum."""
        (loss * self.world).backward()

    # -- the step --------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        batch = self.share_of(batch)
        metrics = self.forward_backward(batch, taid_t)
        metrics["grad_norm"] = self.clip_gradients()
        loss = metrics.get("loss", 0.0)
        if not (math.isfinite(loss) and math.isfinite(metrics["grad_norm"])):  # the same on every rank: both global
            raise non_finite_step(loss, metrics["grad_norm"], self._gathered(non_finite_inputs(batch)))
        self.optimizer_step()
        return metrics

    def share_of(self, batch: TrainBatch) -> TrainBatch:
        """This rank's share of the step (``TrainBatch.for_rank``): the batch itself when it is that share."""
        policy = self.cfg.loss.policy
        return batch.for_rank(self.rank, self.world, policy if policy.name in COVARIANCE else None)

    def forward_backward(self, batch: TrainBatch, taid_t: float | None = None) -> dict[str, float]:
        """This rank's share of the step's gradients, synced over ranks; the step's metrics. Micro-batches are cut
        and packed from the share on the host (``on_device``); the share on the device gives their loss inputs."""
        share = self.share_of(batch).to(CPU)
        tokens, shared = share.attention_mask.sum(-1).tolist(), share.sequences().shared_prefixes()
        batch = share.to(self.device)
        self.zero_grad()
        totals: dict[str, float] = {}
        pair_grads = self._pair_gradients(share, batch, tokens, shared, totals) if self._has_pairs(share) else None
        inputs = self.row_inputs(batch, pair_grads)
        passes = [("rows", rows) for rows in self._micro_batches(tokens, shared)]
        if self.lockstep:
            passes += [("idle", slice(0, 1))] * (self._most(len(passes)) - len(passes))
        for i, (kind, rows) in enumerate(passes):
            with nullcontext() if i == len(passes) - 1 or self.world == 1 else self.no_sync():
                if kind == "rows":
                    part = self.on_device(share.rows(rows).trimmed())
                    out = self.micro_loss(part, inputs(rows, part.completion_width), taid_t)
                    self.backward(out.loss)
                    _accumulate(totals, out.metrics)
                else:
                    self.backward(self.sequence_logprobs(self.on_device(share.rows(rows))).sum() * 0.0)
        return self._reduce(totals)

    def _micro_batches(self, tokens: list[int], shared: list[int]) -> list[slice | Tensor]:
        """Micro-batches of rows with these real ``tokens`` and ``shared`` prefixes (``micro_batches``), at most
        ``micro_batch_tokens`` tokens each, as an index of this share's rows."""
        return [_index(rows) for rows in micro_batches(tokens, shared, self.cfg.micro_batch_tokens)]

    def _most(self, passes: int) -> int:
        """The most ``passes`` of any rank (ranks in lockstep run as many as the busiest)."""
        if self.world == 1:
            return passes
        most = torch.tensor([passes], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def _step_counts(self, masks: dict[str, Tensor]) -> dict[str, float]:
        """Each of this share's ``masks``' tokens counted over the whole step (every share's summed), at least 1."""
        totals = self.step_sums(torch.stack([mask.sum() for mask in masks.values()]))
        return {name: max(total, 1.0) for name, total in zip(masks, totals)}

    def step_sums(self, local: Tensor) -> list[float]:
        """``local`` (a vector of this share's sums) summed over the step's shares, one all-reduce: the step's
        counts, which every rank's loss divides by."""
        local = local.to(torch.float64)
        if self.world > 1:
            dist.all_reduce(local)
        return local.tolist()

    def _gathered(self, found: list[str]) -> list[str]:
        """Every rank's ``found``, in rank order (called by every rank)."""
        if self.world == 1:
            return found
        every: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(every, found)
        return [item for items in every for item in items]

    def row_inputs(self, batch: TrainBatch, pair_grads: PairGrads | None = None) -> RowInputs:
        """The channels' inputs for any rows of this share, normalized by the whole step's counts (channel 3 as its
        cached gradient, ``pair_grads``)."""
        policy_mask = batch.completion_mask & batch.policy_rows[:, None]
        distill = batch.distill_mask is not None and self.cfg.loss.alpha_sdpo > 0
        numbers = self._numbers(batch.targets)
        channels = {"policy": policy_mask} | ({"distill": batch.distill_mask} if distill else {})
        masks: dict[str, Tensor] = {}
        for name, mask in channels.items():
            masks |= {name: mask, f"{name}_numbers": mask & numbers, f"{name}_words": mask & ~numbers}
        if batch.after_update is not None:
            masks["after_update"] = policy_mask & batch.after_update
        step = self._step_counts(masks)
        counts = Counts(step["policy"], max(batch.step_rows, 1), max(batch.max_completion_len, 1))
        distill_counts = Counts(step["distill"], max(batch.step_rows, 1), counts.max_len) if distill else None
        policy_split = TokenSplit(masks["policy_numbers"], masks["policy_words"],
                                  (step["policy_numbers"], step["policy_words"]))
        distill_split = TokenSplit(masks["distill_numbers"], masks["distill_words"],
                                   (step["distill_numbers"], step["distill_words"])) if distill else None
        after_update = TokenClass(masks["after_update"], step["after_update"]) if "after_update" in masks else None
        spread = self.cfg.loss.distill.sample_weight == "group_spread"

        def rows(sl: slice | Tensor, width: int | None = None) -> LossInputs:
            part = batch.rows(sl)
            if width is not None:
                part = part.cut(0, width)
            cut = slice(None, width)
            policy = PolicyInputs(
                mask=policy_mask[sl, cut],
                advantages=part.advantages,
                counts=counts,
                inference_logprobs=part.inference_logprobs,  # the old policy is the loss's choice (is_mode)
                ref_logprobs=part.ref_logprobs,
                held_back=part.held_back,
                split=_trimmed(policy_split.rows(sl), cut),
                after_update=None if after_update is None else after_update.rows(sl).cut(cut),
            )
            teacher = (
                DistillInputs(
                    TeacherTopK(part.distill_ids, part.distill_logprobs),
                    part.distill_mask,
                    distill_counts,
                    weights=part.group_spread if spread else None,
                    split=_trimmed(distill_split.rows(sl), cut) if distill else None,
                )
                if distill
                else None
            )
            pairs = None
            if pair_grads is not None:
                pairs = pair_grads.rows(sl)
                pairs = replace(pairs, mask=pairs.mask[:, cut])
            return LossInputs(targets=part.targets, policy=policy, distill=teacher, pair_grads=pairs)

        return rows

    @cached_property
    def number_tokens(self) -> Tensor:
        """The metrics' token classes (``TokenSplit``), read from the tokenizer at the first step (a loop's own
        checks of its model directory come first) and kept on the loop's device."""
        return number_tokens(self.model_path).to(self.device)

    def _numbers(self, targets: Tensor) -> Tensor:
        """``[B, T]`` bool: the targets that spell numbers (an id past the tokenizer's, e.g. padding: none)."""
        table = self.number_tokens
        inside = targets < len(table)
        return inside & table[targets.clamp(max=len(table) - 1)]

    def sequence_logprobs(self, batch: TrainBatch) -> Tensor:
        """Each row's completion logprob under the current policy, summed over its tokens."""
        head = self.head(batch)
        if isinstance(head, LinearHead):  # logits at each row's own tokens only
            lengths = list(self.packed(batch).completion_lengths)
            logprobs = token_logprobs(head.hidden, head.weight, batch.targets, self.cfg.loss.chunk_tokens, lengths)
        elif isinstance(head, Logits):
            logprobs = selective_logprobs(head.logits, batch.targets)
        else:
            assert isinstance(head, TokenLogprobs)
            logprobs = head.logprobs
        return torch.where(batch.completion_mask, logprobs, 0.0).sum(-1)

    def _has_pairs(self, batch: TrainBatch) -> bool:
        return batch.pairs is not None and len(batch.pairs) > 0 and self.cfg.loss.beta_replay > 0

    def _pair_gradients(self, share: TrainBatch, batch: TrainBatch, tokens: list[int], shared: list[int],
                        totals: dict[str, float]) -> PairGrads:
        """Channel 3 by gradient caching: the pair loss is a function of each row's summed
        logprob, so take those without a graph, get d(loss)/d(logprob) per row, and let
        each rank backpropagate ``coefficient * logprob`` over its own rows in the same
        micro-batches as channels 1 and 2 (``losses.batch.PairGrads``). Exact, and no pair
        ever needs both rows in one micro-batch, nor on one rank: each rank sums its own rows of the step's pairs,
        and one all-reduce gives every rank all of them. ``share``: this rank's rows on the host, ``batch`` on the
        device."""
        rows = share.pairs.unique()  # the step's rows in pairs, sorted
        local = rows - share.first_row
        mine = (local >= 0) & (local < len(share))
        at, own = mine.nonzero().flatten(), local[mine]
        rows_own = own.tolist()
        cuts = self._micro_batches([tokens[row] for row in rows_own],
                                   [shared[row] if i and rows_own[i - 1] == row - 1 else 0 for i, row in
                                    enumerate(rows_own)])
        idle = self._most(len(cuts)) - len(cuts) if self.lockstep else 0  # agreed before any pass (a collective)
        sums = torch.zeros(3, len(rows), dtype=torch.float64, device=self.device)  # logprob, length, reference's
        with torch.no_grad():
            for part in cuts:
                sums[0, at[part]] = self.sequence_logprobs(self.on_device(share.rows(own[part]))).double()
            for _ in range(idle):
                self.sequence_logprobs(self.on_device(share.rows(slice(0, 1))))
        completion = batch.completion_mask[own]
        sums[1, at] = completion.sum(-1).double()
        sums[2, at] = (batch.inference_logprobs[own] * completion).sum(-1).double()
        if self.world > 1:
            dist.all_reduce(sums)
        logps = sums[0].float().requires_grad_()
        lengths, reference = sums[1].long(), sums[2].float()
        chosen, rejected = torch.searchsorted(rows, share.pairs).unbind(-1)  # positions in the sorted ``rows``
        pairs = PreferenceInputs(
            chosen_logps=logps[chosen],
            rejected_logps=logps[rejected],
            chosen_lengths=lengths[chosen],
            rejected_lengths=lengths[rejected],
            num_pairs=len(share.pairs),
            ref_chosen_logps=reference[chosen],
            ref_rejected_logps=reference[rejected],
        )
        out = compose_loss(None, LossInputs(preference=pairs), self.cfg.loss)
        out.loss.backward()
        # every rank computed the same pair loss: count it once (but report the same names everywhere)
        _accumulate(totals, {k: v if self.rank == 0 or k.endswith("/skipped") else 0.0 for k, v in out.metrics.items()})
        coefficients = torch.zeros(len(batch), dtype=logps.grad.dtype, device=self.device)
        coefficients[own] = logps.grad[at]
        return PairGrads(coefficients, batch.completion_mask)

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        """Sum the row-additive metrics over ranks (a rank with no rows contributes zeros); take the
        largest of the maxima."""
        if self.world == 1:
            return totals
        summed = sorted(n for n in totals if not _is_max(n))
        maxima = sorted(n for n in totals if _is_max(n))
        out = {}
        for names, op in ((summed, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
            values = torch.tensor([totals[n] for n in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(values, op=op)
            out |= {n: (v / self.world if n.endswith("/skipped") else v) for n, v in zip(names, values.tolist())}
        return out


def _index(rows: list[int]) -> slice | Tensor:
    """Rows as an index: a slice (a view) when they are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows)


def _trimmed(split: TokenSplit, columns: slice) -> TokenSplit:
    """A row slice's split cut to the completion columns its micro-batch keeps."""
    return replace(split, numbers=split.numbers[:, columns], words=split.words[:, columns])


class HFModelLoop(MicroBatchLoop):
    """A loop over an HF model (``self.model``) and one torch optimizer (``self.optimizer``):
    weights, gradients and checkpoints under the model's own (HF) names."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def lane(self) -> int:
        return lane_tokens(self.model.config)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def gradients(self) -> dict[str, Tensor]:
        named = self.model.named_parameters()
        rename = saved_name if self.cfg.lora is not None else str
        return {rename(name): p.grad.detach() for name, p in named if p.grad is not None}

    def state_dict(self) -> dict[str, Tensor]:
        """The full weights, or with LoRA the adapters only (PEFT's saved names): what followers and checkpoints get."""
        if self.cfg.lora is not None:
            return adapter_state(self.model)
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, directory: Path, state: dict) -> None:
        if self.rank == 0:
            save_checkpoint(directory, self.state_dict(), self.optimizer.state_dict(), state)

    def load(self, directory: Path) -> dict:
        model, optimizer, state = load_checkpoint(directory)
        if self.cfg.lora is not None:
            load_adapter_state(self.model, model)
        else:
            self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        return state


class NonFiniteLoss(FloatingPointError):
    """A step's loss or gradient norm is not finite, so the optimizer did not step; the message names
    the first input of the batch that is not finite, where it came from and the fix."""


@dataclass(frozen=True)
class LossInput:
    """One input of the loss from the batch: its values where the loss reads them, and its source."""

    name: str
    values: Tensor
    read: Tensor  # bool, where the loss reads ``values`` (broadcast to their shape)
    source: str  # where the values come from, and the fix
    outside_support: bool = False  # -inf is a value (a token the source gives no probability), not a fault

    def non_finite(self, first_row: int = 0) -> str | None:
        """How many of the values read are not finite and where the first is (its row counted from
        ``first_row``); None if all are."""
        read = self.read.expand_as(self.values)
        allowed = torch.isneginf(self.values) if self.outside_support else torch.zeros_like(read)
        bad = read & ~torch.isfinite(self.values) & ~allowed
        if not bad.any():
            return None
        first = tuple(int(i) for i in bad.nonzero()[0])
        at = f"row {first_row + first[0]}" + (f", token {first[1]}" if len(first) > 1 else "")
        return f"{int(bad.sum())} of {int(read.sum())} values, the first {float(self.values[first])} at {at}"


def non_finite_inputs(batch: TrainBatch) -> list[str]:
    """Each input of ``batch`` a loss reads that holds values that are not finite: its name, where (rows counted in
    the whole step), its source and the fix."""
    found = ((i, i.non_finite(batch.first_row)) for i in loss_inputs(batch))
    return [f"the {i.name} ({where}), {i.source}" for i, where in found if where]


def non_finite_step(loss: float, grad_norm: float, found: list[str]) -> NonFiniteLoss:
    """The refusal of a step whose ``loss`` or ``grad_norm`` is not finite; ``found``: the step's inputs that are
    not finite (``non_finite_inputs`` of every rank's share)."""
    if found:
        cause = f"the first input that is not finite is {found[0]}" + "".join(f"; also {f}" for f in found[1:])
    else:
        cause = (
            "every input of the batch is finite, so the policy's own forward or backward overflowed (its weights "
            "grew too large): lower actors.trainer.optimizer.lr, keep optimizer.grad_clip above 0, or set "
            "actors.trainer.precision: fp32, then resume from the last checkpoint"
        )
    return NonFiniteLoss(
        f"the step's loss is {loss} and its gradient norm {grad_norm}, so the optimizer did not step and the "
        f"weights are the last step's; {cause}"
    )


def loss_inputs(batch: TrainBatch) -> list[LossInput]:
    """The numbers of ``batch`` a loss reads, in the order it meets them. The sampler's logprobs are
    read as they are only by the replay pairs (the policy loss takes the trainer's own where they are
    not finite), the reference's and the teacher's only at the tokens they score."""
    inputs = [
        LossInput(
            "advantages",
            batch.advantages,
            batch.policy_rows,
            "made from the step's rewards; a reward function's or a task's is refused where it is made (and a "
            "checkpoint's when it is resumed), so look at the environment's episode returns",
        )
    ]
    if batch.pairs is not None:
        in_pairs = torch.zeros(len(batch), dtype=torch.bool, device=batch.pairs.device)
        paired = batch.pairs.flatten() - batch.first_row
        in_pairs[paired[(paired >= 0) & (paired < len(batch))]] = True
        inputs.append(
            LossInput(
                "old (sampling) logprobs",
                batch.inference_logprobs,
                batch.completion_mask & in_pairs[:, None],
                "which the generator's engine returned with the replayed traces (actors.generator.engine)",
            )
        )
    if batch.ref_logprobs is not None:
        inputs.append(
            LossInput(
                "reference logprobs",
                batch.ref_logprobs,
                batch.completion_mask & batch.policy_rows[:, None],
                "which the reference model scored (loss.policy.kl_coef): check its weights (actors.reference.path)",
            )
        )
    if batch.distill_logprobs is not None:
        inputs.append(
            LossInput(
                "teacher logprobs",
                batch.distill_logprobs,
                batch.distill_mask[..., None],
                "the distill teacher's top-k (actors.teachers): check its binding",
                outside_support=True,
            )
        )
    return inputs


def _is_max(name: str) -> bool:
    return name.endswith(f"/{MISMATCH_MAX}")


def _accumulate(totals: dict[str, float], metrics: dict[str, float]) -> None:
    """Sum row-additive metrics; a channel counts as skipped only if every pass skipped it; a maximum
    is the largest of the passes'."""
    for name, value in metrics.items():
        if name.endswith("/skipped"):
            totals[name] = min(totals.get(name, 1.0), value)
        elif _is_max(name):
            totals[name] = max(totals.get(name, 0.0), value)
        else:
            totals[name] = totals.get(name, 0.0) + value
