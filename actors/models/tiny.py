"""Policy models: a tiny random-init model built on the spot, or a local HF directory.

Either way the result is a directory that every engine and trainer loads by path, the
same way (HF, TRL, vLLM all do), so a tiny CPU run and a real model take one code path.
The tiny model's tokenizer has one token per character of the task's alphabet by default:
a random policy then spreads its mass over a handful of tokens rather than a 150k
vocabulary, which is what lets it learn on a CPU in minutes. ``tokenizer: bpe`` gives it
a real one instead, as a released model has: byte-level BPE, special tokens and a ChatML
chat template, trained here (deterministically, in a fraction of a second) on the
shipped arithmetic word problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from actors.models.facts import (
    BPE_VOCAB_SIZE,
    CHAT_SPECIAL_TOKENS,
    TINY_MODEL_MARKER,
    TinyModelSpec,
    char_vocabulary,
    tiny_recipe,
)
from actors.tasks.arithmetic_data import DATA_DIR

# transformers' Qwen2Tokenizer's PRETOKENIZE_REGEX (see ``_byte_level``)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# ChatML, as Qwen's templates write it: each turn <|im_start|>role\n...<|im_end|>\n; the prompt ends
# with the assistant's header, and the assistant's <|im_end|> is the EOS that ends its completion.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_model(path: Path, spec: TinyModelSpec, alphabet: str | None, seed: int) -> Path:
    """Save the spec's tokenizer and a random-init causal LM under ``path``; skip if already built."""
    _quiet_transformers()
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


def char_tokenizer(alphabet: str):
    """One token per character (per byte-level symbol, ``char_vocabulary``), no merges."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = _byte_level(Tokenizer(models.BPE(vocab=char_vocabulary(alphabet), merges=[])))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def bpe_tokenizer():
    """A byte-level BPE of ``BPE_VOCAB_SIZE`` tokens (every text encodes: its base is the 256 bytes)
    with the ChatML template; trained on the shipped arithmetic train split, framed as chats so the
    role names are tokens too. The same corpus always trains the same tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_chats(), trainer)
    pad, eos, start = CHAT_SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, eos_token=eos, additional_special_tokens=[start]
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def _byte_level(backend):
    """Qwen2's normalizer, pre-tokenizer (one token per digit) and decoder. transformers loads a
    ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``, which rebuilds exactly these around the saved
    vocabulary; with them saved too, every architecture's loader gives the same ids."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _chats():
    with (DATA_DIR / "train.jsonl").open() as rows:
        for row in map(json.loads, rows):
            yield f"<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n{row['question']}<|im_end|>\n"
            yield f"<|im_start|>assistant\n{row['solution']}<|im_end|>\n"


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


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def number_tokens(path: str | Path) -> Tensor:
    """``[V]`` bool: True at each token of the model's tokenizer whose text holds a digit (the tokens that spell
    numbers), so a step's metrics can say how its number tokens and its wording differ (``TokenSplit``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
    return torch.tensor([any(character.isdigit() for character in text) for text in texts], dtype=torch.bool)


def _quiet_transformers() -> None:
    """No per-shard progress bars: a run has its own progress bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()
