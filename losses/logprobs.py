"""Memory-lean log-probabilities: never materialize ``[tokens x vocab]`` logits whole.

Two tools, for two situations:

- ``token_logprobs(hidden, weight, targets)``: the log-probabilities of given tokens as
  an ordinary tensor, for any downstream code. Logits exist one token chunk at a time;
  backward recomputes them chunk by chunk from the saved log-normalizers.
- ``fused_linear_loss(hidden, weight, loss_fn, chunk_tokens, lengths)``: for a loss that is a sum over rows
  (every loss in this library, given global ``Counts``). Each row chunk's logits are
  formed once, the loss and its gradients w.r.t. ``hidden`` and ``weight`` are taken
  right there (as Liger-Kernel does), and backward only scales them. Same matmul FLOPs as
  the naive path (three GEMMs per chunk), a fraction of its memory. Given each row's
  ``lengths`` (the columns its loss reads), rows are chunked longest first and each chunk
  is only as wide as its longest row: rows of mixed lengths (an agent's long episode beside
  short ones) form logits for their own tokens, not for the batch's longest row.

Every GEMM takes its operands in the input dtype (bf16 stays bf16, for the tensor cores);
softmax and loss math run in at least fp32, and the weight gradient, summed over chunks,
accumulates in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in at least fp32 and ``a``, ``b`` in their own dtype.

    A weight gradient summed over many chunks needs fp32 accumulation, but its GEMM should
    run on bf16 operands: CUDA does both at once (``out_dtype``: bf16 inputs, fp32 sums,
    fp32 ``acc`` updated in place). Where that kernel is missing (CPU; an older PyTorch) the
    operands are upcast, which gives the same sums more slowly.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _sums_narrow_products(acc.device, a.dtype, acc.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@functools.cache
def _sums_narrow_products(device: torch.device, operands: torch.dtype, sums: torch.dtype) -> bool:
    """Whether ``addmm`` on ``device`` takes ``operands``-dtype matrices into a ``sums``-dtype
    accumulator in place (``out_dtype``); tried once on 1x1 tensors."""
    acc = torch.zeros(1, 1, dtype=sums, device=device)
    one = torch.ones(1, 1, dtype=operands, device=device)
    try:
        torch.addmm(acc, one, one, out_dtype=sums, out=acc)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return acc.item() == 1.0


def _logprob_grad(logits: Tensor, targets: Tensor, log_norm: Tensor, grad_out: Tensor) -> Tensor:
    """``grad_out * (onehot(targets) - softmax(logits))``: the one ``[N, V]`` tensor a backward needs."""
    g = grad_out.unsqueeze(-1).to(log_norm.dtype)
    grad = (logits.to(log_norm.dtype) - log_norm.unsqueeze(-1)).exp_().mul_(-g)
    return grad.scatter_add_(-1, targets.unsqueeze(-1), g)


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``, gradcheck): then saved
    tensors may be read again and must not be overwritten (AOTAutograd asks the same)."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def scale_to(values: Tensor, scale: Tensor, dtype: torch.dtype, in_place: bool) -> Tensor:
    """``values * scale`` in ``dtype``: in place when allowed and the dtype matches, else one pass
    that writes the (narrower) dtype directly, so a bf16 gradient never exists in fp32 as well."""
    if in_place and values.dtype == dtype:
        return values.mul_(scale)
    return torch.mul(values, scale, out=torch.empty_like(values, dtype=dtype))


def _weighted_logits(weights: Tensor, logits: Tensor, rows_per_block: int = 256) -> Tensor:
    """``sum_v weights * logits`` per row (``[N, V]`` each; ``weights`` in at least fp32): a
    row-wise dot product, so no ``[N, V]`` product is ever written (logits of a narrower
    dtype are upcast a block of rows at a time)."""
    if logits.dtype == weights.dtype:
        return torch.bmm(weights.unsqueeze(-2), logits.unsqueeze(-1)).reshape(weights.shape[0])
    sums = weights.new_empty(weights.shape[0])
    for start in range(0, weights.shape[0], rows_per_block):
        block = slice(start, start + rows_per_block)
        sums[block] = _weighted_logits(weights[block], logits[block].to(weights.dtype))
    return sums


def _entropy(logits: Tensor, unnormalized: Tensor, peak: Tensor, total: Tensor) -> Tensor:
    """``-sum p log p = log Z - E_p[logits]`` from the forward's ``exp(logits - peak)`` and its row
    sums ``total`` (``Z = total * exp(peak)``): a dot product per row, not another ``exp`` pass."""
    flat = unnormalized.reshape(-1, unnormalized.shape[-1])
    expected = _weighted_logits(flat, logits.reshape(flat.shape)).reshape(total.shape) / total
    return (peak + total.log() - expected).squeeze(-1)


class _SelectiveLogprobs(torch.autograd.Function):
    """One ``exp`` pass over the logits serves the logprobs, their gradient and (when asked) the
    entropy: forward keeps the unnormalized ``exp(logits - max)`` (in at least fp32) and
    backward only scales it. The entropy is for logging: it carries no gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        acc = _accumulation_dtype(logits.dtype)
        peak = logits.amax(-1, keepdim=True).to(acc)
        unnormalized = (logits - peak).exp_()  # the upcast rides on the subtraction
        total = unnormalized.sum(-1, keepdim=True)
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).to(acc) - peak - total.log()
        ctx.save_for_backward(unnormalized, total, targets, logprobs)
        ctx.dtype = logits.dtype
        entropy = _entropy(logits.detach(), unnormalized, peak, total) if with_entropy else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logprobs.squeeze(-1), entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _: Tensor | None):
        unnormalized, total, targets, logprobs = ctx.saved_tensors
        g = grad_out.unsqueeze(-1).to(total.dtype)
        grad = scale_to(unnormalized, -g / total, ctx.dtype, in_place=not backward_keeps_graph())
        # The target's entry g * (1 - p) from expm1, exact where p is near 1 (unlike g - g * p in bf16).
        return grad.scatter_(-1, targets.unsqueeze(-1), (-g * torch.expm1(logprobs)).to(ctx.dtype)), None, None


def selective_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log_softmax(logits)[targets]`` in at least fp32; the gradient comes in the logits' dtype.

    Keeps one logits-sized tensor between forward and backward and makes none in backward
    (for fp32 logits), where ``log_softmax`` + ``gather`` keep three.
    """
    return _SelectiveLogprobs.apply(logits, targets, False)[0]


def selective_logprobs_and_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``selective_logprobs`` and each position's entropy (detached), from the same ``exp`` pass."""
    return _SelectiveLogprobs.apply(logits, targets, True)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        acc = _accumulation_dtype(hidden.dtype)
        logprobs = hidden.new_empty(hidden.shape[0], dtype=acc)
        log_norm = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.T).to(acc)
            peak = logits.amax(-1, keepdim=True)
            unnormalized = (logits - peak).exp_()
            total = unnormalized.sum(-1, keepdim=True)
            log_norm[rows] = (peak + total.log()).squeeze(-1)
            logprobs[rows] = logits.gather(1, targets[rows, None]).squeeze(1) - log_norm[rows]
            if entropy is not None:
                entropy[rows] = _entropy(logits, unnormalized, peak, total)
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.chunk = chunk
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _: Tensor | None):
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
                _add_product(grad_weight, grad_logits.T, hidden[rows])
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 512, lengths: list[int] | None = None
) -> Tensor:
    """``log_softmax(hidden @ weight.T)[targets]`` with ``[chunk_tokens x V]`` peak temporaries.

    ``hidden`` is ``[..., H]``, ``weight`` the LM head ``[V, H]``, ``targets`` ``[...]``;
    returns ``[...]`` in at least fp32. ``lengths``: for ``[B, T]`` targets, each row's first columns to score
    (its real tokens, known on the host); the rest come back 0 and cost nothing.
    """
    if lengths is None:
        return _token_logprobs(hidden, weight, targets, chunk_tokens, with_entropy=False)[0]
    width = targets.shape[1]
    places = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).flatten().nonzero().flatten()
    places = places.to(targets.device)
    scored = _token_logprobs(hidden.flatten(0, 1)[places], weight, targets.flatten()[places], chunk_tokens, False)[0]
    return scored.new_zeros(targets.numel()).index_copy(0, places, scored).view(targets.shape)


def token_logprobs_and_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 512
) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` and each position's entropy (detached), chunk by chunk alike."""
    return _token_logprobs(hidden, weight, targets, chunk_tokens, with_entropy=True)


def _token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, with_entropy: bool):
    flat = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _TokenLogprobs.apply(flat, weight, targets.reshape(-1), chunk_tokens, with_entropy)
    return logprobs.reshape(targets.shape), None if entropy is None else entropy.reshape(targets.shape)


def token_entropy(logits: Tensor) -> Tensor:
    """Each position's entropy ``-sum_v p log p`` of ``softmax(logits)``, differentiable (the
    entropy bonus): ``[..., V] -> [...]`` in at least fp32, with ``log_softmax``'s temporaries."""
    log_p = logits.to(_accumulation_dtype(logits.dtype)).log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


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


@dataclass(frozen=True)
class RowChunk:
    """Some rows of ``[B, T, ...]`` inputs (``rows``: a slice, or an index of rows) and the first ``width`` of their
    columns, which hold every token the loss reads in them."""

    rows: slice | Tensor
    width: int


RowLoss = Callable[[Tensor, RowChunk], tuple[Tensor, dict[str, Tensor]]]


def row_chunks(lengths: list[int], chunk_tokens: int, device: torch.device | None = None) -> list[RowChunk]:
    """Rows whose loss reads their first ``lengths`` columns, in chunks of about ``chunk_tokens`` logits: longest
    first (rows of one length keep their order), each chunk as wide as its longest row, and a row wider than
    ``chunk_tokens`` a chunk alone. Rows all of one length give consecutive chunks of ``chunk_tokens // length``."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    chunks, start = [], 0
    while start < len(order):
        width = max(lengths[order[start]], 1)
        members = order[start : start + max(1, chunk_tokens // width)]
        consecutive = members == list(range(members[0], members[0] + len(members)))
        index = slice(members[0], members[0] + len(members)) if consecutive else torch.tensor(members, device=device)
        chunks.append(RowChunk(index, width))
        start += len(members)
    return chunks


def _chunk_loss(
    chunk_hidden: Tensor, weight: Tensor, loss_fn: RowLoss, chunk: RowChunk, grad_hidden: Tensor, grad_weight: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """One chunk's loss, with its gradients added to the buffers: its own function so that every
    chunk-sized tensor is released when the chunk ends, not when the next one overwrites it."""
    logits = (chunk_hidden @ weight.T).requires_grad_()
    with torch.enable_grad():
        loss, metrics = loss_fn(logits, chunk)
    if loss.requires_grad:
        (grad_logits,) = torch.autograd.grad(loss, logits)  # in the logits' (input) dtype
        del logits
        grad_hidden[chunk.rows, : chunk.width] = grad_logits @ weight
        _add_product(grad_weight, grad_logits.flatten(0, -2).T, chunk_hidden.flatten(0, -2))
    return loss.detach(), {name: value.detach() for name, value in metrics.items()}


def fused_linear_loss(
    hidden: Tensor, weight: Tensor, loss_fn: RowLoss, chunk_tokens: int, lengths: list[int] | None = None,
    maxima: Collection[str] = (),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Evaluate a row-separable loss of ``logits = hidden @ weight.T`` chunk by chunk (``row_chunks``).

    ``hidden`` is ``[B, T, H]``; ``loss_fn(logits, chunk)`` returns the chunk's rows' share of the loss and of
    row-additive metrics, its logits ``[rows, chunk.width, V]``. ``lengths``: the columns each row's loss reads
    (None: all ``T``); the columns after them get no logits and no gradient. The chunks' metrics add up, but those
    named in ``maxima``, which are the largest of the chunks'. Whatever else ``loss_fn`` reads must carry no
    gradient: only ``hidden`` and ``weight`` receive one.
    """
    acc = _accumulation_dtype(weight.dtype)
    grad_hidden = torch.zeros_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    metrics: dict[str, Tensor] = {}
    with torch.no_grad():
        width = hidden.shape[1]
        for chunk in row_chunks([width] * hidden.shape[0] if lengths is None else lengths, chunk_tokens, hidden.device):
            chunk_hidden = hidden[chunk.rows, : chunk.width].detach().contiguous()  # one GEMM over its tokens
            loss, chunk_metrics = _chunk_loss(chunk_hidden, weight.detach(), loss_fn, chunk, grad_hidden, grad_weight)
            total += loss
            for name, value in chunk_metrics.items():
                if name not in metrics:
                    metrics[name] = value
                else:
                    metrics[name] = torch.maximum(metrics[name], value) if name in maxima else metrics[name] + value
    if hidden.requires_grad or weight.requires_grad:
        total = _PrecomputedGrad.apply(total, hidden, weight, grad_hidden, grad_weight.to(weight.dtype))
    return total, metrics
