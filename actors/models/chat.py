"""How a model reads a task's prompt: through its own chat template, when it has one.

A task yields plain text (a question, an optional system prompt); which tokens frame it
is the model's business, so every place that tokenizes a prompt for a model (the
generator for the policy, a teacher binding for its teacher) renders it here, with that
model's tokenizer. The trainer then sees token ids only. A tokenizer without a chat
template (the tiny models' character tokenizer) reads the prompt as it is, so those
runs see exactly the tokens they always did.
"""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, prompt: str, system_prompt: str | None = None, hint: str | None = None) -> str:
    """The text before the model's completion.

    With a chat template: a system turn (when given), the user turn (the prompt, and the
    hint after a blank line: a self-hinting teacher reads the hint as part of the question,
    not as words the assistant already said), then the assistant's header. Without one:
    the system prompt on its own line(s) before the prompt, the hint right after it.
    """
    if not has_chat_template(tokenizer):
        return (f"{system_prompt}\n" if system_prompt else "") + prompt + (hint or "")
    user = f"{prompt}\n\n{hint}" if hint else prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
