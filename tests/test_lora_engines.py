"""Adapter-only weight sync on the generator side: each version is the adapters' tensors only.

The ``hf`` engine applies them to a PEFT-wrapped base it never merges; the ``vllm`` engine loads
each version through vLLM's own LoRA support. Both must sample exactly what a ``PeftModel`` with
that adapter computes, version after version, and take the versions from the real weight store.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from test_engine import (  # noqa: F401  no_process_group_left: an autouse fixture, shared
    ALPHABET,
    LOGPROB_TOLERANCE,
    VLLM_TINY,
    forward_logprobs,
    no_process_group_left,
    seeds_for,
)
from test_topology import ROOT, error_of

from actors.generator.config import VLLM_LORA_RANKS, vllm_lora_rank
from actors.generator.engines import Sampling
from actors.generator.engines.hf import HFEngine
from actors.models.lora import adapter_state, load_adapter_state, with_adapter
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.weights.config import store_root
from actors.weights.follower import WeightFollower
from actors.weights.store import WeightPublisher
from actors.weights.storedir import create_store, remove_store

ADAPTER = LoRAConfig(rank=4, alpha=8.0)  # vLLM takes no max_lora_rank of 4: the engine asks for 8
PROMPTS = ["abc=", "fedcba=", "abcdef=abcdef=abc="]  # the last fills a prefix block vLLM caches
EOS = 1  # the tiny tokenizer's


@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> str:
    """Head size 32, for vLLM's CPU kernels; the hf engine runs it too."""
    return str(build_tiny_model(tmp_path_factory.mktemp("base"), VLLM_TINY, ALPHABET, seed=0))


@pytest.fixture(scope="module")
def reference(base_path) -> PeftModel:
    """The trainer's policy: the base with PEFT's adapters, each version loaded as the trainer holds it."""
    return with_adapter(load_policy(base_path)[0], ADAPTER).eval()


@pytest.fixture(scope="module")
def vllm_engine(base_path):
    pytest.importorskip("vllm", reason="vllm is not installed")
    from actors.generator.engines.vllm import VLLMEngine

    return VLLMEngine(base_path, Sampling(6, top_k=1), adapter=ADAPTER)  # top-k 1: greedy


def trained(reference: PeftModel, seed: int) -> dict[str, torch.Tensor]:
    """An adapter version as training leaves it: every A and B non-zero (a fresh adapter's B is zero)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g) * 0.1 for name, t in adapter_state(reference).items()}


def greedy(model, prompt_ids: list[int], max_new_tokens: int = 6) -> list[int]:
    """Argmax decoding with plain forward passes, up to and including EOS."""
    ids = list(prompt_ids)
    with torch.no_grad():
        while len(ids) - len(prompt_ids) < max_new_tokens and (len(ids) == len(prompt_ids) or ids[-1] != EOS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def base_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.model.get_base_model().state_dict().items() if "lora_" not in n}


async def test_hf_engine_samples_each_adapter_version_as_peft_does_and_never_merges(base_path, reference):
    engine = HFEngine(base_path, Sampling(6), adapter=ADAPTER)
    base = base_weights(engine)
    samples = []
    for seed in (1, 2):
        version = trained(reference, seed)
        engine.load_weights(version)
        load_adapter_state(reference, version)
        groups = await engine.generate(PROMPTS, 4, seeds_for(PROMPTS))
        samples.append([s.completion_ids for g in groups for s in g])
        for sample in (s for g in groups for s in g):  # the logprobs of the adapted policy, not the base's
            expected = forward_logprobs(reference, sample.prompt_ids, sample.completion_ids)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)
    assert samples[0] != samples[1]  # the same seeds: the version changed what was sampled
    after = base_weights(engine)
    assert list(after) == list(base) and all(torch.equal(after[n], base[n]) for n in base)  # never merged


async def test_vllm_engine_decodes_each_adapter_version_as_peft_does_and_forgets_the_previous(
    vllm_engine, reference
):
    decoded, ids_of = [], []
    for seed in (3, 4):
        version = trained(reference, seed)
        vllm_engine.load_weights(version)
        load_adapter_state(reference, version)
        groups = await vllm_engine.generate(PROMPTS, 2, seeds_for(PROMPTS))
        for group in groups:
            want = greedy(reference, group[0].prompt_ids)
            assert [s.completion_ids for s in group] == [want, want]
        decoded.append([g[0].completion_ids for g in groups])
        scored = await vllm_engine.logprobs_of(PROMPTS, [g[0].text for g in groups])
        for trajectory in scored:  # scoring runs with the adapter too
            expected = forward_logprobs(reference, trajectory.prompt_ids, trajectory.completion_ids)
            torch.testing.assert_close(torch.tensor(trajectory.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)
        turn = [3, 4, EOS, 5]  # mid-episode ids, as an environment turn hands them on
        assert (await vllm_engine.continue_from(turn, 7)).completion_ids == greedy(reference, turn)
        current = vllm_engine.lora
        assert vllm_engine.engine.list_loras() == {current.lora_int_id}  # the previous version left vLLM
        assert [p.name for p in vllm_engine.adapter_dir.iterdir()] == [f"v{current.lora_int_id}"]  # and the disk
        ids_of.append(current.lora_int_id)
    assert decoded[0] != decoded[1] and ids_of[0] != ids_of[1]


@pytest.mark.parametrize("which", ["hf", "vllm"])
async def test_an_adapter_version_travels_through_the_weight_store_alone(which, request, base_path, reference):
    engine = (
        HFEngine(base_path, Sampling(6, top_k=1), adapter=ADAPTER)
        if which == "hf"
        else request.getfixturevalue("vllm_engine")
    )
    version = trained(reference, 5)
    load_adapter_state(reference, version)
    store = create_store(store_root())
    publisher = WeightPublisher(store, version, slots=2)
    follower = WeightFollower()
    try:
        record = publisher.publish(version, 7)
        adapter_bytes = sum(t.nbytes for t in version.values())
        assert adapter_bytes <= record.nbytes < adapter_bytes + 64 * len(version)  # each tensor 64-byte aligned
        full_bytes = sum(t.nbytes for t in reference.get_base_model().state_dict().values())
        assert record.nbytes * 10 < full_bytes
        assert follower.hold(record, engine.load_weights) > 0
        groups = await engine.generate(PROMPTS, 1, seeds_for(PROMPTS))
        follower.check_intact(record)
        for (sample,) in groups:
            assert sample.completion_ids == greedy(reference, sample.prompt_ids)
    finally:
        follower.close()
        publisher.close()
        remove_store(store)


def test_vllm_lora_ranks_are_vllms_own():
    lora = pytest.importorskip("vllm.config.lora", reason="vllm is not installed")
    from typing import get_args

    assert VLLM_LORA_RANKS == get_args(lora.MaxLoRARanks)


@pytest.mark.parametrize(("rank", "max_rank"), [(1, 1), (4, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
def test_vllm_holds_an_adapter_in_its_smallest_rank_that_fits(rank, max_rank):
    assert vllm_lora_rank(rank) == max_rank


def test_an_adapter_rank_vllm_cannot_load_is_refused_at_check_time():
    wide = ["model.init.hidden_size=2048", "model.init.intermediate_size=2048"]  # rank 1024 fits its layers
    message = error_of(ROOT / "topologies" / "tiny_vllm.yaml", [*wide, "actors.trainer.lora={rank: 1024}"])
    assert "lora.rank is 1024" in message and "at most 512" in message and "engine: hf" in message
