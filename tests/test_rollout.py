"""The rollout contract: rows that say what they are, groups, and the TrainBatch built from them."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random

import cloudpickle
import numpy as np
import pytest
import torch

from actors.basics.shares import micro_batches, split_evenly, token_shares
from actors.contract.rollouts import Reward, RolloutGroup, Row, RowKind, Trajectory
from actors.contract.top_k import TopK
from actors.contract.train_batch import build_train_batch, row_advantages
from actors.tasks import Problem
from losses import group_advantages, policy_config
from mesh.controller import Collected
from mesh.controller.inflight import collected_from_json, collected_to_json
from mesh.controller.router import TargetLoad

PROBLEM = Problem("p", "a")


def row(prompt=(3,), completion=(4, 1), version=0, kind=RowKind.SAMPLE, text="", reward=0.0, teacher=None, **fields):
    trajectory = Trajectory.single_turn(list(prompt), list(completion), [-0.5] * len(completion), text)
    return Row(kind, trajectory, version, teacher, Reward(reward), **fields)


def group(*rows: Row, index: int = 0) -> RolloutGroup:
    return RolloutGroup(PROBLEM, index, rows)


def test_prompts_are_left_padded_and_completions_start_in_one_column():
    groups = [group(row([5, 6, 7], [8, 1], version=2)), group(row([9], [10, 11, 12, 1], version=3), index=1)]
    batch = build_train_batch(groups, torch.tensor([1.0, -1.0]), pad_id=0, max_completion_len=8)
    assert batch.prompt_len == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 1, 0, 0], [0, 0, 9, 10, 11, 12, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.targets.tolist() == [[8, 1, 0, 0], [10, 11, 12, 1]]
    assert batch.completion_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert batch.inference_logprobs[0].tolist() == [-0.5, -0.5, 0.0, 0.0]
    assert batch.rows(slice(1, 2)).input_ids.tolist() == [[0, 0, 9, 10, 11, 12, 1]]
    copy = pickle.loads(cloudpickle.dumps(batch))  # travels as numpy arrays, arrives as the same tensors
    for field in dataclasses.fields(batch):
        mine, theirs = getattr(batch, field.name), getattr(copy, field.name)
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype if torch.is_tensor(mine) else mine == theirs


def test_an_episodes_environment_tokens_are_context_not_loss():
    # the model wrote [4, 5], the environment answered [6, 7], the model wrote [8, 1]
    episode = Trajectory([3], [4, 5, 6, 7, 8, 1], [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], [1, 1, 0, 0, 1, 1], "")
    episode = dataclasses.replace(episode, loss_mask=[bool(m) for m in episode.loss_mask])
    batch = build_train_batch(
        [group(Row(RowKind.SAMPLE, episode, 0, reward=Reward(1.0)), row([3], [9, 1]))],
        torch.zeros(2),
        pad_id=0,
        max_completion_len=8,
    )
    assert batch.targets[0].tolist() == [4, 5, 6, 7, 8, 1]  # the whole episode is the context...
    assert batch.attention_mask[0].tolist() == [1] * 7
    assert batch.completion_mask.tolist() == [  # ...but only the model's tokens carry loss
        [True, True, False, False, True, True],
        [True, True, False, False, False, False],
    ]


def test_split_evenly_covers_everything_once_in_near_equal_shares():
    for rows in range(0, 12):
        for parts in range(1, 5):
            shares = split_evenly(rows, parts)
            assert [i for s in shares for i in range(s.start, s.stop)] == list(range(rows))
            sizes = [s.stop - s.start for s in shares]
            assert max(sizes) - min(sizes) <= 1


def test_ranks_share_a_step_of_agent_rows_by_tokens():
    """Rows of 100 to 8000 tokens: two ranks within 10% of each other's tokens (by count they are 1.5x apart here),
    more ranks within one row's tokens; every row once, in order; fewer rows than ranks leave some empty."""
    generator = random.Random(0)
    tokens = [generator.randint(100, 400) for _ in range(48)] + [generator.randint(2000, 8000) for _ in range(16)]
    for parts in (2, 3, 4):
        shares = token_shares(tokens, parts)
        assert [i for s in shares for i in range(s.start, s.stop)] == list(range(len(tokens)))
        held = [sum(tokens[s]) for s in shares]
        assert max(held) - min(held) <= max(tokens), held
        if parts == 2:
            assert max(held) <= 1.1 * min(held), held
    by_count = [sum(tokens[s]) for s in split_evenly(len(tokens), 2)]
    assert max(by_count) > 1.5 * min(by_count)
    few = token_shares([5, 7], 3)
    assert [i for s in few for i in range(s.start, s.stop)] == [0, 1] and sum(s.stop == s.start for s in few) == 1
    assert token_shares([], 2) == [slice(0, 0), slice(0, 0)]
    assert token_shares([30000, 10, 10], 3) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row each, while there are


def test_each_rank_is_sent_its_share_of_a_step_as_its_tokens():
    """Agent rows of 100 to 8000 tokens: each of two ranks is sent only its rows (balanced by tokens), which travel
    token-major, so each share is about half the whole batch's bytes, not its rows times the longest row's; the
    shares hold every row once, as the whole batch does, and a pair's rows on different ranks keep their pair."""
    generator = random.Random(0)
    lengths = [generator.randint(100, 400) for _ in range(48)] + [generator.randint(2000, 8000) for _ in range(16)]
    rows = [row(range(1, 41), range(length - 40), text=f"s{i}", reward=i % 2) for i, length in enumerate(lengths)]
    rows.append(row(range(1, 41), range(60), kind=RowKind.REPLAY, text="t", reward=1.0, teacher="oracle"))
    batch = build_train_batch([group(*rows)], torch.arange(len(rows)).float(), pad_id=0, max_completion_len=8000)
    shares = batch.shares(2)
    whole = len(pickle.dumps(batch))
    padded = sum(t.numpy().nbytes for t in vars(batch).values() if torch.is_tensor(t))
    assert padded > 3 * whole  # the padded layout would send mostly padding
    for share in shares:
        assert 0.4 < len(pickle.dumps(share)) / whole < 0.6
    assert [s.share.first for s in shares] == [0, len(shares[0])] and sum(map(len, shares)) == len(rows)
    for share in shares:
        arrived = pickle.loads(pickle.dumps(share))
        for i in range(len(share)):
            step_row = share.share.first + i
            real, whole_real = arrived.attention_mask[i].bool(), batch.attention_mask[step_row].bool()
            assert arrived.input_ids[i][real].tolist() == batch.input_ids[step_row][whole_real].tolist()
            assert arrived.targets[i][arrived.completion_mask[i]].tolist() == \
                batch.targets[step_row][batch.completion_mask[step_row]].tolist()
            assert float(arrived.advantages[i]) == float(batch.advantages[step_row])
        assert torch.equal(arrived.pairs, batch.pairs)  # the step's pairs, indexed by the step's rows
    assert {int(r) for r in batch.pairs.flatten()} & set(range(len(shares[0]))), "a pair crosses the ranks"
    with pytest.raises(ValueError, match="rank 1 of 2 was sent rank 0 of 2's share"):
        shares[0].for_rank(1, 2)
    kl_cov = policy_config(name="kl_cov", cov_fraction=0.1)
    with pytest.raises(ValueError, match="without Clip-Cov's or KL-Cov's chosen tokens"):
        shares[0].for_rank(0, 2, kl_cov)  # split without the loss's rule
    chosen = batch.shares(2, kl_cov)
    policy_tokens = int((batch.completion_mask & batch.policy_rows[:, None]).sum())
    assert sum(int(s.held_back.sum()) for s in chosen) == int(0.1 * policy_tokens)  # chosen over the whole step
    assert chosen[1].for_rank(1, 2, kl_cov) is chosen[1]


def test_micro_batches_hold_at_most_their_tokens_and_a_longer_row_alone():
    tokens = [100, 80, 8000, 120, 90, 3000, 2900, 60]
    cuts = micro_batches(tokens, [0] * 8, budget=4096)
    assert [2] in cuts and not any({5, 6} <= set(cut) for cut in cuts)  # 8000 alone; 3000 and 2900 cannot share
    # longest first into the least filled: 3180 and 3170 tokens
    assert micro_batches(tokens, [0] * 8, budget=6000) == [[0, 1, 5], [2], [3, 4, 6, 7]]
    assert micro_batches(tokens, [0] * 8, budget=10**6) == [list(range(8))]
    assert micro_batches([], [], budget=100) == []
    for budget in (1, 150, 5000):
        cuts = micro_batches(tokens, [0] * 8, budget=budget)
        assert sorted(i for cut in cuts for i in cut) == list(range(8))
        assert cuts == sorted(cuts) and all(cut == sorted(cut) for cut in cuts)  # in the rows' order
        assert all(len(cut) == 1 or sum(tokens[i] for i in cut) <= budget for cut in cuts)


def test_micro_batches_are_even_by_tokens_and_keep_a_groups_prompt_together():
    """Agent rows of 100 to 8000 tokens in shuffled order: micro-batches within 1.1x of each other's tokens, as few as
    the budget allows plus at most one; a group's rows, which share their prompt, stay in one micro-batch where
    they fit, and its prompt counts once there."""
    generator = random.Random(0)
    tokens = [generator.randint(100, 400) for _ in range(48)] + [generator.randint(2000, 8000) for _ in range(16)]
    generator.shuffle(tokens)
    cuts = micro_batches(tokens, [0] * len(tokens), budget=16384)
    held = [sum(tokens[i] for i in cut) for cut in cuts]
    assert max(held) <= 1.1 * min(held) and max(held) <= 16384, held
    assert len(cuts) <= -(-sum(tokens) // 16384) + 1
    consecutive = [sum(tokens[i] for i in cut) for cut in _consecutive(tokens, 16384)]  # fill each, then the next
    assert max(consecutive) > 1.5 * min(consecutive)
    # eight groups of eight rows sharing a 60-token prompt, a budget of two groups' tokens: two whole groups in each
    tokens = [60 + generator.randint(20, 48) for _ in range(64)]
    shared = [0 if i % 8 == 0 else 60 for i in range(64)]
    groups = sorted(sum(tokens[g * 8 : g * 8 + 8]) - 7 * 60 for g in range(8))
    cuts = micro_batches(tokens, shared, budget=groups[-1] + groups[-2])
    assert len(cuts) == 4 and all(len(cut) == 16 and cut[::8] == [cut[0], cut[8]] for cut in cuts), cuts
    assert all({i // 8 for i in cut} == {cut[0] // 8, cut[8] // 8} for cut in cuts)
    assert micro_batches([100, 100, 100], [0, 60, 60], budget=180) == [[0, 1, 2]]  # 100 + 40 + 40


def _consecutive(tokens: list[int], budget: int) -> list[list[int]]:
    cuts, held = [[]], 0
    for i, n in enumerate(tokens):
        if cuts[-1] and held + n > budget:
            cuts.append([])
            held = 0
        cuts[-1].append(i)
        held += n
    return cuts


def test_a_trace_is_paired_with_each_distinct_sample_and_the_higher_reward_is_chosen():
    first = group(
        row(text="ab", reward=0.5),
        row(text="ab", reward=0.5),  # the same text again: one sample
        row(text="ba", reward=1.0),  # as good as the trace: a tie makes no pair
        row(text="c", reward=0.0),
        row(kind=RowKind.REPLAY, text="ba", reward=1.0, teacher="oracle"),  # the policy sampled this text: dropped
        row(kind=RowKind.REPLAY, text="xy", reward=1.0, teacher="big"),
        row(kind=RowKind.REPLAY, text="xy", reward=1.0, teacher="oracle2"),  # a duplicate trace: the first's
    )
    second = group(
        row(kind=RowKind.REPLAY, text="zz", reward=0.2, teacher="big"),
        row(text="q", reward=0.6),  # the student wins against this trace
        row(kind=RowKind.WARM_START, text="cc", reward=1.0, teacher="warm"),  # a warm-start trace joins no pair
        index=1,
    )
    assert first.preference_pairs() == [(5, 0), (5, 3)]
    assert second.preference_pairs() == [(1, 0)]
    batch = build_train_batch([first, second], torch.zeros(10), pad_id=0, max_completion_len=4)
    assert batch.pairs.tolist() == [[5, 0], [5, 3], [8, 7]]  # batch rows: the second group starts at row 7


def test_advantages_are_relative_within_a_group_and_replayed_traces_get_none():
    rewards = [0.0, 1.0, 0.5]
    warm = group(*(row(reward=r) for r in rewards), row(kind=RowKind.WARM_START, reward=1.0, teacher="t"))
    plain = group(*(row(reward=r) for r in rewards), row(kind=RowKind.REPLAY, reward=1.0, teacher="t"), index=1)
    advantages = row_advantages([warm, plain])
    assert advantages[:4].tolist() == pytest.approx(group_advantages(torch.tensor(rewards + [1.0]), 4).tolist())
    assert advantages[4:7].tolist() == pytest.approx(group_advantages(torch.tensor(rewards), 3).tolist())
    assert advantages[7] == 0.0  # a replayed trace is not in channel 1
    equal = row_advantages([plain, dataclasses.replace(plain, index=1)])  # groups of one size share one call
    assert equal.tolist() == pytest.approx(advantages[4:].tolist() * 2)
    for estimator in ("group_mean", "rloo"):  # the policy's estimator, in either path
        mixed = row_advantages([warm, plain], estimator)
        assert mixed[4:7].tolist() == pytest.approx(group_advantages(torch.tensor(rewards), 3, estimator).tolist())
        assert row_advantages([plain, plain], estimator)[:4].tolist() == pytest.approx(mixed[4:].tolist())


def test_an_episode_split_into_rows_counts_once_in_its_groups_advantages():
    """An agent that edits its history turns one episode into several rows (issue 49): they share the episode's
    advantage, and the group's mean and spread are the episodes', not weighted by how many rows each became."""
    split = group(row(reward=1.0, episode=0), row(reward=1.0, episode=0), row(reward=0.0, episode=1))
    whole = group(row(reward=1.0, episode=0), row(reward=0.0, episode=1), index=1)
    advantages = row_advantages([split, whole]).tolist()
    episodes = group_advantages(torch.tensor([1.0, 0.0]), 2).tolist()
    assert advantages == pytest.approx([episodes[0], episodes[0], episodes[1], *episodes])
    warm = group(row(reward=1.0, episode=0), row(reward=1.0, episode=0), row(kind=RowKind.WARM_START, reward=0.5))
    expected = group_advantages(torch.tensor([1.0, 0.5]), 2).tolist()  # a trace is no episode: its own row
    assert row_advantages([warm]).tolist() == pytest.approx([expected[0], expected[0], expected[1]])

def test_teacher_top_k_and_pairs_enter_the_batch():
    top = TopK(np.array([[4, 5], [1, 4]]), np.array([[-0.1, -2.5], [-0.2, -1.9]], dtype=np.float32))
    rows = group(
        row([3], [4, 1], distill=top, text="a", reward=0.0),
        row([3], [5, 4, 1], text="b", reward=0.0),
        row(kind=RowKind.REPLAY, text="t", reward=1.0, teacher="oracle"),
    )
    batch = build_train_batch([rows], torch.zeros(3), pad_id=0, max_completion_len=4)
    assert batch.policy_rows.tolist() == [True, True, False]
    assert batch.distill_ids.shape == (3, 3, 2) and batch.distill_ids[0, :2].tolist() == [[4, 5], [1, 4]]
    assert batch.distill_mask.tolist() == [[True, True, False], [False, False, False], [False, False, False]]
    assert torch.isneginf(batch.distill_logprobs[1]).all()  # a row without a teacher has no teacher mass
    assert batch.pairs.tolist() == [[2, 0], [2, 1]]
    assert batch.rows(slice(0, 2)).pairs is None  # pairs index the whole batch, so a slice leaves them out
    copy = pickle.loads(cloudpickle.dumps(batch))
    assert torch.equal(copy.distill_logprobs, batch.distill_logprobs) and torch.equal(copy.pairs, batch.pairs)


def test_each_rows_group_spread_is_that_of_its_groups_correct_samples():
    """Channel 2's ``group_spread`` weight, sqrt(p (1 - p)): p counts the policy's samples with a reward of 1 or more,
    an episode split into rows once, and neither a teacher's trace nor its reward."""
    top = TopK(np.array([[4, 5], [1, 4]]), np.array([[-0.1, -2.5], [-0.2, -1.9]], dtype=np.float32))
    sample = dict(completion=(4, 1), distill=top)
    groups = [
        group(row(reward=0.0, **sample), row(reward=0.5), row(kind=RowKind.REPLAY, reward=1.0, teacher="t")),
        group(row(reward=1.0, **sample), row(reward=2.0), index=1),
        group(
            row(reward=1.0, episode=0, **sample),
            row(reward=1.0, episode=0),
            row(reward=0.0, episode=1),
            row(kind=RowKind.WARM_START, reward=1.0, teacher="t"),
            index=2,
        ),
        group(row(reward=1.0, **sample), row(reward=0.0), row(reward=0.0), index=3),
    ]
    batch = build_train_batch(groups, torch.zeros(12), pad_id=0, max_completion_len=4)
    third = math.sqrt(2 / 9)
    assert batch.group_spread.tolist() == pytest.approx([0.0] * 5 + [0.5] * 4 + [third] * 3)
    assert batch.rows(slice(3, 6)).group_spread.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert batch.rows(slice(3, 6)).trimmed().group_spread.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert torch.equal(pickle.loads(cloudpickle.dumps(batch)).group_spread, batch.group_spread)
    no_teacher = build_train_batch([group(row(reward=1.0), row())], torch.zeros(2), pad_id=0, max_completion_len=4)
    assert no_teacher.group_spread is None  # no distillation, no weight


def test_misaligned_teacher_top_k_is_refused_naming_the_shapes():
    top = TopK(np.zeros((3, 2), dtype=np.int64), np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"top-k of shape \(3, 2\) for a completion of 2 tokens"):
        build_train_batch([group(row(distill=top))], torch.zeros(1), pad_id=0, max_completion_len=4)


def test_in_flight_collections_round_trip_through_json_exactly():
    top = TopK(np.array([[4, 5], [1, 4]]), np.array([[-0.1, -2.5], [-0.2, -1.9]], dtype=np.float32))
    parts = Reward(0.75, {"task": 0.5, "len": 0.25}, "cba=")
    collected = Collected(
        groups=[
            group(
                dataclasses.replace(row(text="ab", distill=top), reward=parts),
                row(kind=RowKind.REPLAY, text="t", reward=1.0, teacher="oracle", version=3),
            )
        ],
        distill_teacher="self",
        seconds={"generate": 0.1, "load": 0.0, "reward": 0.01, "teachers": 0.02},
        teacher_metrics={"oracle": {"latency_s": 0.02}},
        generators=[TargetLoad(1, 2, 0.1, 0.0)],
    )
    (back,) = collected_from_json(collected_to_json([collected]))
    assert back.groups[0].rows[1] == collected.groups[0].rows[1]
    restored, original = back.groups[0].rows[0], collected.groups[0].rows[0]
    assert dataclasses.replace(restored, distill=None) == dataclasses.replace(original, distill=None)
    assert np.array_equal(restored.distill.ids, top.ids) and np.array_equal(restored.distill.logprobs, top.logprobs)
    assert (back.seconds, back.teacher_metrics, back.generators) == (
        collected.seconds,
        collected.teacher_metrics,
        collected.generators,
    )
    with pytest.raises(ValueError, match="format 1; this code reads format 2"):
        collected_from_json({"format": 1, "collected": []})


def test_tokens_sampled_after_an_update_inside_their_turn_are_marked_for_the_trainer_and_survive_a_save():
    """Per-token versions: a context token between two replies starts the next reply afresh, so only a change
    inside a reply marks its tokens; the batch carries the marks only when some row has them."""
    episode = Trajectory([3], [4, 5, 6, 7, 8, 9], [-0.5] * 6, [True, True, True, False, True, True], "", [0, 0, 1, 1, 2, 2])
    assert episode.after_update() == [False, False, True, False, False, False]
    assert episode.sampled_versions() == [0, 0, 1, 2, 2]
    rows = [Row(RowKind.SAMPLE, episode, 0, None, Reward(1.0)), row(version=0)]
    batch = build_train_batch([group(*rows)], torch.tensor([1.0, -1.0]), pad_id=0, max_completion_len=8)
    assert batch.after_update.tolist() == [[False, False, True, False, False, False], [False] * 6]
    assert build_train_batch([group(row())], torch.tensor([0.0]), pad_id=0, max_completion_len=8).after_update is None
    saved = Collected(groups=[group(*rows)], distill_teacher=None, seconds={}, teacher_metrics={})
    (loaded,) = collected_from_json(collected_to_json([saved]))
    assert loaded.groups[0].rows[0].trajectory.versions == [0, 0, 1, 1, 2, 2]
