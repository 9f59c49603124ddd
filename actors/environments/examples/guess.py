"""A number-guessing game served as an OpenEnv environment: the smallest truly multi-turn one.

openenv-core 0.3.0 ships no example environment in its wheel (only the ``openenv init``
template, an echo server that never ends an episode), so this one stands in. Each
episode draws a secret number from its seed; every guess is answered with ``higher``,
``lower`` or ``correct``, and the episode ends on the right guess (reward 1) or after
``max_guesses``. A reply that is not a number costs a guess and says so; a wrong guess
that is a number in range earns ``valid_guess_reward`` (0 by default: reward only a win),
which lets a model that starts from random weights find the answer format.

Serve it with ``python -m actors.environments.serve actors.environments.examples.guess:build_app --port 8000
--params '{"max_sessions": 4}'``, or name it in a topology (``task.serve``, see
``topologies/env_multiturn.yaml``).
"""

from __future__ import annotations

import functools
import random
import uuid

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    message: str = Field(..., description="The guess, a whole number")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the game says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session owns its secret; nothing is shared

    def __init__(self, high: int = 16, max_guesses: int = 6, valid_guess_reward: float = 0.0):
        super().__init__()
        self.high, self.max_guesses, self.valid_guess_reward = high, max_guesses, valid_guess_reward
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.secret = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        text = f"I picked a whole number from 1 to {self.high}. You have {self.max_guesses} guesses. Guess it."
        return GuessObservation(message=text, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        left = self.max_guesses - self._state.step_count
        try:
            guess = int(action.message.strip())
        except ValueError:
            guess = None
        if guess == self.secret:
            return GuessObservation(message="correct", reward=1.0, done=True)
        reward = self.valid_guess_reward if guess is not None and 1 <= guess <= self.high else 0.0
        if guess is None:
            text = f"{action.message.strip()!r} is not a whole number"
        else:
            text = "higher" if guess < self.secret else "lower"
        if left <= 0:
            return GuessObservation(message=f"{text}; no guesses left, it was {self.secret}", reward=reward, done=True)
        return GuessObservation(message=text, reward=reward)

    @property
    def state(self) -> State:
        return self._state


def build_app(max_sessions: int = 4, high: int = 16, max_guesses: int = 6, valid_guess_reward: float = 0.0) -> FastAPI:
    """The FastAPI app with ``/ws`` sessions (one environment each, at most ``max_sessions`` at once)."""
    factory = functools.partial(
        GuessEnvironment, high=high, max_guesses=max_guesses, valid_guess_reward=valid_guess_reward
    )
    return create_app(factory, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=max_sessions)
