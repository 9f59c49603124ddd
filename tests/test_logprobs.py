"""Memory-lean logprobs: chunked equals full in value and gradient; gradcheck of both autograd functions."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from losses import fused_linear_loss, selective_logprobs, token_logprobs
from losses.logprobs import RowChunk, row_chunks


def head(generator, tokens=(3, 7), hidden=6, vocab=13, dtype=torch.float64):
    h = torch.randn(*tokens, hidden, generator=generator, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=generator, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, tokens, generator=generator)
    return h, w, targets


@pytest.mark.parametrize("chunk", [1, 4, 21, 1000])
def test_chunked_logprobs_equal_full_logprobs_in_value_and_gradient(chunk, generator):
    h, w, targets = head(generator)
    upstream = torch.randn(targets.shape, generator=generator, dtype=torch.float64)
    full = selective_logprobs(h @ w.T, targets)
    chunked = token_logprobs(h, w, targets, chunk_tokens=chunk)
    assert_close(chunked, full, atol=1e-13, rtol=0)
    grads_full = torch.autograd.grad((full * upstream).sum(), (h, w))
    grads_chunked = torch.autograd.grad((chunked * upstream).sum(), (h, w))
    for a, b in zip(grads_chunked, grads_full):
        assert_close(a, b, atol=1e-13, rtol=0)


def test_logprobs_of_each_rows_own_tokens_only(generator):
    """Given each row's length, the first columns of each row are scored as in full and the rest are 0, with no
    gradient: a short row beside a long one forms no logits at its padding."""
    h, w, targets = head(generator, tokens=(4, 7))
    lengths = [7, 0, 2, 5]
    scored = token_logprobs(h, w, targets, chunk_tokens=3, lengths=lengths)
    full = selective_logprobs(h @ w.T, targets)
    real = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    assert_close(scored[real], full[real], atol=1e-13, rtol=0)
    assert torch.equal(scored[~real], torch.zeros(int((~real).sum()), dtype=scored.dtype))
    upstream = torch.randn(targets.shape, generator=generator, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((scored * upstream).sum(), (h, w)),
                    torch.autograd.grad((torch.where(real, full, 0.0) * upstream).sum(), (h, w))):
        assert_close(a, b, atol=1e-13, rtol=0)


def test_chunked_logprobs_fp32_and_bf16(generator):
    h, w, targets = head(generator, dtype=torch.float32)
    assert_close(token_logprobs(h, w, targets, 5), selective_logprobs(h @ w.T, targets), atol=1e-5, rtol=1e-5)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    out = token_logprobs(hb, wb, targets, 5)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(hb.grad.float()).all()
    assert_close(out, selective_logprobs(hb @ wb.T, targets), atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradcheck(generator):
    h, w, targets = head(generator, tokens=(2, 3), hidden=4, vocab=5)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, targets, chunk_tokens=4), (h, w))


def test_selective_logprobs_matches_log_softmax_and_gradchecks(generator):
    h, w, targets = head(generator, tokens=(2, 3), hidden=4, vocab=5)
    logits = (h @ w.T).detach().requires_grad_()
    assert_close(
        selective_logprobs(logits, targets), torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    )
    assert torch.autograd.gradcheck(lambda z: selective_logprobs(z, targets), (logits,))


def test_token_logprobs_with_frozen_head(generator):
    h, w, targets = head(generator)
    w = w.detach()
    token_logprobs(h, w, targets, 4).sum().backward()
    assert h.grad is not None and w.grad is None


def softmax_entropy_rows(logits, chunk):
    """A row-separable loss that depends on every logit (not only the targets)."""
    logp = torch.log_softmax(logits, -1)
    return (logp.exp() * logp).sum() / 21.0, {"sum": logits.detach().sum()}


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 5])
def test_fused_linear_loss_equals_the_unfused_loss(rows_per_chunk, generator):
    h, w, _ = head(generator)
    fused, metrics = fused_linear_loss(h, w, softmax_entropy_rows, rows_per_chunk * h.shape[1])
    plain, plain_metrics = softmax_entropy_rows(h @ w.T, RowChunk(slice(None), h.shape[1]))
    assert_close(fused, plain, atol=1e-13, rtol=0)
    assert_close(metrics["sum"], plain_metrics["sum"])
    for a, b in zip(torch.autograd.grad(3 * fused, (h, w)), torch.autograd.grad(3 * plain, (h, w))):
        assert_close(a, b, atol=1e-13, rtol=0)


def test_fused_linear_loss_gradcheck(generator):
    h, w, _ = head(generator, tokens=(3, 2), hidden=4, vocab=5)
    assert torch.autograd.gradcheck(lambda h, w: fused_linear_loss(h, w, softmax_entropy_rows, 4)[0], (h, w))


@pytest.mark.parametrize("chunk_tokens", [1, 9, 14, 1000])
def test_rows_of_mixed_lengths_form_logits_for_their_own_columns_only(chunk_tokens, generator):
    """A loss that reads each row's first ``lengths`` columns: chunked longest first, each chunk as wide as its
    longest row, it equals the loss over every column in value and gradient, and no chunk is wider than its rows
    need (nor holds more than ``chunk_tokens`` logits, unless one row is wider)."""
    h, w, _ = head(generator, tokens=(6, 7))
    lengths = [7, 1, 3, 7, 2, 5]
    read = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]

    def masked_entropy(logits, chunk):
        logp = torch.log_softmax(logits, -1)
        return torch.where(read[chunk.rows, : chunk.width, None], logp.exp() * logp, 0.0).sum(), {}

    chunks = row_chunks(lengths, chunk_tokens)
    widths = [max(lengths[r] for r in torch.arange(6)[chunk.rows].tolist()) for chunk in chunks]
    assert [chunk.width for chunk in chunks] == widths
    assert all(chunk.width * len(torch.arange(6)[chunk.rows]) <= max(chunk_tokens, chunk.width) for chunk in chunks)
    assert sorted(r for chunk in chunks for r in torch.arange(6)[chunk.rows].tolist()) == list(range(6))
    fused, _ = fused_linear_loss(h, w, masked_entropy, chunk_tokens, lengths)
    plain, _ = masked_entropy(h @ w.T, RowChunk(slice(None), 7))
    assert_close(fused, plain, atol=1e-13, rtol=0)
    for a, b in zip(torch.autograd.grad(fused, (h, w)), torch.autograd.grad(plain, (h, w))):
        assert_close(a, b, atol=1e-13, rtol=0)
    assert row_chunks([4] * 6, 8) == [RowChunk(slice(0, 2), 4), RowChunk(slice(2, 4), 4), RowChunk(slice(4, 6), 4)]


def test_selective_logprobs_backward_twice_on_a_kept_graph(generator):
    """Backward scales the saved exponentials in place only when the graph is not kept."""
    h, w, targets = head(generator)
    logits = (h @ w.T).detach().requires_grad_()
    out = selective_logprobs(logits, targets).sum()
    first = torch.autograd.grad(out, logits, retain_graph=True)[0]
    assert_close(torch.autograd.grad(out, logits)[0], first, atol=0, rtol=0)
