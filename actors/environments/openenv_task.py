"""``task: {name: openenv, ...}``: a multi-turn OpenEnv environment as the run's task.

An episode task has no text to reward: its prompts are episodes, each opened by the
environment's ``reset`` with a seed, and its reward is what the environment pays along
the way (``actors.environments.episode``). So it has ``problems`` (one per episode
seed: a group is ``group_size`` episodes of the same seed, so advantages compare
plays of one game) and ``episodes`` (what a generator needs to play them), and no
``reward``: the generators play the episodes and the Rewarder is not asked.

Where the server comes from:

- ``url``: one already running where every generator reaches it;
- ``serve: {app: package.module:factory, params: {...}}``: the run starts
  ``factory(**params)`` (a FastAPI app, e.g. openenv's ``create_app``) on a free local port
  before the actors and stops it at the end (``actors.environments.serve``); local
  launchers only, since generators on other hosts would not reach it.

This module imports nothing heavy: the topology check builds the task.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace

from actors.basics.urls import check_url
from actors.tasks import MAX_TIMEOUT_S, OBSERVATION_ALPHABET, Problem

# The character tokenizer of a tiny model (model.init) reads the observations too: every
# character an environment may say must be in its vocabulary, or it reads as <unk>.


@dataclass(frozen=True)
class OpenEnvConfig:
    """- ``url``: the server's base URL (``http://host:port``; ``ws://`` works too).
    - ``max_concurrent``: sessions held at once; at most the server's ``max_concurrent_envs``.
    - ``action_field``: the action field the reply goes into; unset, the action schema's one
      required field (read from ``GET /schema`` once).
    - ``observation_field``: the observation field holding its text; unset, the whole observation
      as JSON (what verifiers' OpenEnv taskset shows the model).
    - ``timeout_s``: the limit of each call (connect, reset, step).
    """

    url: str
    max_concurrent: int = 1
    action_field: str | None = None
    observation_field: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            check_url(self.url, ("http", "https", "ws", "wss"))
        except ValueError as error:
            raise ValueError(f"OpenEnv url {self.url!r}: {error}; give http://host:port (or ws://)") from None
        if self.max_concurrent < 1 or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"OpenEnv {self.url}: max_concurrent must be >= 1 and timeout_s in (0, {MAX_TIMEOUT_S}] seconds "
                f"(a day), got {self.max_concurrent} and {self.timeout_s}"
            )


@dataclass(frozen=True)
class EpisodeSpec:
    """How a generator plays this task's episodes: the environment, the turn limit, the
    system prompt before the opening observation, and whether every turn is the argmax
    continuation (the held-out evaluation's, ``loop.evaluation.greedy``) rather than a sample."""

    environment: OpenEnvConfig
    max_turns: int
    system_prompt: str | None = None
    greedy: bool = False

    def shared_by(self, players: int) -> EpisodeSpec:
        """This spec for one of ``players`` clients of the same server: each holds its share of
        the sessions (at least one; a client refused a session waits for one, see ``OpenEnv``)."""
        share = max(1, self.environment.max_concurrent // players)
        return replace(self, environment=replace(self.environment, max_concurrent=share))


@dataclass(frozen=True)
class ServeConfig:
    """A server the run starts: ``app`` is ``package.module:factory``, called with ``params``."""

    app: str
    params: dict = field(default_factory=dict)


class OpenEnvTask:
    """Episodes of an OpenEnv environment; see the module docstring."""

    def __init__(
        self,
        url: str | None = None,
        serve: dict | None = None,
        max_turns: int = 8,  # replies per episode
        max_concurrent: int = 1,
        action_field: str | None = None,
        observation_field: str | None = None,
        timeout_s: float = 30.0,
        system_prompt: str | None = None,  # a system turn before the opening observation
        alphabet: str = OBSERVATION_ALPHABET,  # a tiny model's characters: those an environment may say
    ):
        if (url is None) == (serve is None):
            raise ValueError(
                "task openenv needs exactly one of url (a running server, http://host:port) and serve "
                "({app: package.module:factory, params: {...}}, a server this run starts)"
            )
        if max_turns < 1:
            raise ValueError(f"task openenv: max_turns must be >= 1, got {max_turns}")
        self.serve = _serve_config(serve) if serve is not None else None
        # a served environment's url is known once it runs; this one only checks the other options
        self._environment = OpenEnvConfig(
            url or "http://127.0.0.1", max_concurrent, action_field, observation_field, timeout_s
        )
        self.max_turns, self.system_prompt, self.alphabet = max_turns, system_prompt, alphabet

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        """One episode seed per prompt, a pure function of ``(seed, step, i)``; the prompt itself is
        the environment's opening observation, so the problem carries only the seed."""
        return [
            Problem(prompt="", answer="", system_prompt=self.system_prompt, data=json.dumps({"seed": seed_of(p)}))
            for p in (f"{seed}/{step}/{i}" for i in range(count))
        ]

    def episodes(self, url: str | None = None) -> EpisodeSpec:
        """The spec generators play with; ``url``: where a served environment runs."""
        environment = replace(self._environment, url=url) if url is not None else self._environment
        return EpisodeSpec(environment, self.max_turns, self.system_prompt)


def episode_seed(problem: Problem) -> int:
    return json.loads(problem.data)["seed"]


def seed_of(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") >> 1  # 31 bits


def _serve_config(raw: dict) -> ServeConfig:
    app = raw.get("app") if isinstance(raw, dict) else None
    if set(raw or {}) - {"app", "params"} or not isinstance(app, str) or ":" not in app:
        raise ValueError(
            f"task openenv: serve is {raw!r}; write serve: {{app: package.module:factory, params: {{...}}}}"
        )
    from actors import registry

    registry.resolve("task", app)  # the module must be findable; nothing runs
    return ServeConfig(app, dict(raw.get("params") or {}))
