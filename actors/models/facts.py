"""What the topology check knows of the policy model without loading it (no torch, no transformers).

``TinyModelSpec`` is the ``model.init`` section; ``ModelFacts`` are the policy's attention
head size and the shapes of the state dict the trainer publishes, computed from the spec
(the architecture ``actors/models/tiny.py`` builds from it) or read from a Hugging Face
directory's ``config.json`` and safetensors headers. The checks that need them (an
engine's head sizes, the weight store's memory) then run before anything is spawned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from actors.models.safetensors_header import header_shapes

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# The bpe tokenizer's: padding, the end of a turn (its EOS), the start of a turn. Padding and EOS
# keep the ids the character tokenizer gives them (0 and 1), which ``causal_lm`` writes to the config.
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")
BPE_VOCAB_SIZE = 448  # the shipped arithmetic text yields 460 tokens at most
ARCHITECTURES = ("qwen3", "qwen2", "llama")
TOKENIZERS = ("chars", "bpe")


@dataclass(frozen=True)
class TinyModelSpec:
    """``model.init``: a random-init decoder of these shapes, built by the run (``actors/models/tiny.py``)."""

    arch: str = "qwen2"  # one of ARCHITECTURES: qwen3, qwen2, llama
    hidden_size: int = 64  # the residual stream's width
    layers: int = 2  # decoder layers
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (grouped-query attention): heads must be a multiple of it
    max_positions: int = 64  # the longest sequence, prompt and completion (max_position_embeddings)
    intermediate_size: int | None = None  # the MLP's width; None: 4 x hidden_size
    # chars: one token per character of the task's alphabet, no chat template (a random policy spreads its
    # mass over a few dozen tokens, so it learns fastest); bpe: a byte-level BPE of BPE_VOCAB_SIZE tokens
    # trained on the shipped arithmetic text, with a ChatML chat template (a real tokenizer's code paths)
    tokenizer: str = "chars"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown tiny architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tiny tokenizer {self.tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        for name in ("hidden_size", "layers", "heads", "kv_heads", "max_positions", "intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}): each key/value head "
                "serves a whole group of query heads; e.g. heads: 4, kv_heads: 2"
            )
        if self.head_size < 2 or self.head_size % 2:
            raise ValueError(
                f"the head size hidden_size // heads is {self.head_size}, but rotary embeddings rotate pairs of "
                "dimensions, so it must be even and >= 2; e.g. hidden_size: 64, heads: 4"
            )

    def vocab_size(self, alphabet: str | None) -> int:
        """The tokenizer's size: the character tokenizer's depends on the task's alphabet."""
        return BPE_VOCAB_SIZE if self.tokenizer == "bpe" else tiny_vocab_size(alphabet)

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.heads

    @property
    def mlp_size(self) -> int:
        return 4 * self.hidden_size if self.intermediate_size is None else self.intermediate_size

    def tensors(self, vocab_size: int) -> dict[str, tuple[int, ...]]:
        """The built model's state dict, name -> shape (``actors/models/tiny.py`` ``causal_lm``; a test holds them equal)."""
        h, head = self.hidden_size, self.head_size
        q, kv, mlp = self.heads * head, self.kv_heads * head, self.mlp_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
        for i in range(self.layers):
            layer = {
                "self_attn.q_proj.weight": (q, h),
                "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h),
                "self_attn.o_proj.weight": (h, q),
                "mlp.gate_proj.weight": (mlp, h),
                "mlp.up_proj.weight": (mlp, h),
                "mlp.down_proj.weight": (h, mlp),
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
            }
            if self.arch == "qwen2":  # q/k/v biases
                layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
            if self.arch == "qwen3":  # QK-norm
                layer |= {"self_attn.q_norm.weight": (head,), "self_attn.k_norm.weight": (head,)}
            shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
        return shapes | {"model.norm.weight": (h,), "lm_head.weight": (vocab_size, h)}


TINY_MODEL_MARKER = "tiny_model.json"  # in a built tiny model's directory: the recipe it was built from


def tiny_recipe(spec: TinyModelSpec, alphabet: str | None, seed: int) -> dict:
    """What fixes a tiny model's weights: its spec, its tokenizer's alphabet and the seed of its random init."""
    return {"spec": dict(spec.__dict__), "alphabet": alphabet, "seed": seed}


def tiny_vocab_size(alphabet: str) -> int:
    """The character tokenizer's size (``char_vocabulary``)."""
    return len(char_vocabulary(alphabet))


def char_vocabulary(alphabet: str) -> dict[str, int]:
    """The character tokenizer's vocabulary: the special tokens, then the byte-level symbol of each
    byte of the alphabet's characters (one per character for ASCII: ``a`` is ``a``, a space ``Ġ``).

    Byte-level, because transformers loads a ``qwen2`` model's tokenizer as its own
    ``Qwen2Tokenizer``, whatever the directory's tokenizer.json says: byte-level pre-tokenizing
    with this vocabulary. Spelling the vocabulary that way makes every loader give the same ids.
    """
    symbols = _byte_symbols()
    tokens = (*SPECIAL_TOKENS, *(symbols[byte] for char in alphabet for byte in char.encode()))
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's): printable bytes stand
    for themselves, the others (space, control bytes) for characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


@dataclass(frozen=True)
class ModelFacts:
    """``head_size``: attention head size (None: the config does not say). ``tensors``: the
    trainer's state dict, name -> shape (None: the directory has no safetensors weights).
    ``positions``: the longest sequence (prompt and completion) the model takes (None: unknown)."""

    head_size: int | None
    tensors: dict[str, tuple[int, ...]] | None
    positions: int | None = None

    @classmethod
    def of_spec(cls, spec: TinyModelSpec, alphabet: str | None) -> ModelFacts:
        return cls(spec.head_size, spec.tensors(spec.vocab_size(alphabet)), spec.max_positions)

    @classmethod
    def of_directory(cls, directory: Path) -> ModelFacts:
        """Read ``config.json`` and the safetensors headers; raises ``ValueError`` for unreadable files."""
        config = _json(directory / "config.json")
        config = config.get("text_config", config)
        head_size = config.get("head_dim")
        if not isinstance(head_size, int):
            hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
            head_size = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
        positions = config.get("max_position_embeddings")
        return cls(head_size, _safetensors_shapes(directory), _positive_int(positions))

    @property
    def vocabulary_rows(self) -> int | None:
        """The rows of the input embedding (the vocabulary), as far as the files say."""
        shape = (self.tensors or {}).get("model.embed_tokens.weight")
        return shape[0] if shape else None


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape, from the files ``from_pretrained`` reads (a sharded checkpoint's index, or
    ``model.safetensors``). A tied LM head is stored once, but the state dict names it twice (and the
    weight store holds both), so a missing ``lm_head.weight`` is counted as the embedding."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map; re-save the model with save_pretrained")
        files = sorted(set(map(str, weight_map.values())))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        shapes |= header_shapes(directory / name)
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not readable JSON ({error}); re-save the model with save_pretrained") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object; re-save the model")
    return data
