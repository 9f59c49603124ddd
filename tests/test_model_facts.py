"""What the topology check knows of a model without loading it equals what loading it gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from actors.models.facts import ModelFacts, TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.weights.config import SLOT_HEADER_BYTES, slot_bytes
from actors.weights.manifest import HEADER_BYTES
from actors.weights.store import WeightPublisher
from actors.weights.transports.shm import slot_file

ALPHABET = "abc="


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_the_spec_gives_the_built_models_state_dict_and_the_stores_slot_size(tmp_path, arch):
    spec = TinyModelSpec(arch=arch, hidden_size=48, layers=3, heads=6, kv_heads=2)
    model, _ = load_policy(build_tiny_model(tmp_path / "model", spec, ALPHABET, seed=0))
    facts = ModelFacts.of_spec(spec, ALPHABET)
    assert facts.tensors == shapes(model) and facts.head_size == model.config.head_dim == 8

    for dtype in ("float32", "bfloat16"):
        store = tmp_path / f"store-{dtype}"
        publisher = WeightPublisher(store, model.state_dict(), slots=1, dtype=getattr(torch, dtype))
        try:
            assert os.path.getsize(slot_file(publisher.store, 0)) == slot_bytes(facts.tensors, dtype)
        finally:
            publisher.close()
    assert SLOT_HEADER_BYTES == HEADER_BYTES


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> torch.nn.Module:
    """A model whose LM head is its embedding: safetensors stores the tensor once."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def test_a_directory_is_read_from_its_config_and_safetensors_headers(tmp_path, tied):
    tied.save_pretrained(tmp_path / "one")
    facts = ModelFacts.of_directory(tmp_path / "one")
    assert facts.head_size == 16
    assert facts.tensors == shapes(tied)  # the tied head counted, as the state dict (and the store) hold it

    tied.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert ModelFacts.of_directory(tmp_path / "sharded").tensors == shapes(tied)


def test_unreadable_weights_are_explained_and_missing_ones_are_unknown(tmp_path, tied):
    tied.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="is not a readable safetensors file .* re-save the model"):
        ModelFacts.of_directory(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert ModelFacts.of_directory(tmp_path).tensors is None
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    assert ModelFacts.of_directory(tmp_path).head_size == 32


def test_a_model_path_without_safetensors_skips_the_pre_flight(tmp_path, tied):
    from mesh.topology.preflight import describe_store, load_plan

    tied.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    tiny = Path(__file__).resolve().parents[1] / "topologies" / "tiny.yaml"
    topology = load_plan(tiny, [f"model={{path: {tmp_path / 'model'}}}", "loop.max_policy_lag=100000000"], placed_here=False)
    unknown = "weight store: 100000002 slots (size unknown: model.path has no safetensors weights)"
    assert describe_store(topology) == unknown
