"""Models with a real tokenizer: byte-level BPE, special tokens, a ChatML chat template.

The tiny ``tokenizer: bpe`` model is trained here from text shipped in the repo and saved
with random weights; every engine renders prompts through its template, and every inner
loop trains it to the native loop's loss and gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_actors import a_batch
from test_engine import check_groups, forward_logprobs, seeds_for
from test_inner_loops import TOLERANCE, config, gradients_of

from actors.generator.engines import Sampling
from actors.generator.engines.hf import HFEngine
from actors.models.chat import render
from actors.models.facts import BPE_VOCAB_SIZE, TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.models.tokenizers import bpe_tokenizer, char_tokenizer
from actors.tasks.dataset import PRINTABLE
from mesh.checkpoints.fingerprint import fingerprint, topology_fingerprint
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parents[1]
BPE = TinyModelSpec(
    hidden_size=128, heads=4, kv_heads=2, max_positions=128, tokenizer="bpe"
)  # head size 32: vLLM's CPU kernels
QUESTION = "Ana has 3 apples. Ben gives Ana 4 more. How many apples does Ana have now?"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("bpe"), BPE, None, seed=0))


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    """vLLM in-process initializes torch.distributed's default group; later tests build their own."""
    yield
    if "vllm" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def test_the_chat_template_frames_the_prompt_and_a_plain_tokenizer_reads_it_as_it_is(bpe_dir):
    _, tokenizer = load_policy(bpe_dir)
    assert render(tokenizer, QUESTION) == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, QUESTION, "Solve it.", hint="The answer is 7.") == (
        f"<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n{QUESTION}\n\nThe answer is 7.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(render(tokenizer, QUESTION), add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 2 and tokenizer.eos_token_id == 1
    chars = char_tokenizer("abc=")  # the tiny models' tokenizer: no template, so the prompt is the text
    assert render(chars, "ab=") == "ab=" and render(chars, "ab=", hint="ba=") == "ab=ba="
    assert render(chars, "ab=", "sys") == "sys\nab="


def test_the_bpe_tokenizer_is_trained_the_same_every_time_and_every_loader_agrees(tmp_path):
    """transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer (its own pre-tokenizer
    around the saved vocabulary) and others' as the saved tokenizer.json: the ids must not differ."""
    first, second = bpe_tokenizer(), bpe_tokenizer()
    assert first.get_vocab() == second.get_vocab() and len(first) == BPE_VOCAB_SIZE
    text = f"{QUESTION}\n$1,234.50 é \\boxed{{7}}"
    ids = {}
    for arch in ("qwen2", "qwen3", "llama"):
        for kind, alphabet in (("bpe", None), ("chars", PRINTABLE)):
            _, tokenizer = load_policy(
                build_tiny_model(tmp_path / f"{arch}-{kind}", TinyModelSpec(arch=arch, tokenizer=kind), alphabet, 0)
            )
            ids.setdefault(kind, set()).add(tuple(tokenizer(text, add_special_tokens=False).input_ids))
            assert tokenizer.decode(tokenizer(QUESTION, add_special_tokens=False).input_ids) == QUESTION
    assert len(ids["bpe"]) == 1 and len(ids["chars"]) == 1  # one encoding per tokenizer, whatever the loader


def test_a_bpe_runs_fingerprint_matches_the_model_it_builds(bpe_dir, tmp_path):
    topology = load_topology(ROOT / "topologies" / "math_small.yaml")
    built = build_tiny_model(tmp_path / "m", topology.model.init, None, topology.seed)
    assert topology_fingerprint(topology).tokenizer == fingerprint(built, topology.task.config).tokenizer


async def test_the_hf_engine_samples_a_bpe_model_after_its_chat_template(bpe_dir):
    engine = HFEngine(bpe_dir, Sampling(max_new_tokens=6))
    prompts = [render(engine.tokenizer, QUESTION, "Solve it."), render(engine.tokenizer, "What is 2 + 2?")]
    samples = check_groups(await engine.generate(prompts, 3, seeds_for(prompts)), engine.tokenizer, prompts, 3)
    for sample in samples:
        expected = forward_logprobs(engine.model, sample.prompt_ids, sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0)
    (scored,) = await engine.logprobs_of(prompts[:1], ["7"])  # a teacher's trace: its tokens, then the end of the turn
    assert scored.prompt_ids == samples[0].prompt_ids and scored.completion_ids == [
        engine.tokenizer.convert_tokens_to_ids("7"),
        1,
    ]
    expected = forward_logprobs(engine.model, scored.prompt_ids, scored.completion_ids)
    torch.testing.assert_close(torch.tensor(scored.logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
async def test_the_vllm_engine_samples_a_bpe_model_as_hf_computes_it(bpe_dir):
    import monarch.job  # noqa: F401  as in any process that launched a topology (tests/test_engine.py)

    from actors.generator.engines.vllm import VLLMEngine

    engine = VLLMEngine(bpe_dir, Sampling(max_new_tokens=6))
    model, tokenizer = load_policy(bpe_dir)
    prompts = [render(tokenizer, QUESTION, "Solve it.")]
    for sample in check_groups(await engine.generate(prompts, 4, seeds_for(prompts)), tokenizer, prompts, 4):
        expected = forward_logprobs(model, sample.prompt_ids, sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loop", ["trl", "prime_rl", "torchtitan"])
def test_every_inner_loop_trains_a_bpe_model_as_the_native_one(loop, bpe_dir):
    batch = a_batch(bpe_dir)
    want_metrics, want = gradients_of("native", bpe_dir, config("dapo", False), batch)
    metrics, grads = gradients_of(loop, bpe_dir, config("dapo", False), batch)
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], abs=TOLERANCE)
    assert sorted(grads) == sorted(want) and want["model.embed_tokens.weight"].shape[0] == BPE_VOCAB_SIZE
    for name, grad in want.items():
        torch.testing.assert_close(
            grads[name], grad, atol=TOLERANCE, rtol=0, msg=lambda m, name=name: f"{loop} {name}: {m}"
        )
    assert max(g.abs().max() for g in want.values()) > 100 * TOLERANCE  # a real gradient, not a vacuous match
