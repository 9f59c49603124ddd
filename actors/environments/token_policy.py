"""One environment episode as the tokens the policy sampled, stitched as an agent's are.

``TokenPolicy`` is the policy ``run_episode`` calls, turned into tokens by the one stitcher every
multi-turn path uses (``actors.agents.chat_tokens``): each call's messages are the conversation
so far, which extends what was recorded by the environment's new observation, so only the observation's
tokens are rendered (by the chat template, after what it writes behind the reply's end-of-sequence
token; loss mask False, logprob 0) and the next reply is sampled from everything so far (loss mask True,
the sampler's logprobs). The model's tokens are kept exactly as sampled, never re-tokenized from text,
so the trainer scores the very tokens the sampler drew. A conversation the template renders differently
once a turn follows (it rewrites an earlier turn) cannot grow turn by turn: its next turn starts a row
of its own (``split``), as an agent's edited history does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from actors.agents.chat_tokens import ChatTokens
from actors.contract.rollouts import Trajectory

# Continue a token sequence with one sampled reply: (ids so far, turn) -> the reply alone.
Sampler = Callable[[list[int], int], Awaitable[Trajectory]]


@dataclass
class TokenPolicy:
    """The generator's policy for one episode; ``trajectory()`` and ``split`` once it ends."""

    tokens: ChatTokens
    sample: Sampler
    turns: int = 0

    async def __call__(self, messages: list[dict[str, str]]) -> str:
        prompt = self.tokens.prompt(messages)
        reply = await self.sample(prompt.ids, self.turns)
        self.turns += 1
        message = {"role": "assistant", "content": reply.text}
        self.tokens.add(prompt, reply, message, self.tokens.tokenizer.eos_token_id)
        return reply.text

    def trajectory(self) -> Trajectory:
        """The episode's first row; its text is the model's replies, one per line."""
        segments = self.tokens.segments
        return segments[0].trajectory() if segments else Trajectory([], [], [], [], "")

    @property
    def split(self) -> tuple[Trajectory, ...]:
        """The rows after the first, where the conversation could not be stitched into one sequence."""
        return tuple(segment.trajectory() for segment in self.tokens.segments[1:])
