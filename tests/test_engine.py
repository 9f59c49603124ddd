"""The hf engine: batched sampling whose logprobs are the model's own."""

from __future__ import annotations

import pytest
import torch

from actors.engines.hf import HFEngine
from actors.model import TinyModelSpec, build_tiny_model, load_policy


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), "abcdef=", seed=0)
    return HFEngine(str(path), max_new_tokens=6, seed=0)


def test_groups_of_samples_with_logprobs_that_a_forward_pass_reproduces(engine):
    groups = engine.generate(["abc=", "fedcba="], samples_per_prompt=3)
    assert [len(g) for g in groups] == [3, 3]
    samples = [s for g in groups for s in g]
    assert all(1 <= len(s.completion_ids) <= 6 and len(s.logprobs) == len(s.completion_ids) for s in samples)
    assert all(s.completion_ids[-1] == 1 or len(s.completion_ids) == 6 for s in samples)  # EOS ends it, or the limit
    assert all(1 not in s.completion_ids[:-1] for s in samples)
    texts = [engine.tokenizer.decode(s.prompt_ids) for s in samples]
    assert texts == ["abc="] * 3 + ["fedcba="] * 3  # left padding is not part of the prompt
    for sample in samples:  # a right-padded forward pass gives the sampler's logprobs
        ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].log_softmax(-1)
        expected = logits.gather(-1, torch.tensor(sample.completion_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


def test_scoring_a_given_completion_matches_sampling_it(engine):
    samples = [s for g in engine.generate(["abc="], 16) for s in g]
    plain = [s for s in samples if s.completion_ids[-1] == 1 and min(s.completion_ids[:-1], default=3) >= 3]
    assert plain  # completions of plain characters ending in EOS, so their text round-trips
    for sample, scored in zip(plain, engine.score(["abc="] * len(plain), [s.text for s in plain])):
        assert scored.completion_ids == sample.completion_ids and scored.prompt_ids == sample.prompt_ids
        torch.testing.assert_close(torch.tensor(scored.logprobs), torch.tensor(sample.logprobs), atol=1e-5, rtol=0)


def test_same_seed_same_samples_and_new_weights_change_them(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(), "abcdef=", seed=0)
    a, b = HFEngine(str(path), 6, seed=1), HFEngine(str(path), 6, seed=1)
    first = [s.completion_ids for g in a.generate(["abc="], 8) for s in g]
    assert first == [s.completion_ids for g in b.generate(["abc="], 8) for s in g]
    model, _ = load_policy(path)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    b.load_weights(state)
    assert (
        b.model.state_dict()["lm_head.weight"].data_ptr() == state["lm_head.weight"].data_ptr()
    )  # adopted, not copied
    assert [s.completion_ids for g in a.generate(["abc="], 8) for s in g] != [
        s.completion_ids for g in b.generate(["abc="], 8) for s in g
    ]
