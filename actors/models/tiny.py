"""The tiny model: a random-init causal LM built on the spot, saved as a directory like any other.

Every engine and trainer loads the result by path, the same way (HF, TRL, vLLM all do), so a tiny CPU run
and a real model take one code path. Its tokenizer has one token per character of the task's alphabet by
default (``tokenizers.py``): a random policy then spreads its mass over a handful of tokens rather than a
150k vocabulary, which is what lets it learn on a CPU in minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from actors.models.facts import TINY_MODEL_MARKER, TinyModelSpec, tiny_recipe
from actors.models.policy import quiet_transformers
from actors.models.tokenizers import bpe_tokenizer, char_tokenizer


def build_tiny_model(path: Path, spec: TinyModelSpec, alphabet: str | None, seed: int) -> Path:
    """Save the spec's tokenizer and a random-init causal LM under ``path``; skip if already built."""
    quiet_transformers()
    marker, recipe = path / TINY_MODEL_MARKER, tiny_recipe(spec, alphabet, seed)
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = bpe_tokenizer() if spec.tokenizer == "bpe" else char_tokenizer(alphabet)
    tokenizer.save_pretrained(path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        causal_lm(spec, vocab_size=len(tokenizer)).save_pretrained(path)
    marker.write_text(json.dumps(recipe))
    return path


TINY_CLASSES = {  # arch -> transformers' config and model classes
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def causal_lm(spec: TinyModelSpec, vocab_size: int):
    """A random-init causal LM of ``spec``'s shape (seed torch first for the same weights)."""
    import transformers

    # by name: only the chosen architecture's modules load (transformers imports each family lazily)
    config_name, model_name = TINY_CLASSES[spec.arch]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.mlp_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_size,  # Qwen3Config's default is 128
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return model_class(config)
