"""Attention over packed rows whose cost follows each row, not its lane, with sliding windows kept.

Packed rows (``actors/models/packing.py``) sit side by side in lanes; a token may see only its own row's earlier
tokens and its prompt's. Two ways to say that to SDPA, picked per pass:

- ``dense``: a boolean ``[lanes, 1, L, L]`` mask, one SDPA call per layer over every lane. For short lanes it is the
  fastest on a CPU, where a call's fixed cost outweighs the masked-out work; packing keeps such lanes short.
- ``by rows``: one lane of one prompt and its rows (a unit too long for a dense lane), attended piece by piece: the
  prompt over itself, then each row over its prompt and itself, each a causal SDPA call whose queries are the row's
  last keys. No tensor of the lane's length squared exists: a piece's mask is at most ``MASK_ELEMENTS`` (or a
  window's band per block of ``BLOCK`` queries), else SDPA's own causal kernel runs without one.

A layer with a sliding window of ``w`` (Mistral, Qwen2's ``use_sliding_window``, Gemma 2/3) lets a query see only
keys less than ``w`` positions before it; both ways apply it, from the tokens' positions in their own rows, so packed
rows are scored as the model scores each row alone. Hugging Face models reach this through an attention function
registered as ``ROW_ATTENTION`` (``rows_attention_of`` switches a model's config to it for a packed pass); the
torchtitan loop calls ``PackedAttention.attend`` from its own attention module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_ATTENTION = "mesh_rows"  # the Hugging Face attention implementation name of packed passes
MASK_ELEMENTS = 1 << 22  # the largest mask of one causal piece; past it the piece runs SDPA's causal kernel unmasked
BLOCK = 1024  # queries per SDPA call of a sliding-window piece (its band's mask is BLOCK x (BLOCK + window))


@dataclass(frozen=True)
class Unit:
    """A prompt's span of a by-rows lane and the spans of the rows that follow it, ``(start, end)`` each."""

    prompt: tuple[int, int]
    rows: tuple[tuple[int, int], ...]


@dataclass
class PackedAttention:
    """Which keys each query of one pass's lanes sees: a dense mask (``visible``) or, for a single by-rows lane, its
    ``units``. ``positions`` (``[lanes, L]``, each token's place in its own row) bound sliding windows."""

    positions: Tensor
    visible: Tensor | None = None  # [lanes, 1, L, L] bool
    units: tuple[Unit, ...] | None = None
    _windowed: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, window: int | None = None) -> Tensor:
        """SDPA over ``[lanes, heads, L, dim]`` queries, keys and values (fewer key heads: grouped-query), each query
        over what it sees, within ``window`` positions when the layer has one."""
        if self.visible is not None:
            return _sdpa(q, k, v, self._mask(window), scale)
        assert self.units is not None and q.shape[0] == 1, "a by-rows pass holds one lane"
        pieces = []
        for unit in self.units:
            start, end = unit.prompt
            prompt_k, prompt_v = k[:, :, start:end], v[:, :, start:end]
            pieces.append(_causal(q[:, :, start:end], prompt_k, prompt_v, scale, window))
            for row_start, row_end in unit.rows:
                if row_end > row_start:
                    keys = torch.cat([prompt_k, k[:, :, row_start:row_end]], dim=2)
                    values = torch.cat([prompt_v, v[:, :, row_start:row_end]], dim=2)
                    pieces.append(_causal(q[:, :, row_start:row_end], keys, values, scale, window))
        return torch.cat(pieces, dim=2)

    def to(self, device: torch.device) -> PackedAttention:
        visible = None if self.visible is None else self.visible.to(device)
        return PackedAttention(self.positions.to(device), visible, self.units)

    def _mask(self, window: int | None) -> Tensor:
        """The dense mask, and for a window the keys fewer than ``window`` positions back (a padding query's one key,
        itself, is 0 back)."""
        if window is None:
            return self.visible
        if window not in self._windowed:
            back = self.positions[:, :, None] - self.positions[:, None, :]
            self._windowed[window] = self.visible & (back < window)[:, None]
        return self._windowed[window]


def _causal(q: Tensor, k: Tensor, v: Tensor, scale: float | None, window: int | None) -> Tensor:
    """Queries that are the last ``len(q)`` of ``k``'s tokens, each seeing the keys at or before it (within
    ``window``)."""
    queries, keys = q.shape[2], k.shape[2]
    back = keys - queries  # the keys before the first query
    if window is None or window >= keys:
        if back == 0:
            return _sdpa(q, k, v, None, scale, causal=True)
        if queries * keys <= MASK_ELEMENTS:
            return _sdpa(q, k, v, _band(queries, keys, back, None, q.device), scale)
        # the prompt's queries too, under SDPA's own causal kernel: no mask, their outputs dropped
        full = torch.cat([q.new_zeros(q.shape[0], q.shape[1], back, q.shape[3]), q], dim=2)
        return _sdpa(full, k, v, None, scale, causal=True)[:, :, back:]
    out = []
    for first in range(0, queries, BLOCK):
        last = min(first + BLOCK, queries)
        key_end = back + last
        key_start = max(0, back + first - window + 1)
        mask = _band(last - first, key_end - key_start, back + first - key_start, window, q.device)
        out.append(_sdpa(q[:, :, first:last], k[:, :, key_start:key_end], v[:, :, key_start:key_end], mask, scale))
    return torch.cat(out, dim=2)


def _band(queries: int, keys: int, back: int, window: int | None, device: torch.device) -> Tensor:
    """``[queries, keys]``: query i (the key ``back + i``) sees key j at or before it, fewer than ``window`` back."""
    distance = torch.arange(queries, device=device)[:, None] + back - torch.arange(keys, device=device)[None, :]
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, causal: bool = False) -> Tensor:
    """SDPA with grouped-query heads as Hugging Face's SDPA attention runs it (key and value heads repeated under a
    mask, SDPA's own grouping without one), so a dense pass computes what the model's own attention did to the bit."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and mask is not None:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1 and mask is None
    )


# -- Hugging Face models ------------------------------------------------------------------------------------------


def _hf_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, dropout: float = 0.0,
    scaling: float | None = None, sliding_window: int | None = None, packed_attention: PackedAttention | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """A Hugging Face attention function: packed passes through ``PackedAttention``; any other call (a generator's
    sampling while a pass runs) as SDPA's own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_attention is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
            **kwargs,
        )
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            "this model's attention has sinks or a logit soft-cap, which packed rows' attention "
            "(actors/models/attention.py) does not compute; train a model without them"
        )
    out = packed_attention.attend(query, key, value, scaling, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROW_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


@contextmanager
def rows_attention_of(config) -> Iterator[None]:
    """A Hugging Face model (by its ``config``) attending through ``_hf_attention`` while the body runs."""
    check_attention(config)
    _register()
    before = config._attn_implementation
    config._attn_implementation = ROW_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def check_attention(config) -> None:
    """Refuse a model whose attention packed rows would compute otherwise than the model does: chunked attention
    (Llama 4's ``attention_chunk_size``)."""
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"the model ({config.model_type}) attends in chunks of {config.attention_chunk_size} tokens, which the "
            "trainer's packed rows (actors/models/attention.py) do not compute, so its rows would be scored over "
            "more than the model sees; train a model without attention_chunk_size"
        )
