"""OpenEnv environments over their WebSocket session (openenv-core 0.3.0).

An OpenEnv server (``create_app``) keeps one environment instance per WebSocket
connection on ``/ws``; its HTTP ``/reset`` and ``/step`` build a fresh instance per
request, so an episode must live on one connection. ``OpenEnv`` opens one connection
per episode with openenv's own async client and turns its dict observations into
``Turn`` text.

Concurrency: the server refuses connections beyond its ``max_concurrent_envs``
(default 1) with ``CAPACITY_REACHED``, and no route reports that limit, so the client
is told it: ``max_concurrent`` bounds the sessions this client holds at once (a
semaphore; processes sharing one server split its limit between them). A session the
server refuses all the same (other clients hold the rest) is asked for again until
``timeout_s``, then its episode fails with the server's limit in the reason.

Every failure of a call (no server, no answer within ``timeout_s``, the connection
dropped, a server error, an observation without text) becomes an ``EpisodeError``
naming the URL, the episode and the call, which fails that episode only.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar

import httpx
from openenv.core.client_types import StepResult
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed

from actors.environments import EpisodeError, Turn
from actors.environments.openenv_task import OpenEnvConfig

T = TypeVar("T")


class ServerError(RuntimeError):
    """An error frame from the server, with its code (``CAPACITY_REACHED``, ``EXECUTION_ERROR``...)."""

    def __init__(self, data: dict[str, Any]):
        self.code, self.data = str(data.get("code", "UNKNOWN")), data
        super().__init__(f"{data.get('message', 'no message')} (code {self.code})")


class _Client(GenericEnvClient):
    """openenv's client with three fixes to 0.3.0: an error frame keeps its code (0.3.0 flattens it
    into a RuntimeError's text); a frame the server sent just before closing is still read (a
    refused connection is closed before the client's first message, and 0.3.0 reports only the
    closure, losing the reason); and the server closes the connection (see ``disconnect``)."""

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            await self._send(message)
        except ConnectionClosed:
            pass  # the reason, if the server gave one, is buffered: read it below
        response = await self._receive()
        if response.get("type") == "error":
            raise ServerError(response.get("data", {}))
        return response

    async def disconnect(self) -> None:
        """Say ``close`` and let the server close the connection: it frees the session first, so the
        slot is free when this returns (0.3.0's client closes at once, and the server then also logs
        a traceback for every session, its own close finding the connection gone)."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), self._message_timeout)
        except (ConnectionClosed, TimeoutError, OSError):
            pass  # already gone, or slow to close: closed from this side below
        finally:
            await ws.close()


class OpenEnv:
    """An OpenEnv server as a source of episode sessions (``actors.environments.Environments``)."""

    def __init__(self, cfg: OpenEnvConfig):
        self.cfg = cfg
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self._field_lock = asyncio.Lock()
        self._action_field = cfg.action_field

    @property
    def name(self) -> str:
        return self.cfg.url

    @asynccontextmanager
    async def episode(self, episode_id: str) -> AsyncIterator[OpenEnvSession]:
        async with self._slots:
            session = await self._admitted(await self._field(episode_id), episode_id)
            try:
                yield session
            finally:
                await session.close()

    async def _admitted(self, action_field: str, episode_id: str) -> OpenEnvSession:
        """An open session, asked for again while the server is at capacity, up to ``timeout_s``."""
        deadline, pause = time.monotonic() + self.cfg.timeout_s, 0.05
        while True:
            session = OpenEnvSession(self.cfg, action_field, episode_id)
            try:
                await session.open()
                return session
            except EpisodeError as error:
                await session.close()
                refused = isinstance(error.__cause__, ServerError) and error.__cause__.code == "CAPACITY_REACHED"
                if not refused or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    async def _field(self, episode_id: str) -> str:
        """The action field: configured, or the action schema's one required field."""
        async with self._field_lock:
            if self._action_field is None:
                self._action_field = await self._schema_field(episode_id)
        return self._action_field

    async def _schema_field(self, episode_id: str) -> str:
        base = self.cfg.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
        try:
            async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as http:
                response = await http.get(f"{base}/schema")
                response.raise_for_status()
                action = response.json()["action"]
        except (httpx.HTTPError, KeyError, ValueError) as error:
            raise EpisodeError(
                self.cfg.url,
                episode_id,
                f"cannot read the action schema at {base}/schema ({type(error).__name__}: {error}); "
                "check that the server runs there, or set action_field",
            ) from error
        required = action.get("required", [])
        if len(required) != 1:
            raise EpisodeError(
                self.cfg.url,
                episode_id,
                f"the action schema requires fields {required}, not exactly one the reply could fill; "
                "set action_field to the field that takes the model's text",
            )
        return required[0]


class OpenEnvSession:
    """One episode on one WebSocket connection (``actors.environments.Environment``)."""

    def __init__(self, cfg: OpenEnvConfig, action_field: str, episode_id: str):
        self.cfg, self.action_field, self.episode_id = cfg, action_field, episode_id
        self.client = _Client(cfg.url, connect_timeout_s=cfg.timeout_s, message_timeout_s=cfg.timeout_s)
        self.steps = 0

    async def open(self) -> None:
        """Connect, and ask the state: a server at capacity accepts the connection, then refuses it
        with an error frame, so only a first answer tells whether the session exists."""
        await self.call("connect", self.client.connect())
        await self.call("open", self.client.state())

    async def close(self) -> None:
        """Best effort, bounded: a dead or hung server must not hold the slot."""
        try:
            await asyncio.wait_for(self.client.close(), self.cfg.timeout_s)
        except (TimeoutError, OSError):
            pass

    async def reset(self, seed: int) -> Turn:
        result = await self.call("reset", self.client.reset(seed=seed, episode_id=self.episode_id))
        return self._turn("reset", result)

    async def step(self, action: str) -> Turn:
        self.steps += 1
        what = f"step {self.steps}"
        return self._turn(what, await self.call(what, self.client.step({self.action_field: action})))

    async def call(self, what: str, call: Awaitable[T]) -> T:
        """Await one call under the timeout; every way it can fail becomes an ``EpisodeError``
        (whatever a remote environment does fails its episode, not the run)."""
        try:
            return await asyncio.wait_for(call, self.cfg.timeout_s)
        except Exception as error:  # see above; the cause stays chained
            raise EpisodeError(self.cfg.url, self.episode_id, self._reason(what, error)) from error

    def _reason(self, what: str, error: Exception) -> str:
        if isinstance(error, TimeoutError):
            return (
                f"{what} got no answer within {self.cfg.timeout_s} s; the environment is hung or slower than "
                "timeout_s: fix it or raise timeout_s"
            )
        if isinstance(error, ConnectionClosed):
            return f"the connection closed during {what} ({error}); the server died or dropped the session"
        if isinstance(error, ServerError):
            if error.code != "CAPACITY_REACHED":
                return f"the server refused {what}: {error}"
            return (
                f"the server refused {what}: {error}; it holds at most {error.data.get('max_sessions')} sessions: "
                "lower max_concurrent to that (shared among the clients of this server) or raise its "
                "max_concurrent_envs"
            )
        if isinstance(error, OSError) and what == "connect":  # openenv's client wraps each in a ConnectionError
            return f"cannot open a session ({error}); start the server or fix the url"
        if isinstance(error, OSError):
            return f"{what} failed on the network ({type(error).__name__}: {error}); the server died or is unreachable"
        return (
            f"{what} got an answer the client cannot read ({type(error).__name__}: {error}); is it an OpenEnv server?"
        )

    def _turn(self, what: str, result: StepResult) -> Turn:
        observation, reward, done = result.observation, result.reward, result.done
        if not isinstance(observation, dict):
            self._malformed(what, f"an observation of type {type(observation).__name__}, not an object")
        if reward is not None and not isinstance(reward, (int, float)):
            self._malformed(what, f"a reward of type {type(reward).__name__}, not a number")
        if reward is not None and not math.isfinite(reward):
            self._malformed(what, f"a reward of {reward}, not a finite number")
        if not isinstance(done, bool):
            self._malformed(what, f"a done flag of type {type(done).__name__}, not a bool")
        return Turn(self._text(what, observation), float(reward or 0.0), done)

    def _text(self, what: str, observation: dict[str, Any]) -> str:
        field = self.cfg.observation_field
        if field is None:
            return json.dumps(observation, sort_keys=True, ensure_ascii=False)
        text = observation.get(field)
        if not isinstance(text, str):
            self._malformed(
                what, f"no text in observation field {field!r} (fields: {sorted(observation)}); set observation_field"
            )
        return text

    def _malformed(self, what: str, found: str) -> NoReturn:
        raise EpisodeError(self.cfg.url, self.episode_id, f"{what} returned {found}; the observation is malformed")
