"""Tokenizers for the tiny model: one token per character of the task's alphabet (the default), or a
byte-level BPE with special tokens and a ChatML chat template (``tokenizer: bpe``), as a released model has,
trained here (deterministically, in a fraction of a second) on the shipped arithmetic word problems.
"""

from __future__ import annotations

import json

from actors.models.facts import BPE_VOCAB_SIZE, CHAT_SPECIAL_TOKENS, char_vocabulary
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

