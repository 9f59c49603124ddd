"""A micro-batch's rows packed for one forward pass: each shared prompt once, and no padding between rows.

The rows of a GRPO group share their prompt, and a padded batch pays for that prompt once per row and for every
row up to the longest. Packed, the rows become one token sequence (a lane): each distinct prompt once, followed by
the completions of the rows that share it. Every token attends only to its own row's tokens, its prompt and the
completion up to itself, at the position it has in its row, so each completion token is predicted exactly as in its
own row, and the gradient that reaches a shared prompt is the sum of its rows'. The states that predict the
completion tokens are gathered back into the batch's ``[rows, T]`` layout, where the loss kernels read them::

    rows (padded)          one lane                               positions    what b's tokens see
    . p p p a a a .        p p p a a a b b c c c c                0 1 2 3 4 5  the prompt p, and b
    . p p p b b . .                                               3 4
    . p p p c c c c                                               3 4 5 6

A lane holds up to ``LANE_TOKENS`` tokens, since its attention mask is a square of its length; more rows take more
lanes, filled first-fit-decreasing by whole prompts with their rows (a prompt whose rows overflow a lane is
repeated in the next). Lanes are padded to the longest, and a padding token sees only itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module

LANE_TOKENS = 2048


@dataclass(frozen=True)
class PackedRows:
    """The model's inputs for packed rows, and where each row's completion is predicted."""

    input_ids: Tensor  # [lanes, L] long
    position_ids: Tensor  # [lanes, L] long, each token's position in its own row
    visible: Tensor  # [lanes, 1, L, L] bool, the keys each query attends to
    predicting: Tensor  # [rows, T] long, lane * L + place of the state that predicts each completion token

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> Tensor:
        """``visible`` as a Hugging Face model with this attention ``implementation`` takes a ready 4-D mask: SDPA's
        as booleans, eager attention's added to the scores."""
        if implementation == "sdpa":
            return self.visible
        if implementation == "eager":
            blocked = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            return blocked.masked_fill_(~self.visible, torch.finfo(dtype).min)
        raise ValueError(
            f"the trainer packs a micro-batch's rows into lanes with a 4-D attention mask, which the model's attention "
            f"implementation {implementation!r} does not take; load the model with attn_implementation 'sdpa' "
            "(its config.json's _attn_implementation, or remove that key)"
        )

    def gather(self, states: Tensor) -> Tensor:
        """``[lanes, L, ...]`` states as the rows' ``[rows, T, ...]``: the state that predicts each completion token
        (at a row's padding, the lane's first: the loss masks it)."""
        return states.flatten(0, 1)[self.predicting]


@dataclass(frozen=True)
class _Unit:
    """A prompt and the rows that share it, placed in one lane together."""

    prompt: tuple[Tensor, Tensor]  # its tokens and their positions
    rows: list[int]
    completions: list[tuple[Tensor, Tensor]]

    @property
    def tokens(self) -> int:
        return len(self.prompt[0]) + sum(len(ids) for ids, _ in self.completions)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int) -> PackedRows:
    """Pack rows laid out as a ``TrainBatch``'s (prompts left-padded to ``prompt_len``, completions right-padded after
    it; ``attention_mask`` marks the real tokens, ``position_ids`` their positions)."""
    real = attention_mask.bool()
    rows, width = input_ids.shape[0], input_ids.shape[1] - prompt_len
    lanes = _lanes(_units(input_ids, real, position_ids, prompt_len))
    length = max(sum(unit.tokens for unit in lane) for lane in lanes)
    ids = torch.zeros(len(lanes), length, dtype=torch.long)
    positions = torch.zeros_like(ids)
    unit_of = torch.full_like(ids, -1)  # -1: padding
    owner = torch.full_like(ids, -1)  # the row a completion token belongs to; -1: a prompt's (shared) or padding
    predicting = torch.zeros(rows, width, dtype=torch.long)
    for lane, units in enumerate(lanes):
        place = 0
        for number, unit in enumerate(units):
            prompt_ids, prompt_positions = unit.prompt
            end = place + len(prompt_ids)
            ids[lane, place:end], positions[lane, place:end], unit_of[lane, place:end] = prompt_ids, prompt_positions, number
            last_prompt = lane * length + end - 1
            place = end
            for row, (completion, completion_positions) in zip(unit.rows, unit.completions):
                end = place + len(completion)
                ids[lane, place:end], positions[lane, place:end] = completion, completion_positions
                unit_of[lane, place:end], owner[lane, place:end] = number, row
                if len(completion):
                    predicting[row, 0] = last_prompt
                    predicting[row, 1 : len(completion)] = torch.arange(place, end - 1) + lane * length
                place = end
    return PackedRows(ids.to(input_ids.device), positions.to(input_ids.device),
                      _visible(unit_of, owner).to(input_ids.device), predicting.to(input_ids.device))


def _units(input_ids: Tensor, real: Tensor, position_ids: Tensor, prompt_len: int) -> list[_Unit]:
    """The rows grouped by their prompt's tokens, in the order each prompt first appears."""
    ids, real, position_ids = input_ids.cpu(), real.cpu(), position_ids.cpu()
    units: dict[bytes, _Unit] = {}
    for row in range(ids.shape[0]):
        in_prompt, in_completion = real[row, :prompt_len], real[row, prompt_len:]
        prompt = (ids[row, :prompt_len][in_prompt], position_ids[row, :prompt_len][in_prompt])
        if len(prompt[0]) == 0:
            raise ValueError(f"row {row} has no prompt token, so nothing predicts its completion's first token")
        completion = (ids[row, prompt_len:][in_completion], position_ids[row, prompt_len:][in_completion])
        unit = units.setdefault(prompt[0].numpy().tobytes(), _Unit(prompt, [], []))
        unit.rows.append(row)
        unit.completions.append(completion)
    return list(units.values())


def _lanes(units: list[_Unit]) -> list[list[_Unit]]:
    """The units first-fit-decreasing into lanes of ``LANE_TOKENS``, a unit too long for one split by its rows."""
    pieces = [piece for unit in units for piece in _split(unit)]
    lanes: list[list[_Unit]] = []
    for piece in sorted(pieces, key=lambda unit: -unit.tokens):
        lane = next((lane for lane in lanes if sum(u.tokens for u in lane) + piece.tokens <= LANE_TOKENS), None)
        if lane is None:
            lanes.append([piece])
        else:
            lane.append(piece)
    return lanes


def _split(unit: _Unit) -> list[_Unit]:
    """``unit`` in pieces that each fit a lane, the prompt in each (a row longer than a lane is a piece alone)."""
    pieces: list[_Unit] = []
    for row, completion in zip(unit.rows, unit.completions):
        last = pieces[-1] if pieces else None
        if last is None or last.tokens + len(completion[0]) > LANE_TOKENS:
            last = _Unit(unit.prompt, [], [])
            pieces.append(last)
        last.rows.append(row)
        last.completions.append(completion)
    return pieces


def _visible(unit_of: Tensor, owner: Tensor) -> Tensor:
    """Query i sees key j at or before it in the same unit, where j is the unit's prompt or i's own row; a padding
    query sees itself only, so no query's attention is empty."""
    length = unit_of.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same_unit = (unit_of[:, :, None] == unit_of[:, None, :]) & (unit_of[:, None, :] >= 0)
    same_row = (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])
    visible = causal & same_unit & same_row
    visible |= torch.eye(length, dtype=torch.bool)
    return visible[:, None]


def packed_states(model: Module, packed: PackedRows) -> Tensor:
    """A Hugging Face causal LM's last hidden states that predict each packed row's completion tokens,
    ``[rows, T, hidden]``, from one pass of its decoder (the LM head is the caller's: it may need only some)."""
    mask = packed.attention_mask(model.config._attn_implementation, model.dtype)
    out = model.get_decoder()(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids)
    return packed.gather(out.last_hidden_state)
