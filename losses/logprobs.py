"""Memory-lean log-probabilities: never materialize ``[tokens x vocab]`` logits whole.

Two tools, for two situations:

- ``token_logprobs(hidden, weight, targets)``: the log-probabilities of given tokens as
  an ordinary tensor, for any downstream code. Logits exist one token chunk at a time;
  backward recomputes them chunk by chunk from the saved log-normalizers.
- ``fused_linear_loss(hidden, weight, loss_fn)``: for a loss that is a sum over rows
  (every loss in this library, given global ``Counts``). Each row chunk's logits are
  formed once, the loss and its gradients w.r.t. ``hidden`` and ``weight`` are taken
  right there (as Liger-Kernel does), and backward only scales them. Same matmul FLOPs as
  the naive path, a fraction of its memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _logprob_grad(logits: Tensor, targets: Tensor, log_norm: Tensor, grad_out: Tensor) -> Tensor:
    """``grad_out * (onehot(targets) - softmax(logits))``: the one ``[N, V]`` tensor a backward needs."""
    g = grad_out.unsqueeze(-1).to(log_norm.dtype)
    grad = (logits.to(log_norm.dtype) - log_norm.unsqueeze(-1)).exp_().mul_(-g)
    return grad.scatter_add_(-1, targets.unsqueeze(-1), g)


class _SelectiveLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:
        log_norm = torch.logsumexp(logits.to(_accumulation_dtype(logits.dtype)), dim=-1)
        ctx.save_for_backward(logits, targets, log_norm)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).to(log_norm.dtype) - log_norm

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, log_norm = ctx.saved_tensors
        return _logprob_grad(logits, targets, log_norm, grad_out).to(logits.dtype), None


def selective_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[targets]`` in at least fp32.

    Saves only the log-normalizer beside the logits, so backward forms one logits-sized
    tensor where ``log_softmax`` + ``gather`` keep three.
    """
    return _SelectiveLogprobs.apply(logits, targets)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        acc = _accumulation_dtype(hidden.dtype)
        logprobs = hidden.new_empty(hidden.shape[0], dtype=acc)
        log_norm = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.T).to(acc)
            log_norm[rows] = torch.logsumexp(logits, dim=-1)
            logprobs[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - log_norm[rows]
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.chunk = chunk
        return logprobs

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets, log_norm = ctx.saved_tensors
        acc = log_norm.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = hidden[rows] @ weight.T
            grad_logits = _logprob_grad(logits, targets[rows], log_norm[rows], grad_out[rows]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T.to(acc), hidden[rows].to(acc))
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 512) -> Tensor:
    """``log_softmax(hidden @ weight.T)[targets]`` with ``[chunk_tokens x V]`` peak temporaries.

    ``hidden`` is ``[..., H]``, ``weight`` the LM head ``[V, H]``, ``targets`` ``[...]``;
    returns ``[...]`` in at least fp32.
    """
    flat = _TokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_tokens)
    return flat.reshape(targets.shape)


class _PrecomputedGrad(torch.autograd.Function):
    """A scalar whose gradients w.r.t. ``hidden`` and ``weight`` are already known."""

    @staticmethod
    def forward(ctx, value, hidden, weight, grad_hidden, grad_weight):
        ctx.save_for_backward(grad_hidden, grad_weight)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_out.item() != 1.0:  # the usual loss.backward() needs no [V, H]-sized copy
            grad_hidden = grad_hidden * grad_out.to(grad_hidden.dtype)
            grad_weight = grad_weight * grad_out.to(grad_weight.dtype)
        return None, grad_hidden, grad_weight, None, None


RowLoss = Callable[[Tensor, slice], tuple[Tensor, dict[str, Tensor]]]


def fused_linear_loss(
    hidden: Tensor, weight: Tensor, loss_fn: RowLoss, rows_per_chunk: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """Evaluate a row-separable loss of ``logits = hidden @ weight.T`` chunk by chunk.

    ``hidden`` is ``[B, T, H]``; ``loss_fn(logits_rows, rows)`` returns the rows' share of
    the loss and of row-additive metrics. Whatever else ``loss_fn`` reads must carry no
    gradient: only ``hidden`` and ``weight`` receive one.
    """
    acc = _accumulation_dtype(weight.dtype)
    grad_hidden = torch.zeros_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        flat_weight = weight.detach()
        for start in range(0, hidden.shape[0], rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            chunk_hidden = hidden[rows].detach()
            logits = (chunk_hidden @ flat_weight.T).requires_grad_()
            with torch.enable_grad():
                loss, chunk_metrics = loss_fn(logits, rows)
            if loss.requires_grad:
                (grad_logits,) = torch.autograd.grad(loss, logits)
                grad_logits = grad_logits.to(hidden.dtype)
                grad_hidden[rows] = grad_logits @ flat_weight
                grad_weight.addmm_(grad_logits.flatten(0, -2).T.to(acc), chunk_hidden.flatten(0, -2).to(acc))
            total += loss.detach()
            for name, value in chunk_metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value.detach()
    if hidden.requires_grad or weight.requires_grad:
        total = _PrecomputedGrad.apply(total, hidden, weight, grad_hidden, grad_weight.to(weight.dtype))
    return total, metrics
