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

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Module

LANE_TOKENS = 2048  # the most a lane holds: its mask is a square of its length


def lane_tokens(config) -> int:
    """How many tokens a lane holds for a model of this Hugging Face ``config``: half the length at which a token's
    attention over its lane costs as much as its linear layers (about ``2 hidden + 1.5 intermediate``), at most
    ``LANE_TOKENS``. A lane's attention is a square of its length, so a small model's lanes are short: one long
    lane would cost it more than padding its rows."""
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    return min(LANE_TOKENS, (2 * hidden + 3 * inner // 2) // 2)


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


@dataclass
class _Unit:
    """A prompt and the rows that share it, placed in one lane together (plain lists: packing a step's rows is
    bookkeeping, and tensor indexing per row would cost a tiny model more than its forward pass)."""

    prompt: tuple[list[int], list[int]]  # its tokens and their positions
    rows: list[int] = field(default_factory=list)
    completions: list[tuple[list[int], list[int]]] = field(default_factory=list)
    tokens: int = field(init=False)  # the prompt's and the completions' together

    def __post_init__(self) -> None:
        self.tokens = len(self.prompt[0])

    def add(self, row: int, completion: tuple[list[int], list[int]]) -> None:
        self.rows.append(row)
        self.completions.append(completion)
        self.tokens += len(completion[0])


def pack_rows(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, lane: int | None = None
) -> PackedRows:
    """Pack rows laid out as a ``TrainBatch``'s (prompts left-padded to ``prompt_len``, completions right-padded after
    it; ``attention_mask`` marks the real tokens, ``position_ids`` their positions) into lanes of ``lane`` tokens
    (``lane_tokens`` of the model; None: ``LANE_TOKENS``)."""
    rows, width = input_ids.shape[0], input_ids.shape[1] - prompt_len
    lanes = _lanes(_units(input_ids, attention_mask, position_ids, prompt_len), lane or LANE_TOKENS)
    length = max(sum(unit.tokens for unit in lane) for lane in lanes)
    ids, positions = [[0] * length for _ in lanes], [[0] * length for _ in lanes]
    unit_of = [[-1] * length for _ in lanes]  # -1: padding
    owner = [[-1] * length for _ in lanes]  # the row a completion token belongs to; -1: a prompt's (shared) or padding
    predicting = [[0] * width for _ in range(rows)]
    for lane, units in enumerate(lanes):
        place, base = 0, lane * length
        for number, unit in enumerate(units):
            prompt_ids, prompt_positions = unit.prompt
            end = place + len(prompt_ids)
            ids[lane][place:end], positions[lane][place:end] = prompt_ids, prompt_positions
            unit_of[lane][place:end] = [number] * len(prompt_ids)
            last_prompt, place = base + end - 1, end
            for row, (completion, completion_positions) in zip(unit.rows, unit.completions):
                end = place + len(completion)
                ids[lane][place:end], positions[lane][place:end] = completion, completion_positions
                unit_of[lane][place:end], owner[lane][place:end] = [number] * len(completion), [row] * len(completion)
                if completion:
                    predicting[row][: len(completion)] = [last_prompt, *range(base + place, base + end - 1)]
                place = end
    device = input_ids.device
    visible = _visible(torch.tensor(unit_of), torch.tensor(owner))
    return PackedRows(torch.tensor(ids, device=device), torch.tensor(positions, device=device), visible.to(device),
                      torch.tensor(predicting, device=device))


def _units(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int) -> list[_Unit]:
    """The rows grouped by their prompt's tokens, in the order each prompt first appears."""
    ids, real, places = input_ids.tolist(), attention_mask.bool().tolist(), position_ids.tolist()
    units: dict[tuple[int, ...], _Unit] = {}
    for row, (row_ids, row_real, row_places) in enumerate(zip(ids, real, places)):
        kept = [(token, place, column < prompt_len) for column, (token, place, r) in
                enumerate(zip(row_ids, row_places, row_real)) if r]
        prompt = ([t for t, _, first in kept if first], [p for _, p, first in kept if first])
        if not prompt[0]:
            raise ValueError(f"row {row} has no prompt token, so nothing predicts its completion's first token")
        completion = ([t for t, _, first in kept if not first], [p for _, p, first in kept if not first])
        units.setdefault(tuple(prompt[0]), _Unit(prompt)).add(row, completion)
    return list(units.values())


def _lanes(units: list[_Unit], capacity: int) -> list[list[_Unit]]:
    """The units first-fit-decreasing into lanes of ``capacity`` tokens, a unit too long for one split by its rows."""
    pieces = [piece for unit in units for piece in _split(unit, capacity)]
    lanes: list[list[_Unit]] = []
    filled: list[int] = []  # each lane's tokens
    for piece in sorted(pieces, key=lambda unit: -unit.tokens):
        lane = next((i for i, tokens in enumerate(filled) if tokens + piece.tokens <= capacity), None)
        if lane is None:
            lanes.append([piece])
            filled.append(piece.tokens)
        else:
            lanes[lane].append(piece)
            filled[lane] += piece.tokens
    return lanes


def _split(unit: _Unit, capacity: int) -> list[_Unit]:
    """``unit`` in pieces that each fit a lane, the prompt in each (a row longer than a lane is a piece alone)."""
    pieces: list[_Unit] = []
    for row, completion in zip(unit.rows, unit.completions):
        if not pieces or pieces[-1].tokens + len(completion[0]) > capacity:
            pieces.append(_Unit(unit.prompt))
        pieces[-1].add(row, completion)
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


def packed_states(model: Module, sequences) -> Tensor:
    """A Hugging Face causal LM's last hidden states that predict each completion token of ``sequences`` (a
    ``Sequences`` or ``TrainBatch``), ``[rows, T, hidden]``, from one pass of its decoder over the rows packed in lanes
    of its size (the LM head is the caller's: it may need only some)."""
    packed = sequences.packed(lane_tokens(model.config))
    mask = packed.attention_mask(model.config._attn_implementation, model.dtype)
    out = model.get_decoder()(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids)
    return packed.gather(out.last_hidden_state)
