"""The run's OpenAI-compatible endpoint: agents written for the OpenAI API train unchanged.

A generator that plays an agent task serves, on loopback only, the parts of the OpenAI API
an agent uses::

    POST <base>/chat/completions    messages (tools, tool calls and results), stream or not, logprobs
    POST <base>/completions         a prompt (text or token ids), stream or not, logprobs
    GET  <base>/models              the one model it serves

Every request carries its episode's key (``Authorization: Bearer <key>``): each episode has a key
and an id of its own, both random and both dead once the episode ends, so an agent reaches its own
episode only, never a sibling's, and nothing outside the run reaches any. The base URL an agent is
given (``http://127.0.0.1:PORT/episodes/<id>/v1``) names the episode too; a request whose path or
``X-Episode-Id`` header names another episode than its key's is refused and touches neither. A
request without a live key, for another model, or malformed in any way is refused with OpenAI's
error shape and a message that says what to send instead, before it spends a turn or records a
token.

The endpoint admits connections by key, so nothing without one and no episode takes a place another episode
needs. A new connection is anonymous: it holds one of ``ANONYMOUS_CONNECTIONS`` places until a request on it shows
a live key, within ``KEY_DEADLINE_S`` of its accept (a whole request head arriving in time gives it one more, for
the key to be checked), or it is dropped; when every anonymous place is taken, the oldest anonymous connection is
dropped for the new one. An agent's client sends its request as it connects, so its connection shows its key long
before a flood of idle connections could push it out, whereas a cap on all connections, counted before any key is
seen, lets such a flood keep every agent out. A request with a live key binds its connection to that episode; each
episode holds at most ``CONNECTIONS_PER_EPISODE`` connections and ``REQUESTS_PER_EPISODE`` requests in flight (from
its key's check to its answer), and past either its request is refused with a 429 (a connection past the cap is
closed): an agent's flood spends its own episode's places only. A connection that has shown no live key is closed
after its one answer (a 401 without a key); one bound to an episode that shows another episode's key is refused
and closed. A bound connection whose next request head or body does not arrive within ``READ_TIMEOUT_S`` is
dropped, a body larger than a request within the model's context is refused from its ``Content-Length`` (or as it
streams past the size) before any parsing, and a body or a reply's tool call nested deeper than ``MAX_NESTING`` is
refused or left as text. Whatever a request holds, the answer is OpenAI's shape, never a traceback.

A turn is recorded whole or not at all: when its answer is ready and its client is still connected to receive it
(an answer no agent saw is no part of its episode). When the agent's run ends, its episode stops taking requests,
cancels those still in flight and closes its connections before its record is read; ``EpisodeRecord.problem`` says
when what it recorded cannot train.

Each turn samples with the engine the run trains, under the topology's sampling settings, with the episode's seed
for that turn (or the request's ``seed``, mixed with the episode's) and the newest weights the generator holds, and
records the prompt ids, the sampled ids, their logprobs (``ChatTokens``) and the policy version that sampled them (an
episode goes on across a weight update; the answer's ``system_fingerprint`` names the version). Every request field
is honoured, fixed by the topology, bookkeeping without effect on the reply (``user``), or refused
(``actors/agents/openai_fields.py``): ``max_tokens`` and ``stop`` reach the engine, which stops there, and
``top_logprobs`` returns the engine's own values. A reply that writes ``<tool_call>{"name": ..., "arguments":
...}</tool_call>`` (the Hermes format that Qwen's and SmolLM's templates teach) is answered as OpenAI tool calls when
the request offered tools. The whole reply is sampled before it is
sent: a streamed answer is that reply in one chunk. An episode opened with a demonstration
(``actors/agents/task.py``) answers each turn with the demonstration's next reply, scored by the policy
instead of sampled, and recorded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from actors.agents.chat_tokens import ChatTokens, Message, Prompt, TemplateError
from actors.agents.openai_fields import FieldRefused, Route, SamplingSettings, check_fields
from actors.basics.seeds import seed_of
from actors.contract.rollouts import ReplyRequest, Trajectory

# Continue a token sequence with one sampled reply: (ids, seed, greedy, what the request asks of the reply) -> the
# reply alone, each token's ``versions`` the policy version that sampled it. Cancelled when its episode ends first:
# it must stop cleanly or run on to its end unawaited (the generator's runs on, shielded).
Sample = Callable[[list[int], int, bool, ReplyRequest], Awaitable[Trajectory]]
# Continue a token sequence with given reply tokens (a demonstration's): (ids, reply ids) -> the reply with the
# policy's logprobs of its tokens, each token's ``versions`` the policy version that scored it. Cancelled as
# ``Sample`` is.
Score = Callable[[list[int], list[int]], Awaitable[Trajectory]]
SERVED_MODEL = "policy"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
READ_TIMEOUT_S = 5.0  # a connection's next request head, then its body, arrive within it or it is dropped
KEY_DEADLINE_S = 2.0  # a new connection shows a live key within it (a whole request head: once more) or is dropped
ANONYMOUS_CONNECTIONS = 256  # connections not yet showing a key, held at once; the oldest goes for a new one
CONNECTIONS_PER_EPISODE = 16  # an agent's client pool and then some; past it, its new connection gets a 429
REQUESTS_PER_EPISODE = 8  # in flight at once (its turns are taken one at a time anyway); past it, a 429
HEAD_END = b"\r\n\r\n"  # the end of a request head
BODY_BYTES_PER_POSITION = 32  # a body as large as a request filling the model's context can be, JSON escapes and all
MIN_BODY_BYTES = 2**18
MAX_NESTING = 64  # JSON nesting deeper than any request or tool call is: a request's body, a reply's tool call
NO_TOKEN = "no token the model reads (nothing, or only characters outside its vocabulary); send text it encodes"


@dataclass(frozen=True)
class Endpoint:
    """What an agent is given for one episode: ``openai.AsyncOpenAI(base_url=..., api_key=...)`` and the
    ``model`` to name in its requests."""

    base_url: str
    api_key: str = field(repr=False)  # an agent that prints its endpoint does not print its key
    model: str = SERVED_MODEL


class EpisodeOver(Exception):
    """The episode cannot take another turn (its turns or its context are used up); it ends as failed."""


@dataclass
class EpisodeRecord:
    """One episode's turns as the endpoint served them."""

    episode_id: str
    key: str = field(repr=False)
    seeds: list[int]  # one per turn: the turn's sampling, whatever else runs at the same time
    greedy: bool
    positions: int  # the model's context: a turn's prompt and reply must fit in it
    max_new_tokens: int
    tokens: ChatTokens
    failure: str | None = None
    turns: int = 0  # turns sampled, each spending a seed, recorded or not (its client left, or the episode ended)
    last_reply: str = ""
    last_version: int | None = None  # the policy version that sampled the last reply's last token
    demonstration: list[str] | None = None  # the replies the endpoint answers with, in order, instead of sampling
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # an agent's concurrent requests take turns
    connections: set[_Connection] = field(default_factory=set, repr=False)  # those its key bound
    requests: set[asyncio.Task] = field(default_factory=set, repr=False)  # in flight: their key checked, unanswered

    def redact(self, text: str | None) -> str | None:
        """``text`` without the episode's key: an agent's error may quote it, and errors go to the run's files."""
        return None if text is None else text.replace(self.key, "<api_key>")

    def trajectories(self) -> list[Trajectory]:
        return [segment.trajectory() for segment in self.tokens.segments]

    def problem(self) -> str | None:
        """Why the rows ``trajectories`` returns cannot train, or None when each has a prompt token and a token
        the model sampled: the trainer predicts a row's first completion token from its prompt, and learns from
        the model's tokens only. Read after the episode ends; its generator fails such an episode instead."""
        rows = self.trajectories()
        if not rows and self.turns:
            return (
                f"the agent asked for {self.turns} turn(s) but took no answer (it returned or disconnected before "
                "its reply was ready), so no turn was recorded: await each request's answer before returning"
            )
        if not rows:
            return "the agent returned without calling the endpoint: send its requests to the base_url it is given"
        return Trajectory.untrainable(rows)

    def add(self, prompt: Prompt, reply: Trajectory, message: Message, eos_id: int | None) -> None:
        """A whole turn: its prompt and the reply sampled for it, answered as ``message``."""
        self.tokens.add(prompt, reply, message, eos_id)
        self.last_reply = reply.text
        self.last_version = _version(reply, self)

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """The current request counted in flight until it is answered, for ``end`` to cancel; a 429 past
        ``REQUESTS_PER_EPISODE``, so one agent's burst waits on nothing the server or its siblings hold."""
        if len(self.requests) >= REQUESTS_PER_EPISODE:
            raise ApiError(
                429, "rate_limit_exceeded",
                f"this episode has {REQUESTS_PER_EPISODE} requests in flight already, its most: its turns are taken "
                "one at a time, so send the next request when one is answered",
            )
        task = asyncio.current_task()
        self.requests.add(task)
        try:
            yield
        finally:
            self.requests.discard(task)

    async def end(self) -> None:
        """The agent's run is over: its requests still in flight are cancelled (no answer reaches it now), so the
        record holds whole turns only, and its connections are closed, holding nothing past the episode."""
        pending = list(self.requests)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for connection in list(self.connections):
            connection.close()

    def next_seed(self, need: int) -> int:
        """The seed of the next turn, whose prompt holds ``need`` tokens; ``EpisodeOver`` past the limits."""
        if self.turns >= len(self.seeds):
            raise EpisodeOver(f"the agent asked for a turn past the task's max_turns ({len(self.seeds)})")
        if need + self.max_new_tokens > self.positions:
            raise EpisodeOver(
                f"the episode's {need} tokens and a reply of up to {self.max_new_tokens} exceed the model's "
                f"{self.positions} positions"
            )
        self.turns += 1
        return self.seeds[self.turns - 1]

    def demonstrated(self) -> str:
        """The demonstration's reply for the turn ``next_seed`` opened; ``EpisodeOver`` past its last."""
        if self.turns > len(self.demonstration):
            raise EpisodeOver(
                f"the agent asked for reply {self.turns} of a demonstration of {len(self.demonstration)}; a "
                "demonstration writes every reply its agent asks for"
            )
        return self.demonstration[self.turns - 1]


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, code: str, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.close = close  # the connection ends with the answer (a body left unread)


class ChatServer:
    """The endpoint of one generator process: ``start`` it once, open an ``episode`` per agent run."""

    def __init__(
        self, tokenizer: Any, sample: Sample, positions: int, sampling: SamplingSettings, score: Score | None = None
    ):
        """``sampling``: the generator's settings, which fix what a request may ask; ``score``: how a
        demonstration's replies get the policy's logprobs (episodes opened with one)."""
        self.tokenizer, self.sample, self.score = tokenizer, sample, score
        self.positions, self.sampling, self.max_new_tokens = positions, sampling, sampling.max_new_tokens
        self._tools_rendered: dict[str, bool] = {}  # by a tool list's JSON: whether the template renders it
        self.max_body = max(MIN_BODY_BYTES, BODY_BYTES_PER_POSITION * positions)
        self.read_timeout_s, self.key_deadline_s = READ_TIMEOUT_S, KEY_DEADLINE_S
        self.anonymous_connections = ANONYMOUS_CONNECTIONS
        self._episodes: dict[bytes, EpisodeRecord] = {}  # by their key's digest: looked up in constant time
        self._anonymous: dict[_Connection, bool] = {}  # oldest first: whether a whole request head came on it
        self.port: int | None = None
        self._runner = None
        self._listener: asyncio.Server | None = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body, middlewares=[web.middleware(_openai_errors)])
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
            app.router.add_get(f"{prefix}/models", self._models)
        # keepalive_timeout: aiohttp drops a connection whose next request head has not arrived by then;
        # lingering_time: how long it reads a refused request's unread body before closing (10 s by default)
        timeouts = {"keepalive_timeout": self.read_timeout_s, "lingering_time": self.read_timeout_s}
        self._runner = web.AppRunner(app, access_log=None, **timeouts)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(lambda: _Connection(self), "127.0.0.1", 0)
        self.port = self._listener.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _admit(self, connection: _Connection) -> None:
        """A new connection takes an anonymous place; when none is free, another's (``dropped_for_new``). An
        agent's client sends its request as it connects, so its connection is out of a flood's reach once its bytes
        arrive, before a loaded host has read them and until its key is checked, however slowly."""
        if len(self._anonymous) >= self.anonymous_connections:
            dropped = dropped_for_new(self._anonymous, _Connection.sent_something)
            del self._anonymous[dropped]
            dropped.transport.abort()
        self._anonymous[connection] = False

    def endpoint(self, record: EpisodeRecord) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.port}/episodes/{record.episode_id}/v1", record.key)

    @asynccontextmanager
    async def episode(
        self, seeds: list[int], greedy: bool, demonstration: list[str] | None = None
    ) -> AsyncIterator[EpisodeRecord]:
        """An episode open for requests while the body runs (the agent's run), with an id and a key of its own;
        with a ``demonstration``, each turn answers with its next reply instead of a sample. Once the body is done,
        its requests still in flight are cancelled (``EpisodeRecord.end``): what it recorded is then whole turns,
        and ``EpisodeRecord.problem`` says whether they can train."""
        key = "mesh-" + secrets.token_urlsafe(24)
        record = EpisodeRecord(
            secrets.token_urlsafe(12), key, seeds, greedy, self.positions, self.max_new_tokens,
            ChatTokens(self.tokenizer), demonstration=demonstration,
        )
        self._episodes[_digest(key)] = record
        try:
            yield record
        finally:
            del self._episodes[_digest(key)]  # its key is dead: no new request reaches it
            await record.end()

    # ------------------------------------------------------------------------- the routes

    async def _chat(self, request) -> Any:
        return await self._serve(request, "chat", _chat_ask, self._chat_turn)

    async def _completions(self, request) -> Any:
        return await self._serve(request, "completions", self._completion_ask, self._completion_turn)

    async def _models(self, request) -> Any:
        from aiohttp import web

        self._authorized(request)
        model = {"id": SERVED_MODEL, "object": "model", "owned_by": "mesh", "max_model_len": self.positions}
        return web.json_response({"object": "list", "data": [model]})

    async def _serve(
        self,
        request,
        route: Route,
        read: Callable[[dict], Ask],
        turn: Callable[[EpisodeRecord, Ask], Awaitable[Turn]],
    ) -> Any:
        """A turn's request: its key checked before its body is read, the body checked whole before it waits for
        the episode's turn, the turn recorded only if its client is there to get the answer."""
        record = self._authorized(request)
        with record.in_flight():
            body = await self._body(request)
            _check_model(body)
            check_fields(body, route, self.sampling, record.greedy)
            ask = read(body)
            async with record.lock:
                if record.failure is not None:
                    raise ApiError(400, "episode_failed", f"the episode has ended: {record.failure}")
                answered = await turn(record, ask)
                if not _connected(request):  # the agent never saw these tokens: they are no part of its episode
                    raise ApiError(
                        499, "client_closed_request",
                        "the client closed its connection before its answer was ready, so the turn is not recorded; "
                        "wait for each answer",
                    )
                record.add(answered.prompt, answered.reply, answered.message, self.tokenizer.eos_token_id)
            return await _answer(request, answered.answer, ask.stream, ask.usage_chunk)

    def _authorized(self, request) -> EpisodeRecord:
        """The episode of the request's key, its connection bound to it; the episode its path or ``X-Episode-Id``
        names must be that one."""
        record = self._episodes.get(_digest(_bearer(request.headers.get("Authorization", ""))))
        if record is None:
            raise ApiError(
                401, "invalid_api_key",
                "this endpoint serves only the run's own agents, each episode with a key of its own: send the "
                "api_key the agent was given (Authorization: Bearer <key>) while its episode is open; a key stops "
                "working when its episode ends",
            )
        named = request.match_info.get("episode") or request.headers.get("X-Episode-Id")
        if named is not None and named != record.episode_id:
            raise ApiError(
                404, "episode_not_found",
                "the request names another episode than its key's: an agent reaches only its own episode; send "
                "each request to the base_url given with the key",
            )
        self._bind(request, record)
        return record

    def _bind(self, request, record: EpisodeRecord) -> None:
        """The request's connection made ``record``'s, if it is anonymous and the episode holds fewer than
        ``CONNECTIONS_PER_EPISODE``; refused if it is another episode's."""
        connection = _connection_of(request)
        if connection is None:
            raise ApiError(499, "client_closed_request", "the client closed its connection: send the request again")
        if connection.episode is record:
            return
        if connection.episode is not None:
            raise ApiError(
                403, "connection_of_another_episode",
                "this connection carries another episode's requests: a connection serves one episode; give each "
                "episode a client of its own",
                close=True,
            )
        if len(record.connections) >= CONNECTIONS_PER_EPISODE:
            raise ApiError(
                429, "rate_limit_exceeded",
                f"this episode holds {CONNECTIONS_PER_EPISODE} connections already, its most: send its requests over "
                "those (one client, whose pool keeps them), since its turns are taken one at a time anyway",
                close=True,
            )
        connection.bind(record)

    async def _body(self, request) -> dict:
        """The request's JSON object, refused before any parsing when larger than a request within the model's
        context can be, or slower to arrive than ``read_timeout_s``."""
        from aiohttp import web

        too_large = ApiError(
            413, "request_too_large",
            f"the request body is over {self.max_body} bytes, more than any request within the model's "
            f"{self.positions} positions takes; send a shorter conversation",
            close=True,
        )
        if (request.content_length or 0) > self.max_body:
            raise too_large
        try:
            async with asyncio.timeout(self.read_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise ApiError(
                408, "request_timeout",
                f"the request body did not arrive within {self.read_timeout_s:g} s; send the whole request at once",
                close=True,
            ) from None
        return _json_object(raw)

    def _completion_ask(self, body: dict) -> Ask:
        """A /completions request checked whole: its prompt text or ids, its ``logprobs`` OpenAI's 0 to 5."""
        logprobs = body.get("logprobs")
        if logprobs is not None and not (type(logprobs) is int and 0 <= logprobs <= 5):
            raise ApiError(
                400, "invalid_logprobs",
                f"logprobs must be an integer from 0 to 5, or null, for /completions, not {_shown(logprobs)}",
            )
        return Ask(
            _request(body, logprobs or 0), _flag(body, "stream"), logprobs is not None, [],
            prompt=self._prompt(body.get("prompt")), seed=_seed(body), usage_chunk=_usage_chunk(body),
        )

    def _prompt(self, prompt: Any) -> list[int] | str:
        """A completion's prompt: text, or token ids each one the model reads (tokenized at its turn, where only
        what it adds to its episode is)."""
        vocabulary = len(self.tokenizer)
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocabulary for t in prompt):
            return prompt
        if prompt == "":
            raise ApiError(400, "invalid_prompt", f"the prompt encodes to {NO_TOKEN}")
        raise ApiError(
            400, "invalid_prompt",
            f"prompt must be one non-empty string or one non-empty list of token ids (0 to {vocabulary - 1})",
        )

    # ------------------------------------------------------------------------- one turn

    async def _chat_turn(self, record: EpisodeRecord, ask: Ask) -> Turn:
        prompt = self._chat_prompt(record, ask)
        reply, finish = await self._sample(record, prompt, ask)
        content, calls = _tool_calls(reply.text) if ask.tools else (reply.text, [])
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish}
        if ask.logprobs:
            choice["logprobs"] = {"content": self._token_logprobs(reply)}
        return Turn(prompt, reply, message, _completion("chat.completion", record, choice, prompt, reply))

    def _chat_prompt(self, record: EpisodeRecord, ask: Ask) -> Prompt:
        """The ids the reply continues: the episode's so far and the request's new messages; a 400 before any
        sampling when the template cannot render them or they encode to no token."""
        messages, tools = ask.messages, ask.tools
        try:
            if tools and not self._renders(tools):
                raise ApiError(
                    400, "tools_not_rendered",
                    "the request offers tools, but this model's chat template does not render them, so the model "
                    "would never see them; describe the tool in the system prompt and read its calls from the "
                    "reply, or train a model whose template renders tools",
                )
            prompt = record.tokens.prompt(messages, tools)
        except TemplateError as error:
            raise ApiError(400, "template_error", str(error)) from None
        if not prompt.ids:
            raise ApiError(400, "invalid_prompt", f"the messages encode to {NO_TOKEN}")
        return prompt

    async def _completion_turn(self, record: EpisodeRecord, ask: Ask) -> Turn:
        prompt = record.tokens.continued(ask.prompt)
        if not prompt.ids:
            raise ApiError(400, "invalid_prompt", f"the prompt encodes to {NO_TOKEN}")
        reply, finish = await self._sample(record, prompt, ask)
        message = {"role": "assistant", "content": reply.text}
        choice = {"index": 0, "text": reply.text, "finish_reason": finish}
        if ask.logprobs:
            tokens = [self.tokenizer.decode([t]) for t in reply.completion_ids]
            top = None
            if ask.request.top_logprobs:
                top = [{self.tokenizer.decode([t]): lp for t, lp in place} for place in reply.top_logprobs or []]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": top}
        return Turn(prompt, reply, message, _completion("text_completion", record, choice, prompt, reply))

    async def _sample(self, record: EpisodeRecord, prompt: Prompt, ask: Ask) -> tuple[Trajectory, str]:
        """The turn's reply within what ``ask`` asks, and its finish reason."""
        try:
            seed = record.next_seed(len(prompt.ids))
            demonstrated = None if record.demonstration is None else self._encoded_reply(record.demonstrated())
        except EpisodeOver as error:
            record.failure = str(error)
            raise ApiError(400, "context_length_exceeded", f"the episode has ended: {error}") from None
        if ask.seed is not None:  # the same request with the same seed draws the same reply within this episode
            seed = _mixed_seed(record.seeds[0], ask.seed)
        try:
            if demonstrated is None:
                reply = await self.sample(prompt.ids, seed, record.greedy, ask.request)
            else:
                reply = await self.score(prompt.ids, demonstrated)
        except Exception as error:  # the generator's own failure (a weight switch, the engine): the episode ends
            record.failure = f"the generator could not sample turn {record.turns}: {type(error).__name__}: {error}"
            raise ApiError(500, "server_error", record.failure) from None
        return _cut(reply, ask.request, self.tokenizer)

    def _renders(self, tools: list[dict]) -> bool:
        """Whether the chat template renders ``tools`` at all (a one-message conversation with and without
        them), once per tool list."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._tools_rendered:
            probe = ChatTokens(self.tokenizer)
            message = [{"role": "user", "content": "?"}]
            self._tools_rendered[key] = probe.render(message, None, True) != probe.render(message, tools, True)
        return self._tools_rendered[key]

    def _encoded_reply(self, text: str) -> list[int]:
        """A demonstration's reply as the model would end it: its tokens, then the end of the turn."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        if len(ids) > self.max_new_tokens:
            raise EpisodeOver(
                f"a demonstration's reply is {len(ids)} tokens, more than a reply may be "
                f"(actors.generator.max_new_tokens: {self.max_new_tokens}); raise it or write shorter replies"
            )
        return ids

    def _token_logprobs(self, reply: Trajectory) -> list[dict]:
        """A chat answer's ``logprobs.content``: each sampled token's logprob and, when asked, the engine's most
        likely tokens at its place."""
        places = reply.top_logprobs or [[] for _ in reply.completion_ids]
        return [
            self._token_logprob(token, logprob) | {"top_logprobs": [self._token_logprob(t, lp) for t, lp in top]}
            for token, logprob, top in zip(reply.completion_ids, reply.logprobs, places, strict=True)
        ]

    def _token_logprob(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def dropped_for_new(anonymous: dict[Any, bool], sent_something: Callable[[Any], bool]) -> Any:
    """Of ``anonymous`` connections (oldest first, each with whether a whole request head was read from it), the one a
    new connection's place is taken from: the oldest idle one (no head read, nothing waiting to be read), else the
    oldest."""
    idle = (connection for connection, heard in anonymous.items() if not heard and not sent_something(connection))
    return next(idle, next(iter(anonymous)))


class _Connection(asyncio.Protocol):
    """One connection, aiohttp's handler inside it: anonymous, in one of the server's anonymous places until its
    deadline, then bound to the episode whose key a request on it showed (``ChatServer._bind``)."""

    def __init__(self, server: ChatServer):
        self.server = server
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.episode: EpisodeRecord | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._seen: bytes | None = b""  # the last bytes of its request head so far; None once a whole head came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server._admit(self)
        self._expire_in(self.server.key_deadline_s)
        self.inner = self.server._runner.server()
        self.inner.connection_made(transport)

    def sent_something(self) -> bool:
        """Whether bytes the loop has not read yet wait on this connection (peeked through a duplicate of its
        socket, so nothing is taken from it)."""
        if (own := self.transport.get_extra_info("socket")) is None:  # closed already
            return False
        try:
            with socket.socket(fileno=os.dup(own.fileno())) as duplicate:
                return bool(duplicate.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing waits (EAGAIN), or it is gone
            return False

    def bind(self, record: EpisodeRecord) -> None:
        self.server._anonymous.pop(self, None)
        self._deadline.cancel()
        self.episode = record
        record.connections.add(self)

    def close(self) -> None:
        """Closed once what it has to send is sent."""
        self.transport.close()

    def _expire_in(self, delay: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        if self.episode is None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        """A whole request head arriving before the deadline gets one deadline more: the event loop may run
        the deadline before the route that checks its key, when a stall made both due at once."""
        if self.episode is None and self._seen is not None:
            if HEAD_END in self._seen + data:
                self._seen = None
                self._expire_in(self.server.key_deadline_s)
                if self in self.server._anonymous:
                    self.server._anonymous[self] = True
            else:
                self._seen = (self._seen + data)[-len(HEAD_END) + 1 :]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        self.server._anonymous.pop(self, None)
        if self.episode is not None:
            self.episode.connections.discard(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _connection_of(request) -> _Connection | None:
    """The request's connection; None once its client has closed it."""
    transport = request.transport
    return None if transport is None else transport.get_protocol()


def _connected(request) -> bool:
    transport = request.transport
    return transport is not None and not transport.is_closing()


def _bearer(authorization: str) -> str:
    """The credentials of a ``Bearer`` authorization, its scheme in any case (RFC 7235); "" for any other."""
    scheme, _, credentials = authorization.strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode(errors="replace")).digest()


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than any request is
        raise ApiError(400, "invalid_json", "the request body is not JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    for value, depth in _nested(body):
        if depth > MAX_NESTING:
            raise ApiError(400, "invalid_json", f"the request body is nested deeper than {MAX_NESTING} levels")
        if isinstance(value, str) and not _is_text(value):
            raise ApiError(
                400, "invalid_text",
                "the request holds a string that is not UTF-8 text (a lone surrogate escape such as \\ud800); "
                "send text as UTF-8",
            )
    return body


def _nested(value: Any) -> Iterator[tuple[Any, int]]:
    """Every value in ``value`` (keys included) with its depth, walked without recursion."""
    pending = [(value, 1)]
    while pending:
        value, depth = pending.pop()
        yield value, depth
        if isinstance(value, dict):
            pending += [(k, depth) for k in value] + [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            pending += [(v, depth + 1) for v in value]


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _messages(body: dict) -> list[Message]:
    """The request's messages, each content as text (OpenAI's list of text parts joined as vLLM joins them);
    a 400 naming the first field no chat template could take."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "invalid_messages", "messages must be a non-empty list of {role, content} objects")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Message, where: str) -> Message:
    def refuse(what: str) -> ApiError:
        return ApiError(400, "invalid_messages", f"{where}: {what}")

    if not isinstance(message.get("role"), str):
        raise refuse("role must be a string (system, user, assistant or tool)")
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise refuse(f"{name} must be a string")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
        raise refuse(
            'tool_calls must be a list of {"type": "function", "function": {"name": str, "arguments": str}} objects'
        )
    return message | {"content": _text(message.get("content"), refuse)}


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict) and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments", "{}"), str | dict)
    )


def _text(content: Any, refuse: Callable[[str], ApiError]) -> str | None:
    """A message's content as text: a string, none, or OpenAI's ``[{"type": "text", "text": ...}]`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(part["text"] for part in content)
    raise refuse(
        'content must be text: a string or a list of {"type": "text", "text": ...} parts (the policy reads text '
        f"only), not {json.dumps(content)[:80]}"
    )


def _tools(body: dict) -> list[dict] | None:
    """The tools the reply may call: none under ``tool_choice: "none"`` (the template renders none, the reply is
    read as text); a choice the engine cannot enforce (``required``, one named tool) is refused."""
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400, "unsupported_tool_choice",
            f"tool_choice is {_shown(choice)}, but the engine samples the policy freely (no constrained decoding), "
            'so it cannot make the reply call a tool; send "auto" or "none", or leave it out',
        )
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "invalid_tools", 'tools must be a list of {"type": "function", "function": {...}} objects')
    return None if choice == "none" else tools


def _check_model(body: dict) -> None:
    if body.get("model") != SERVED_MODEL:
        raise ApiError(
            404, "model_not_found",
            f"this run serves one model, {SERVED_MODEL!r} (the policy being trained), not {body.get('model')!r}; "
            f"send model={SERVED_MODEL!r}",
        )


def _request(body: dict, top_logprobs: int) -> ReplyRequest:
    """What the request asks of its reply: ``max_tokens`` (or ``max_completion_tokens``), ``stop`` and
    ``top_logprobs``, each checked."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ApiError(400, "invalid_max_tokens", f"max_tokens must be a positive integer, got {_shown(limit)}")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(
            400, "invalid_stop", f"stop must be a string or a list of up to 4 non-empty strings, got {_shown(stop)}"
        )
    return ReplyRequest(limit, tuple(stops), top_logprobs)


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise ApiError(400, "invalid_seed", f"seed must be an integer, not {_shown(seed)}")
    return seed


def _mixed_seed(episode: int, request: int) -> int:
    """A turn's seed from the request's ``seed`` and its episode's: the same request draws the same reply within
    one episode, and its group's episodes still draw apart."""
    return seed_of(f"{episode}/seed {request}")


def _usage_chunk(body: dict) -> bool:
    """Whether a streamed answer ends with a chunk of its usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not (isinstance(options, dict) and set(options) <= {"include_usage", "include_obfuscation"}):
        raise ApiError(
            400, "invalid_stream_options", f'stream_options takes {{"include_usage": true}}, not {_shown(options)}'
        )
    return _flag(options, "include_usage")


@dataclass(frozen=True)
class Ask:
    """A turn's request with every field checked, before it waits for its episode's turn: a chat's messages and
    tools, or a completion's prompt (text or token ids)."""

    request: ReplyRequest
    stream: bool
    logprobs: bool  # the sampled tokens' logprobs (and ``request.top_logprobs`` alternatives at each)
    messages: list[Message]
    tools: list[dict] | None = None
    prompt: list[int] | str = field(default_factory=list)  # a completion's: text, or token ids
    seed: int | None = None  # the request's own, mixed with its episode's
    usage_chunk: bool = False  # a stream ends with a chunk of the answer's usage


@dataclass(frozen=True)
class Turn:
    """A turn sampled, not yet recorded: its record waits for its client to be there to get ``answer``."""

    prompt: Prompt
    reply: Trajectory
    message: Message
    answer: dict


def _chat_ask(body: dict) -> Ask:
    """A /chat/completions request checked whole; ``top_logprobs`` (0 to 20) needs ``logprobs``, as OpenAI's."""
    top = body.get("top_logprobs")
    if top is not None and not (type(top) is int and 0 <= top <= 20):
        raise ApiError(400, "invalid_top_logprobs", f"top_logprobs must be an integer from 0 to 20, not {_shown(top)}")
    logprobs = _flag(body, "logprobs")
    if top and not logprobs:
        raise ApiError(400, "invalid_top_logprobs", "top_logprobs needs logprobs: true (as OpenAI's API does)")
    return Ask(
        _request(body, top or 0), _flag(body, "stream"), logprobs, _messages(body), _tools(body), seed=_seed(body),
        usage_chunk=_usage_chunk(body),
    )


def _flag(body: dict, name: str) -> bool:
    """A boolean field, false when absent or null; a 400 for any other type (the string "false" is not false)."""
    value = body.get(name)
    if value is not None and type(value) is not bool:
        raise ApiError(400, f"invalid_{name}", f"{name} must be true or false (a JSON boolean), not {_shown(value)}")
    return bool(value)


def _shown(value: Any) -> str:
    """A request's value as a refusal quotes it: its JSON, cut short."""
    return json.dumps(value)[:80]


def _cut(reply: Trajectory, request: ReplyRequest, tokenizer: Any) -> tuple[Trajectory, str]:
    """The reply's text ended before the first of the request's stop strings (OpenAI leaves it out), its tokens up
    to the one that completed it, and the finish reason: ``stop`` (EOS or a stop string) or ``length``. The engine
    stopped there already; a reply a weight update cut into pieces, or a demonstration's, is cut here. The token
    that completes a stop string is found by bisection: a few decodes, not one per token."""
    ids = reply.completion_ids[: request.max_tokens]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    found = [decoded.index(stop) for stop in request.stop if stop in decoded]
    if not found:
        finish = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
        return (reply if len(ids) == len(reply.completion_ids) else _first(reply, len(ids), decoded)), finish
    low, high = 1, len(ids)  # the shortest prefix whose text holds a stop string: high
    while low < high:
        middle = (low + high) // 2
        text = tokenizer.decode(ids[:middle], skip_special_tokens=True)
        low, high = (low, middle) if any(stop in text for stop in request.stop) else (middle + 1, high)
    return _first(reply, high, decoded[: min(found)]), "stop"


def _first(reply: Trajectory, count: int, text: str) -> Trajectory:
    """The reply's first ``count`` tokens, with ``text``."""
    return replace(
        reply,
        completion_ids=reply.completion_ids[:count],
        logprobs=reply.logprobs[:count],
        loss_mask=reply.loss_mask[:count],
        text=text,
        versions=None if reply.versions is None else reply.versions[:count],
        top_logprobs=None if reply.top_logprobs is None else reply.top_logprobs[:count],
    )


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """The reply's text without its well-formed tool calls, and those calls in OpenAI's shape; a call that is
    not ``{"name": str, "arguments": object}`` JSON nested at most ``MAX_NESTING`` deep stays in the text, for
    the agent to see (a model may write anything, and the agent sends its calls back)."""
    calls, kept = [], text
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except (ValueError, RecursionError):
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        if any(depth > MAX_NESTING for _, depth in _nested(call)):
            continue
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            }
        )
        kept = kept.replace(match.group(0), "")
    return kept.strip(), calls


def _version(reply: Trajectory, record: EpisodeRecord) -> int | None:
    """The policy version that sampled the reply's last token (the episode's last one, for a reply that says none)."""
    return reply.versions[-1] if reply.versions else record.last_version


def _completion(kind: str, record: EpisodeRecord, choice: dict, prompt: Prompt, reply: Trajectory) -> dict:
    """The answer to a turn; its ``system_fingerprint`` names the policy version that sampled it."""
    prompt_tokens = len(prompt.ids)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": SERVED_MODEL,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(reply.completion_ids),
            "total_tokens": prompt_tokens + len(reply.completion_ids),
        },
        "system_fingerprint": f"policy-v{_version(reply, record)}",
    }


async def _answer(request, answer: dict, stream: bool, usage_chunk: bool) -> Any:
    """The answer as one JSON object, or as the chunks of a stream (``usage_chunk``: then one of its usage)."""
    from aiohttp import web

    if not stream:
        return web.json_response(answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    with contextlib.suppress(ConnectionError):  # the agent left after its turn was recorded, as a sent one is
        await response.prepare(request)
        for chunk in _chunks(answer, usage_chunk):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    return response


def _chunks(answer: dict, usage_chunk: bool) -> list[dict]:
    """A whole answer as the chunks of a stream: the reply, then its finish reason, then (``usage_chunk``) its
    usage with no choice, as OpenAI's ``include_usage`` sends it."""
    choice = answer["choices"][0]
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    if answer["object"] == "text_completion":
        text = {"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": choice.get("logprobs")}
        end = {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}
        kind = "text_completion"
    else:
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(message["tool_calls"])]
        text = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice.get("logprobs")}
        end = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
        kind = "chat.completion.chunk"
    chunks = [head | {"object": kind, "choices": [text]}, head | {"object": kind, "choices": [end]}]
    return chunks + ([head | {"object": kind, "choices": [], "usage": answer["usage"]}] if usage_chunk else [])


def _error(error: ApiError) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if error.status < 500 else "server_error"
    response = web.json_response(
        {"error": {"message": error.message, "type": kind, "param": None, "code": error.code}}, status=error.status
    )
    if error.close:
        response.force_close()
    return response


ROUTES = "POST <base_url>/chat/completions, POST <base_url>/completions and GET <base_url>/models"


def _as_api_error(error: Exception) -> ApiError:
    """What any failure of a request answers: its own ``ApiError``, aiohttp's refusal (no such route or
    method) in OpenAI's shape, or the endpoint's own defect named, without a traceback."""
    from aiohttp import web

    if isinstance(error, ApiError):
        return error
    if isinstance(error, FieldRefused):
        return ApiError(400, error.code, error.message)
    if isinstance(error, web.HTTPException) and error.status < 500:
        code = error.reason.lower().replace(" ", "_")
        return ApiError(error.status, code, f"{error.reason}: this endpoint serves {ROUTES}")
    return ApiError(500, "server_error", f"the endpoint failed on this request ({type(error).__name__}: {error})")


async def _openai_errors(request, handler) -> Any:
    """Every answer that is not a turn's, in OpenAI's error shape; a connection that has shown no live key is
    closed after it, so it holds its anonymous place for one request at most."""
    try:
        response = await handler(request)
    except Exception as error:  # noqa: BLE001  answered, never a traceback: see _as_api_error
        response = _error(_as_api_error(error))
    connection = _connection_of(request)
    if connection is None or connection.episode is None:
        response.force_close()
    return response
