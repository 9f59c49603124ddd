"""The TrainBatch layout every inner loop relies on."""

from __future__ import annotations

import dataclasses
import pickle

import cloudpickle
import torch

from actors.rollout import Rollout, build_train_batch, split_rows
from actors.tasks import Problem


def rollout(prompt, completion, version=0):
    return Rollout(Problem("p", "a"), 0, prompt, completion, [-0.5] * len(completion), "", version)


def test_prompts_are_left_padded_and_completions_start_in_one_column():
    batch = build_train_batch(
        [rollout([5, 6, 7], [8, 1], version=2), rollout([9], [10, 11, 12, 1], version=3)],
        torch.tensor([1.0, -1.0]),
        pad_id=0,
        max_completion_len=8,
    )
    assert batch.prompt_len == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 1, 0, 0], [0, 0, 9, 10, 11, 12, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.targets.tolist() == [[8, 1, 0, 0], [10, 11, 12, 1]]
    assert batch.completion_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert batch.inference_logprobs[0].tolist() == [-0.5, -0.5, 0.0, 0.0]
    assert batch.versions.tolist() == [2, 3]
    assert batch.rows(slice(1, 2)).input_ids.tolist() == [[0, 0, 9, 10, 11, 12, 1]]
    copy = pickle.loads(cloudpickle.dumps(batch))  # travels as numpy arrays, arrives as the same tensors
    for field in dataclasses.fields(batch):
        mine, theirs = getattr(batch, field.name), getattr(copy, field.name)
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype if torch.is_tensor(mine) else mine == theirs


def test_split_rows_covers_everything_once_in_near_equal_shares():
    for rows in range(0, 12):
        for parts in range(1, 5):
            shares = split_rows(rows, parts)
            assert [i for s in shares for i in range(s.start, s.stop)] == list(range(rows))
            sizes = [s.stop - s.start for s in shares]
            assert max(sizes) - min(sizes) <= 1
