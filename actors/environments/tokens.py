"""One episode as one trajectory: the model's turns as sampled, the environment's in between.

``TokenPolicy`` is the policy ``run_episode`` calls, turned into tokens: its first call
renders the opening messages (system prompt, first observation) into the prompt ids;
every later call appends the new observation's tokens (loss mask False, logprob 0) and
samples the next reply from everything so far (loss mask True, the sampler's logprobs).
The model's tokens are kept exactly as sampled, never re-tokenized from text, so the
trainer scores the very tokens the sampler drew.

Between a reply and the next reply the chat template puts the end of the assistant's
turn, the observation's turn and the next assistant header. ``ChatFrame`` reads those
from the template itself, once: it renders a probe conversation with and without one
more observation and keeps the difference, so any template that renders a conversation
as the concatenation of its turns works. A tokenizer without a template (the tiny models'
character tokenizer) reads the observation right after the reply's EOS.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from actors.environments import observation_message
from actors.prompts import has_chat_template, render
from actors.rollout import Trajectory

# Continue a token sequence with one sampled reply: (ids so far, turn) -> the reply alone.
Sampler = Callable[[list[int], int], Awaitable[Trajectory]]

_PROBE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "reply"}]


@dataclass(frozen=True)
class ChatFrame:
    """What a chat template writes around an observation that follows an assistant reply:
    ``after_eos`` closes the assistant's turn after its EOS token (``"\\n"`` in ChatML), and
    ``observation`` renders one with the next assistant header after it."""

    eos: str
    after_eos: str
    observation: Callable[[str], str]

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFrame:
        eos = tokenizer.eos_token
        if not has_chat_template(tokenizer):
            return cls(eos, "", lambda text: text)
        history = tokenizer.apply_chat_template(_PROBE, tokenize=False)
        end = history.rfind(eos)
        after_eos = history[end + len(eos) :] if end > history.rfind("reply") else ""

        def observation(text: str) -> str:
            messages = [*_PROBE, observation_message(text)]
            full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if not full.startswith(history):
                raise ValueError(
                    "this model's chat template renders an earlier turn differently once an observation follows "
                    "it, so an episode cannot grow turn by turn; use a template that renders a conversation as "
                    "its turns in order (ChatML, Llama 3, ...)"
                )
            return full[len(history) :]

        return cls(eos, after_eos, observation)


@dataclass
class TokenPolicy:
    """The generator's policy for one episode; ``trajectory()`` once it ends."""

    tokenizer: Any
    frame: ChatFrame
    sample: Sampler
    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    ended_with_eos: bool = True

    async def __call__(self, messages: list[dict[str, str]]) -> str:
        if self.prompt_ids is None:
            system = messages[0]["content"] if messages[0]["role"] == "system" else None
            self.prompt_ids = self._encode(render(self.tokenizer, messages[-1]["content"], system))
        else:
            bridge = ("" if self.ended_with_eos else self.frame.eos) + self.frame.after_eos
            self._extend(self._encode(bridge + self.frame.observation(messages[-1]["content"])), None)
        reply = await self.sample(self.prompt_ids + self.completion_ids, len(self.replies))
        self._extend(reply.completion_ids, reply.logprobs)
        self.ended_with_eos = bool(reply.completion_ids) and reply.completion_ids[-1] == self.tokenizer.eos_token_id
        self.replies.append(reply.text)
        return reply.text

    def trajectory(self) -> Trajectory:
        """The episode so far; its text is the model's replies, one per line."""
        return Trajectory(
            self.prompt_ids or [], self.completion_ids, self.logprobs, self.loss_mask, "\n".join(self.replies)
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _extend(self, ids: list[int], logprobs: list[float] | None) -> None:
        """The model's own tokens (with their logprobs), or the environment's (``None``)."""
        self.completion_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [logprobs is not None] * len(ids)
