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

A dense lane holds up to ``lane_tokens`` of the model, since its attention mask is a square of its length; more rows
take more lanes, filled first-fit-decreasing by whole prompts with their rows (a prompt whose rows overflow a lane is
repeated in the next). Lanes are padded to the longest, and a padding token sees only itself. The rows that fit no
lane with their prompt (a long agent episode) go, with that prompt once, into a pass of their own attended by rows,
whose cost follows each row's length, not the square of the lane's (``actors/models/attention.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Module

from actors.models.attention import PackedAttention, Unit, rows_attention_of

LANE_TOKENS = 2048  # the most a dense lane holds: its mask is a square of its length


def lane_tokens(config) -> int:
    """How many tokens a dense lane holds for a model of this Hugging Face ``config``: half the length at which a
    token's attention over its lane costs as much as its linear layers (about ``2 hidden + 1.5 intermediate``), at
    most ``LANE_TOKENS``. A dense lane's attention is a square of its length, so a small model's lanes are short."""
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    return min(LANE_TOKENS, (2 * hidden + 3 * inner // 2) // 2)


@dataclass(frozen=True)
class LanePass:
    """One forward pass's inputs: ``[lanes, L]`` token ids and their positions in their own rows, and which keys
    each query sees (``actors/models/attention.py``)."""

    input_ids: Tensor
    position_ids: Tensor
    attention: PackedAttention


@dataclass(frozen=True)
class PackedRows:
    """The model's inputs for packed rows, in passes, and where each row's completion is predicted. Packing reads
    every token id, so it is done on the host and the result moved (``to``): reading ids on a GPU would wait for it."""

    passes: tuple[LanePass, ...]
    predicting: Tensor  # [rows, T] long, the place in the passes' states (flattened, one after another)
    completion_lengths: tuple[int, ...]  # each row's real completion tokens: the first of its T places
    kept: tuple[Tensor, ...] | None = None  # per pass, the only states kept (``predicted``); None: all of them

    def gather(self, states: list[Tensor]) -> Tensor:
        """Each pass's ``[lanes, L, ...]`` states (or its ``kept`` ones, ``[1, kept, ...]``) as the rows'
        ``[rows, T, ...]``: the state that predicts each completion token (at a row's padding, the first pass's
        first: the loss masks it)."""
        return torch.cat([state.flatten(0, 1) for state in states])[self.predicting]

    def predicted(self) -> PackedRows:
        """These rows with ``kept`` each pass's places of its flattened ``[lanes * L]`` states that predict some
        completion token (a prompt's other tokens and a lane's slack predict none), and ``predicting`` the places in
        those states taken one after another: a head applied to those alone makes no logits nobody reads."""
        sizes = [lane.input_ids.numel() for lane in self.passes]
        kept = self.predicting.unique()  # sorted
        bounds = torch.tensor([0, *itertools.accumulate(sizes)], device=kept.device)
        cuts = torch.searchsorted(kept, bounds).tolist()
        places = tuple(kept[a:b] - bounds[i] for i, (a, b) in enumerate(zip(cuts, cuts[1:])))
        return PackedRows(self.passes, torch.searchsorted(kept, self.predicting), self.completion_lengths, places)

    def to(self, device: torch.device) -> PackedRows:
        passes = tuple(LanePass(lane.input_ids.to(device), lane.position_ids.to(device), lane.attention.to(device))
                       for lane in self.passes)
        kept = None if self.kept is None else tuple(places.to(device) for places in self.kept)
        return PackedRows(passes, self.predicting.to(device), self.completion_lengths, kept)

    def run(self, module: Module, config=None, **inputs) -> Tensor:
        """``gather`` of a Hugging Face ``module``'s first output (a decoder's last hidden states, or a causal LM's
        logits) over each pass, through packed rows' attention. ``config``: the model's, where ``module`` wraps it
        (DDP)."""
        with rows_attention_of(config or module.config):
            return self.gather([
                module(input_ids=lane.input_ids, position_ids=lane.position_ids, attention_mask=_unused(lane),
                       packed_attention=lane.attention, **inputs)[0]
                for lane in self.passes
            ])


def _unused(lane: LanePass) -> Tensor:
    """A 4-D attention mask that Hugging Face models pass to the attention function untouched (as a ready mask),
    where packed rows' attention ignores it: no model builds a mask of its own for a packed pass."""
    return torch.ones(lane.input_ids.shape[0], 1, 1, 1, dtype=torch.bool, device=lane.input_ids.device)


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
    it; ``attention_mask`` marks the real tokens, ``position_ids`` their positions) into dense lanes of ``lane``
    tokens (``lane_tokens`` of the model; None: ``LANE_TOKENS``), and one by-rows pass of the rows that are longer than
    a lane with their prompt (each such prompt once). Built on the host, whatever device the rows are on."""
    rows, width = input_ids.shape[0], input_ids.shape[1] - prompt_len
    capacity = lane or LANE_TOKENS
    units = _units(input_ids, attention_mask, position_ids, prompt_len)
    pieces = [piece for unit in units for piece in _split(unit, capacity)]
    predicting = [[0] * width for _ in range(rows)]
    passes: list[LanePass] = []
    if dense := [piece for piece in pieces if piece.tokens <= capacity]:
        passes.append(_dense_pass(_lanes(dense, capacity), predicting))
    if long := [piece for piece in pieces if piece.tokens > capacity]:  # one pass, each prompt once, by rows
        passes.append(_rows_pass(long, predicting, sum(lane.input_ids.numel() for lane in passes)))
    return PackedRows(tuple(passes), torch.tensor(predicting), _completion_lengths(units, rows))


def _completion_lengths(units: list[_Unit], rows: int) -> tuple[int, ...]:
    lengths = [0] * rows
    for unit in units:
        for row, (completion, _) in zip(unit.rows, unit.completions):
            lengths[row] = len(completion)
    return tuple(lengths)


def _lay(unit: _Unit, ids: list[int], positions: list[int], place: int, base: int, predicting: list[list[int]]
         ) -> tuple[Unit, int]:
    """Write ``unit``'s prompt and then its rows into a lane's ``ids`` and ``positions`` from ``place`` (the lane's
    first token is the ``base``-th of its pass's states); each row's predicting states into ``predicting``. Its spans,
    and the place after it."""
    prompt_ids, prompt_positions = unit.prompt
    end = place + len(prompt_ids)
    ids[place:end], positions[place:end] = prompt_ids, prompt_positions
    prompt, last_prompt, place = (place, end), base + end - 1, end
    spans = []
    for row, (completion, completion_positions) in zip(unit.rows, unit.completions):
        end = place + len(completion)
        ids[place:end], positions[place:end] = completion, completion_positions
        if completion:
            predicting[row][: len(completion)] = [last_prompt, *range(base + place, base + end - 1)]
        spans.append((place, end))
        place = end
    return Unit(prompt, tuple(spans)), place


def _dense_pass(lanes: list[list[_Unit]], predicting: list[list[int]]) -> LanePass:
    """The units of ``lanes``, each lane padded to the longest, under one dense mask."""
    length = max(sum(unit.tokens for unit in lane) for lane in lanes)
    ids, positions = [[0] * length for _ in lanes], [[0] * length for _ in lanes]
    unit_of = [[-1] * length for _ in lanes]  # -1: padding
    owner = [[-1] * length for _ in lanes]  # the row a completion token belongs to; -1: a prompt's (shared) or padding
    for lane, units in enumerate(lanes):
        place = 0
        for number, unit in enumerate(units):
            spans, place = _lay(unit, ids[lane], positions[lane], place, lane * length, predicting)
            unit_of[lane][spans.prompt[0] : place] = [number] * (place - spans.prompt[0])
            for row, (start, end) in zip(unit.rows, spans.rows):
                owner[lane][start:end] = [row] * (end - start)
    position_ids = torch.tensor(positions)
    visible = _visible(torch.tensor(unit_of), torch.tensor(owner))
    return LanePass(torch.tensor(ids), position_ids, PackedAttention(position_ids, visible=visible))


def _rows_pass(units: list[_Unit], predicting: list[list[int]], base: int) -> LanePass:
    """One lane of ``units``, attended by rows (no mask of its length squared)."""
    length = sum(unit.tokens for unit in units)
    ids, positions, spans, place = [0] * length, [0] * length, [], 0
    for unit in units:
        laid, place = _lay(unit, ids, positions, place, base, predicting)
        spans.append(laid)
    position_ids = torch.tensor([positions])
    return LanePass(torch.tensor([ids]), position_ids, PackedAttention(position_ids, units=tuple(spans)))


def pack_by_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int) -> PackedRows:
    """Rows laid out as ``pack_rows`` takes them, as one lane attended by rows: every distinct prompt once, then its
    rows. The fewest tokens and attention pairs a pass over these rows can compute (``bench/train_floor.py``)."""
    rows, width = input_ids.shape[0], input_ids.shape[1] - prompt_len
    predicting = [[0] * width for _ in range(rows)]
    units = _units(input_ids, attention_mask, position_ids, prompt_len)
    lane = _rows_pass(units, predicting, 0)
    return PackedRows((lane,), torch.tensor(predicting), _completion_lengths(units, rows))


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
    """``unit`` in pieces that each fit a lane, the prompt in each, and one piece (over ``capacity``) of the rows that
    fit no lane with the prompt, attended by rows."""
    pieces: list[_Unit] = []
    long = _Unit(unit.prompt)
    for row, completion in zip(unit.rows, unit.completions):
        if len(unit.prompt[0]) + len(completion[0]) > capacity:
            long.add(row, completion)
            continue
        if not pieces or pieces[-1].tokens + len(completion[0]) > capacity:
            pieces.append(_Unit(unit.prompt))
        pieces[-1].add(row, completion)
    return pieces + ([long] if long.rows else [])


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
    ``Sequences`` or ``TrainBatch`` on the host), ``[rows, T, hidden]`` on the model's device, from one pass of its
    decoder over the rows packed in lanes of its size (the LM head is the caller's: it may need only some)."""
    return sequences.packed(lane_tokens(model.config)).to(model.device).run(model.get_decoder())
