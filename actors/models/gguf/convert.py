"""A GGUF file as the Hugging Face model it becomes: what the check knows of it, and the conversion.

The check (``gguf_facts``) reads the header only (``actors/models/gguf/header.py``) and refuses what
transformers' GGUF loader would turn into a wrong model or fail on late: an architecture whose
tensor names are not mapped here, a tensor the Hugging Face model has no place for, a missing
one (transformers would leave it randomly initialized), a ggml type the ``gguf`` package cannot
dequantize, a file without a tokenizer. What it derives, ``ModelFacts``, is what the converted
directory's files say (a test holds them equal).

``dequantized`` is the one place that imports torch and transformers: transformers dequantizes
the file into float32 (it marks a GGUF-loaded model quantized and will not save it, so the
weights move into a plain model, which saves as an ordinary directory).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

from actors.models.facts import ModelFacts
from actors.models.gguf.header import GGML_TYPES, GGUFError, GGUFHeader

LLAMA_BLOCK = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
# general.architecture -> the block tensors its models have. llama.cpp writes Mistral models as "llama"
# (transformers tells them apart by general.name); the gguf package has no "mistral" architecture to map.
BLOCK_TENSORS = {
    "llama": LLAMA_BLOCK,
    "qwen2": LLAMA_BLOCK,
    "qwen3": (*LLAMA_BLOCK, "attn_q_norm", "attn_k_norm"),
}
BIASED = {"qwen2": ("attn_q", "attn_k", "attn_v")}  # the blocks' tensors that also have a .bias
HF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama 3's RoPE frequencies: transformers computes them from the config, so the file's copy is not loaded
DERIVED = ("rope_freqs.weight",)
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_facts(header: GGUFHeader) -> ModelFacts:
    """The head size and the Hugging Face state dict (name -> shape) of the model the file converts into;
    raises ``GGUFError`` for a file it would not convert into a whole model."""
    arch = _architecture(header)
    _check_types(header)
    if "tokenizer.ggml.tokens" not in header.metadata:
        raise GGUFError(
            "holds no tokenizer (no tokenizer.ggml.tokens), and a policy needs one; use a GGUF file that ships its "
            "tokenizer, as llama.cpp's converter writes them"
        )
    shapes = {_hf_name(arch, tensor.name): tensor.shape for tensor in header.tensors if tensor.name not in DERIVED}
    layers, heads = _positive(header, f"{arch}.block_count"), _positive(header, f"{arch}.attention.head_count")
    if missing := sorted(_expected(arch, layers) - shapes.keys()):
        raise GGUFError(
            f"lacks {len(missing)} weight(s) a {arch} model of {layers} layers has (the first: {missing[0]}), which "
            "transformers would fill with random values; use a whole model file"
        )
    shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])  # tied: the state dict names it twice
    positions = header.metadata.get(f"{arch}.context_length")
    positions = positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None
    return ModelFacts(shapes["model.layers.0.self_attn.q_proj.weight"][0] // heads, shapes, positions)


def _architecture(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in BLOCK_TENSORS:
        raise GGUFError(
            f"is a model of architecture {arch!r} (general.architecture), which is not converted here; GGUF files of "
            f"{', '.join(BLOCK_TENSORS)} are (Mistral's are written as llama), or give a Hugging Face model directory"
        )
    return arch


def _check_types(header: GGUFHeader) -> None:
    for tensor in header.tensors:
        kind = GGML_TYPES[tensor.ggml_type]
        if not kind.dequantized:
            raise GGUFError(
                f"stores tensor {tensor.name} as {kind.name}, which the gguf package cannot dequantize into floats; "
                "use a file quantized another way (e.g. Q4_K_M, Q8_0 or F16)"
            )


def _hf_name(arch: str, name: str) -> str:
    """The Hugging Face state-dict name of GGUF tensor ``name``."""
    top, _, suffix = name.rpartition(".")
    if top in HF_TOP and suffix == "weight":
        return f"{HF_TOP[top]}.weight"
    block = BLOCK_NAME.fullmatch(name)
    if block and block[2] in BLOCK_TENSORS[arch] and (block[3] == "weight" or block[2] in BIASED.get(arch, ())):
        return f"model.layers.{int(block[1])}.{HF_BLOCK[block[2]]}.{block[3]}"
    raise GGUFError(
        f"holds tensor {name}, which a {arch} model has no place for (transformers would drop it); use a file "
        f"written for {arch} by llama.cpp's converter"
    )


def _expected(arch: str, layers: int) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"}
    for i in range(layers):
        names |= {f"blk.{i}.{part}.weight" for part in BLOCK_TENSORS[arch]}
        names |= {f"blk.{i}.{part}.bias" for part in BIASED.get(arch, ())}
    return {_hf_name(arch, name) for name in names}


def _positive(header: GGUFHeader, key: str) -> int:
    value = header.metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GGUFError(f"has {key} {value!r}, not a positive integer; use a file written by llama.cpp's converter")
    return value


def dequantized(gguf: Path, facts: ModelFacts) -> tuple:
    """(model, tokenizer): ``gguf`` dequantized into a plain float32 model, which ``save_pretrained`` writes as an
    ordinary directory, and its tokenizer (with the chat template). Raises ``GGUFError`` where transformers
    builds a model of other shapes than the file's; its own errors pass through."""
    with _without_progress_bars():
        return _dequantize(gguf, facts)


@contextlib.contextmanager
def _without_progress_bars() -> Iterator[None]:
    """The run says in one line that it converts; transformers' own bars (tqdm's, written to stderr, one of them
    outside transformers' switch) would fill the terminal around it."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


def _dequantize(gguf: Path, facts: ModelFacts) -> tuple:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "head_dim"):  # transformers leaves qwen3's at its default (128), whatever the file's
        config.head_dim = facts.head_size
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32)
    del loaded.config.quantization_config
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    built = {name: tuple(tensor.shape) for name, tensor in plain.state_dict().items()}
    if built != facts.tensors:
        odd = sorted(name for name in built.keys() | facts.tensors.keys() if built.get(name) != facts.tensors.get(name))
        raise GGUFError(
            f"converts into a model whose tensors differ from the file's (e.g. {odd[0]}: {facts.tensors.get(odd[0])} "
            f"in the file, {built.get(odd[0])} built), which this transformers cannot load right; use a Hugging Face "
            "model directory instead"
        )
    return plain, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def float32_bytes(header: GGUFHeader) -> int:
    """What the converted weights take on disk: every tensor of the file in float32 (a tied head once)."""
    return 4 * sum(math.prod(tensor.dims) for tensor in header.tensors if tensor.name not in DERIVED)
