"""Environments: multi-turn episodes and external tasksets, behind interfaces that carry only text.

A multi-turn environment is played one episode per session: ``reset`` opens the
episode, then each ``step`` takes the model's reply and answers with the next
observation, a reward and whether the episode is over. The episode loop
(``actors.environments.episode``) alternates the policy and the environment; the
backends here (``openenv``) turn a remote environment into this interface, so the
loop knows nothing of transports.

Only text crosses this boundary. Tokens are the generator's business: it renders
each observation as a user message with the model's chat template and masks those
tokens out of the loss (``actors.environments.token_policy``, by the stitcher agents use), so
an episode trains only on the model's own replies.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Turn:
    """What the environment answers: the observation text, this step's reward (0.0 where the
    environment gave none, and for ``reset``), and whether the episode is over."""

    observation: str
    reward: float
    done: bool


class EpisodeError(Exception):
    """An episode the environment could not carry to its end (server down, timeout, malformed
    answer). It fails that episode only: the loop records ``reason`` and the run goes on."""

    def __init__(self, where: str, episode: str, reason: str):
        self.where, self.episode, self.reason = where, episode, reason
        super().__init__(f"environment {where}, episode {episode}: {reason}")


class Environment(Protocol):
    """One open episode session."""

    async def reset(self, seed: int) -> Turn:
        """Start the episode; the observation is the opening user message."""

    async def step(self, action: str) -> Turn:
        """Play the model's reply; raises ``EpisodeError`` when the environment fails."""


class Environments(Protocol):
    """Where episode sessions come from. ``episode`` waits while the environment already holds as
    many sessions as it allows, so callers may start any number of episodes at once."""

    @property
    def name(self) -> str:
        """Names the environment in metrics and errors (e.g. its URL)."""

    def episode(self, episode_id: str) -> AbstractAsyncContextManager[Environment]:
        """A session for one episode, closed on exit; raises ``EpisodeError`` if it cannot open."""
