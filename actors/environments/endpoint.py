"""The run's OpenAI-compatible endpoint: agents written for the OpenAI API train unchanged.

A generator that plays an agent task serves, on loopback only, the parts of the OpenAI API
an agent uses::

    POST <base>/chat/completions    messages (tools, tool calls and results), stream or not, logprobs
    POST <base>/completions         a prompt (text or token ids), stream or not, logprobs
    GET  <base>/models              the one model it serves

Every request belongs to an episode, named by the base URL an agent is given
(``http://127.0.0.1:PORT/episodes/<id>/v1``), or else by an ``X-Episode-Id`` header or the
request's ``user`` field; and carries the run's key (``Authorization: Bearer <key>``), made
fresh for each generator process, so only the run's own agents are served. A request that
names no open episode, another model or a wrong key is refused with OpenAI's error shape and
a message that says what to send instead.

Each turn samples with the engine the run trains (its sampling settings: a request's
``temperature`` or ``top_p`` does not change what the trainer assumes; ``max_tokens`` cuts the
reply, which keeps what was sampled exact), with the episode's seed for that turn and the newest
weights the generator holds, and records the prompt ids, the sampled ids, their logprobs
(``ChatTokens``) and the policy version that sampled them (an episode goes on across a weight
update; the answer's ``system_fingerprint`` names the version). A reply
that writes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the Hermes format that
Qwen's and SmolLM's templates teach) is answered as OpenAI tool calls when the request offered
tools. The whole reply is sampled before it is sent: a streamed answer is that reply in one chunk.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from actors.environments.chat_tokens import ChatTokens, Segment, TemplateError
from actors.rollout import Trajectory

# Continue a token sequence with one sampled reply: (ids, seed, greedy) -> the reply alone and the policy
# version that sampled it.
Sample = Callable[[list[int], int, bool], Awaitable[tuple[Trajectory, int]]]
SERVED_MODEL = "policy"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Endpoint:
    """What an agent is given for one episode: ``openai.AsyncOpenAI(base_url=..., api_key=...)`` and the
    ``model`` to name in its requests."""

    base_url: str
    api_key: str
    model: str = SERVED_MODEL


class EpisodeOver(Exception):
    """The episode cannot take another turn (its turns or its context are used up); it ends as failed."""


@dataclass
class EpisodeRecord:
    """One episode's turns as the endpoint served them."""

    episode_id: str
    seeds: list[int]  # one per turn: the turn's sampling, whatever else runs at the same time
    greedy: bool
    positions: int  # the model's context: a turn's prompt and reply must fit in it
    max_new_tokens: int
    tokens: ChatTokens
    failure: str | None = None
    turns: int = 0
    last_reply: str = ""
    turn_versions: list[tuple[int, int]] = field(default_factory=list)  # each reply's tokens and the version
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # an agent's concurrent requests take turns

    def trajectories(self) -> list[Trajectory]:
        return [segment.trajectory() for segment in self.tokens.segments]

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


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ChatServer:
    """The endpoint of one generator process: ``start`` it once, open an ``episode`` per agent run."""

    def __init__(self, tokenizer: Any, sample: Sample, positions: int, max_new_tokens: int):
        self.tokenizer, self.sample = tokenizer, sample
        self.positions, self.max_new_tokens = positions, max_new_tokens
        self.key = "mesh-" + secrets.token_urlsafe(24)
        self.episodes: dict[str, EpisodeRecord] = {}
        self.port: int | None = None
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
            app.router.add_get(f"{prefix}/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def endpoint(self, episode_id: str) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1", self.key)

    @asynccontextmanager
    async def episode(self, episode_id: str, seeds: list[int], greedy: bool) -> AsyncIterator[EpisodeRecord]:
        """An episode open for requests while the body runs (the agent's run)."""
        tokens = ChatTokens(self.tokenizer)
        record = EpisodeRecord(episode_id, seeds, greedy, self.positions, self.max_new_tokens, tokens)
        self.episodes[episode_id] = record
        try:
            yield record
        finally:
            del self.episodes[episode_id]

    # ------------------------------------------------------------------------- the routes

    async def _chat(self, request) -> Any:
        return await self._serve(request, self._chat_turn)

    async def _completions(self, request) -> Any:
        return await self._serve(request, self._completion_turn)

    async def _models(self, request) -> Any:
        from aiohttp import web

        try:
            self._check_key(request)
        except ApiError as error:
            return _error(error)
        model = {"id": SERVED_MODEL, "object": "model", "owned_by": "mesh", "max_model_len": self.positions}
        return web.json_response({"object": "list", "data": [model]})

    async def _serve(self, request, turn: Callable[[EpisodeRecord, dict], Awaitable[dict]]) -> Any:
        from aiohttp import web

        try:
            self._check_key(request)
            body = await _json_body(request)
            record = self._record(request, body)
            _check_model(body)
            async with record.lock:
                answer = await turn(record, body)
        except ApiError as error:
            return _error(error)
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in _chunks(answer):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def _check_key(self, request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), self.key.encode()):
            raise ApiError(
                401, "invalid_api_key",
                "this endpoint serves only the run's own agents: send the api_key the agent was given "
                "(Authorization: Bearer <key>)",
            )

    def _record(self, request, body: dict) -> EpisodeRecord:
        episode = request.match_info.get("episode") or request.headers.get("X-Episode-Id") or body.get("user")
        if not episode:
            raise ApiError(
                400, "missing_episode",
                "the request names no episode: use the base_url the agent was given (it ends /episodes/<id>/v1), "
                "or send the episode id as an X-Episode-Id header or the request's user field",
            )
        record = self.episodes.get(episode)
        if record is None:
            raise ApiError(
                404, "episode_not_open",
                f"episode {episode!r} is not open: it has ended, or this run never started it; an agent may call "
                "the endpoint only while its own run is in progress",
            )
        if record.failure is not None:
            raise ApiError(400, "episode_failed", f"episode {episode} has ended: {record.failure}")
        return record

    # ------------------------------------------------------------------------- one turn

    async def _chat_turn(self, record: EpisodeRecord, body: dict) -> dict:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "invalid_messages", "messages must be a non-empty list of {role, content} objects")
        try:
            if tools and record.tokens.render(messages, None, True) == record.tokens.render(messages, tools, True):
                raise ApiError(
                    400, "tools_not_rendered",
                    "the request offers tools, but this model's chat template does not render them, so the model "
                    "would never see them; describe the tool in the system prompt and read its calls from the "
                    "reply, or train a model whose template renders tools",
                )
            segment = record.tokens.prompt(messages, tools)
        except TemplateError as error:
            raise ApiError(400, "template_error", str(error)) from None
        reply = await self._sample(record, segment, body)
        content, calls = _tool_calls(reply.text) if tools else (reply.text, [])
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        segment.add_reply(reply, message, self.tokenizer.eos_token_id)
        record.last_reply = reply.text
        finish = "tool_calls" if calls else _finish(reply, self.tokenizer.eos_token_id)
        choice = {"index": 0, "message": message, "finish_reason": finish}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._token_logprobs(reply)}
        return _completion("chat.completion", record, choice, segment, reply)

    async def _completion_turn(self, record: EpisodeRecord, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        else:
            raise ApiError(400, "invalid_prompt", "prompt must be one string or one list of token ids")
        segment = Segment(ids, [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}])
        record.tokens.segments.append(segment)
        reply = await self._sample(record, segment, body)
        segment.add_reply(reply, {"role": "assistant", "content": reply.text}, self.tokenizer.eos_token_id)
        record.last_reply = reply.text
        choice = {"index": 0, "text": reply.text, "finish_reason": _finish(reply, self.tokenizer.eos_token_id)}
        if body.get("logprobs") is not None:
            tokens = [self.tokenizer.decode([t]) for t in reply.completion_ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": None}
        return _completion("text_completion", record, choice, segment, reply)

    async def _sample(self, record: EpisodeRecord, segment: Segment, body: dict) -> Trajectory:
        try:
            seed = record.next_seed(len(segment.ids))
        except EpisodeOver as error:
            record.failure = str(error)
            raise ApiError(400, "context_length_exceeded", f"episode {record.episode_id} has ended: {error}") from None
        try:
            reply, version = await self.sample(segment.ids, seed, record.greedy)
        except Exception as error:  # the generator's own failure (a weight switch, the engine): the episode ends
            record.failure = f"the generator could not sample turn {record.turns}: {type(error).__name__}: {error}"
            raise ApiError(500, "server_error", record.failure) from None
        reply = _cut(reply, _max_tokens(body), self.tokenizer)
        record.turn_versions.append((len(reply.completion_ids), version))
        return reply

    def _token_logprobs(self, reply: Trajectory) -> list[dict]:
        tokens = [self.tokenizer.decode([t]) for t in reply.completion_ids]
        return [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, reply.logprobs, strict=True)
        ]


async def _json_body(request) -> dict:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than any request is
        raise ApiError(400, "invalid_json", "the request body is not JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    return body


def _check_model(body: dict) -> None:
    if body.get("model") != SERVED_MODEL:
        raise ApiError(
            404, "model_not_found",
            f"this run serves one model, {SERVED_MODEL!r} (the policy being trained), not {body.get('model')!r}; "
            f"send model={SERVED_MODEL!r}",
        )


def _max_tokens(body: dict) -> int | None:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        return None
    if type(limit) is not int or limit < 1:
        raise ApiError(400, "invalid_max_tokens", f"max_tokens must be a positive integer, got {limit!r}")
    return limit


def _cut(reply: Trajectory, limit: int | None, tokenizer: Any) -> Trajectory:
    """The reply's first ``limit`` tokens: what sampling with that limit would have given."""
    if limit is None or len(reply.completion_ids) <= limit:
        return reply
    ids = reply.completion_ids[:limit]
    return Trajectory(reply.prompt_ids, ids, reply.logprobs[:limit], reply.loss_mask[:limit], tokenizer.decode(ids))


def _finish(reply: Trajectory, eos_id: int | None) -> str:
    """``stop`` when the reply ended itself (EOS), ``length`` when a token limit cut it."""
    return "stop" if reply.completion_ids and reply.completion_ids[-1] == eos_id else "length"


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """The reply's text without its well-formed tool calls, and those calls in OpenAI's shape; a call that is
    not ``{"name": str, "arguments": object}`` JSON stays in the text, for the agent to see."""
    calls, kept = [], text
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
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


def _completion(kind: str, record: EpisodeRecord, choice: dict, segment: Segment, reply: Trajectory) -> dict:
    """The answer to a turn; its ``system_fingerprint`` names the policy version that sampled it."""
    prompt_tokens = len(segment.ids) - len(reply.completion_ids)
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
        "system_fingerprint": f"policy-v{record.turn_versions[-1][1]}",
    }


def _chunks(answer: dict) -> list[dict]:
    """A whole answer as the chunks of a stream: the reply, then its finish reason (with usage)."""
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
    return [
        head | {"object": kind, "choices": [text]},
        head | {"object": kind, "choices": [end], "usage": answer["usage"]},
    ]


def _error(error: ApiError) -> Any:
    from aiohttp import web

    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": error.message, "type": kind, "param": None, "code": error.code}}, status=error.status
    )
