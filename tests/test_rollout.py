"""The TrainBatch layout every inner loop relies on."""

from __future__ import annotations

import dataclasses
import pickle

import cloudpickle
import numpy as np
import torch

from actors.bindings import TokenScores
from actors.rollout import Rollout, build_train_batch, preference_pairs, split_rows
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


def scored(group, text, reward, teacher=None, trains_policy=True):
    return Rollout(Problem("p", "a"), group, [3], [4, 1], [-0.5, -0.5], text, 0, reward, {}, teacher, trains_policy)


def test_a_trace_is_paired_with_each_distinct_sample_and_the_higher_reward_is_chosen():
    rollouts = [
        scored(0, "ab", 0.5),
        scored(0, "ab", 0.5),  # the same text again: one sample
        scored(0, "ba", 1.0),  # as good as the trace: a tie makes no pair
        scored(0, "c", 0.0),
        scored(0, "ba", 1.0, teacher="oracle", trains_policy=False),  # the policy sampled this text: dropped
        scored(0, "xy", 1.0, teacher="big", trains_policy=False),
        scored(0, "xy", 1.0, teacher="oracle2", trains_policy=False),  # a duplicate trace: credited to the first
        scored(1, "zz", 0.2, teacher="big", trains_policy=False),
        scored(1, "q", 0.6),  # another prompt: the student wins against this trace
        scored(1, "cc", 1.0, teacher="warm", trains_policy=True),  # a warm-start trace joins no pair
    ]
    assert preference_pairs(rollouts) == [(5, 0), (5, 3), (8, 7)]


def test_teacher_signals_and_pairs_enter_the_batch():
    top = TokenScores(np.array([[4, 5], [1, 4]]), np.array([[-0.1, -2.5], [-0.2, -1.9]], dtype=np.float32))
    rows = [rollout([3], [4, 1]), rollout([3], [5, 4, 1]), scored(0, "t", 1.0, "oracle", trains_policy=False)]
    rows[0].distill = top
    batch = build_train_batch(rows, torch.zeros(3), pad_id=0, max_completion_len=4, pairs=[(2, 1)])
    assert batch.policy_rows.tolist() == [True, True, False]
    assert batch.distill_ids.shape == (3, 3, 2) and batch.distill_ids[0, :2].tolist() == [[4, 5], [1, 4]]
    assert batch.distill_mask.tolist() == [[True, True, False], [False, False, False], [False, False, False]]
    assert torch.isneginf(batch.distill_logprobs[1]).all()  # a row without a teacher has no teacher mass
    assert batch.pairs.tolist() == [[2, 1]]
    assert batch.rows(slice(0, 2)).pairs is None  # pairs index the whole batch, so a slice leaves them out
    copy = pickle.loads(cloudpickle.dumps(batch))
    assert torch.equal(copy.distill_logprobs, batch.distill_logprobs) and torch.equal(copy.pairs, batch.pairs)
