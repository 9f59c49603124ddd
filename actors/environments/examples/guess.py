"""A number-guessing game served as an OpenEnv environment: the smallest truly multi-turn one.

openenv-core 0.3.0 ships no example environment in its wheel (only the ``openenv init``
template, an echo server that never ends an episode), so this one stands in. Each
episode draws a secret number from its seed; every guess is answered with ``higher``,
``lower`` or ``correct``, and the episode ends on the right guess (reward 1) or after
``max_guesses`` (reward 0). A reply that is not a number costs a guess and says so.

Serve it with ``python -m actors.environments.examples.guess --port 8000 --max-sessions 4``.
"""

from __future__ import annotations

import argparse
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

    def __init__(self, high: int = 16, max_guesses: int = 6):
        super().__init__()
        self.high, self.max_guesses = high, max_guesses
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
        if guess is None:
            text = f"{action.message.strip()!r} is not a whole number"
        else:
            text = "higher" if guess < self.secret else "lower"
        if left <= 0:
            return GuessObservation(message=f"{text}; no guesses left, it was {self.secret}", reward=0.0, done=True)
        return GuessObservation(message=text, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def build_app(max_sessions: int = 4, high: int = 16, max_guesses: int = 6) -> FastAPI:
    """The FastAPI app with ``/ws`` sessions (one environment each, at most ``max_sessions`` at once)."""
    factory = functools.partial(GuessEnvironment, high=high, max_guesses=max_guesses)
    return create_app(factory, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=max_sessions)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=4)
    parser.add_argument("--high", type=int, default=16)
    parser.add_argument("--max-guesses", type=int, default=6)
    args = parser.parse_args()
    app = build_app(args.max_sessions, args.high, args.max_guesses)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
