"""The policy as engines, trainers and teachers load it: (model, tokenizer) from a local HF directory."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
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


def quiet_transformers() -> None:
    """No per-shard progress bars: a run has its own progress bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@contextmanager
def lm_head_off(model: nn.Module) -> Iterator[None]:
    """The causal LM ``model`` (or a PEFT model's) returns its last hidden states where its logits were while the body
    runs: a forward through a wrapper that must see the whole model (DDP) builds no logits, and the loss forms them
    chunk by chunk from the head's weight (``actors.models.lora.head_weight``, ``losses.LinearHead``)."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(nn.Identity())
    try:
        yield
    finally:
        model.set_output_embeddings(head)
