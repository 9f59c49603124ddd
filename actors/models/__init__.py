"""Where a model comes from and what it is: its source, its facts, tokenizers, the tiny model, LoRA."""
