"""Policy models: a tiny random-init model built on the spot, or a local HF directory.

Either way the result is a directory that every engine and trainer loads by path, the
same way (HF, TRL, vLLM all do), so a tiny CPU run and a real model take one code path.
The tiny model's tokenizer has one token per character of the task's alphabet: a
random policy then spreads its mass over a handful of tokens rather than a 150k
vocabulary, which is what lets it learn on a CPU in minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.model_config import SPECIAL_TOKENS, TinyModelSpec


def build_tiny_model(path: Path, spec: TinyModelSpec, alphabet: str, seed: int) -> Path:
    """Save a character tokenizer and a random-init causal LM under ``path``; skip if already built."""
    _quiet_transformers()
    marker = path / "tiny_model.json"
    recipe = {"spec": spec.__dict__, "alphabet": alphabet, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer(alphabet)
    tokenizer.save_pretrained(path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        causal_lm(spec, vocab_size=len(tokenizer)).save_pretrained(path)
    marker.write_text(json.dumps(recipe))
    return path


def char_tokenizer(alphabet: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in dict.fromkeys(alphabet):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def causal_lm(spec: TinyModelSpec, vocab_size: int):
    """A random-init causal LM of ``spec``'s shape (seed torch first for the same weights)."""
    import transformers

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[spec.arch]
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


@dataclass(frozen=True)
class Placement:
    """Where one actor's process computes: its CPU threads, and the GPUs it sees. The launcher
    starts each process seeing exactly its GPUs (``mesh/placement.py``), so they are always
    ``cuda:0`` .. ``cuda:gpus-1`` here. ``memory_share``: the share of each GPU's memory the
    actor may take when another process holds the rest (None: all of it)."""

    threads: int = 1
    gpus: int = 0
    memory_share: float | None = None

    def device(self) -> torch.device:
        """The process's first GPU, made the current CUDA device; or the CPU."""
        if not self.gpus:
            return torch.device("cpu")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        return device


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def _quiet_transformers() -> None:
    """No per-shard progress bars: a run has its own progress bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()
