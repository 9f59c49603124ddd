"""The run's OpenAI-compatible endpoint (``actors/environments/endpoint.py``): the official ``openai`` client
talks to a real engine on a tiny BPE model with a ChatML template, and every episode trains on the very tokens
sampled (``actors/environments/chat_tokens.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
import pytest

from actors.contract.rollouts import Trajectory
from actors.environments.chat_tokens import ChatTokens
from actors.environments.endpoint import SERVED_MODEL, ChatServer, EpisodeRecord, _tool_calls
from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model

openai = pytest.importorskip("openai", reason="the openai client is installed with the agents extra")

BPE = TinyModelSpec(hidden_size=64, heads=4, kv_heads=2, max_positions=512, tokenizer="bpe")
TURNS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    model = build_tiny_model(tmp_path_factory.mktemp("bpe"), BPE, None, seed=0)
    return HFEngine(str(model), Sampling(max_new_tokens=8))


class Recording:
    """The engine as the server's sampler, keeping every reply it sampled."""

    def __init__(self, engine: HFEngine):
        self.engine, self.replies = engine, []

    async def __call__(self, ids, seed, greedy):
        reply = await self.engine.continue_from(ids, seed, greedy)
        self.replies.append(reply)
        version = len(self.replies) // 2  # a new policy version every other turn
        return replace(reply, versions=[version] * len(reply.completion_ids))


@pytest.fixture
async def server(engine):
    sampler = Recording(engine)
    server = ChatServer(engine.tokenizer, sampler, positions=BPE.max_positions, max_new_tokens=8)
    server.sampler = sampler
    await server.start()
    yield server
    await server.stop()


def client_of(server: ChatServer, record: EpisodeRecord) -> openai.AsyncOpenAI:
    endpoint = server.endpoint(record)
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def converse(client, turns: int, edit_at: int | None = None) -> list[dict]:
    """A conversation of ``turns`` replies, each answered by a user message; at ``edit_at`` the agent rewrites
    its first message (its history is no longer what the model saw)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    for turn in range(turns):
        if turn == edit_at:
            messages[1] = {"role": "user", "content": "Hello again!"}
        reply = await client.chat.completions.create(model=SERVED_MODEL, messages=messages, logprobs=True)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"Turn {turn} done; go on."})
    return messages


async def test_an_episode_trains_on_the_tokens_sampled_not_its_text_retokenized(server, engine):
    async with open_episode(server, "e1", TURNS) as record:
        messages = await converse(client_of(server, record), TURNS)
    (trajectory,) = record.trajectories()
    replies = server.sampler.replies
    trained = [i for i, m in zip(trajectory.completion_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == [t for reply in replies for t in reply.completion_ids]  # byte for byte, every turn
    assert [lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m] == [
        lp for reply in replies for lp in reply.logprobs
    ]
    tokenizer = engine.tokenizer
    retokenized = [tokenizer(reply.text, add_special_tokens=False).input_ids for reply in replies]
    assert any(ids != reply.completion_ids for ids, reply in zip(retokenized, replies, strict=True))  # the trap
    stitched = tokenizer.decode(trajectory.prompt_ids + trajectory.completion_ids)
    rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    assert stitched.replace("<|im_end|>", "").strip() == rendered.replace("<|im_end|>", "").strip()
    assert record.turns == TURNS and record.tokens.split == 0
    sampled = [(i + 1) // 2 for i, r in enumerate(replies) for _ in r.completion_ids]
    assert trajectory.sampled_versions() == sampled and record.last_version == sampled[-1]


async def test_an_agent_that_edits_its_history_gets_a_row_of_its_own_not_wrong_tokens(server):
    async with open_episode(server, "e2", TURNS) as record:
        await converse(client_of(server, record), 3, edit_at=2)
    first, second = record.trajectories()
    assert record.tokens.split == 1
    assert sum(first.loss_mask) == sum(len(r.completion_ids) for r in server.sampler.replies[:2])
    assert sum(second.loss_mask) == len(server.sampler.replies[2].completion_ids)


async def test_a_demonstration_answers_with_its_replies_scored_by_the_policy_and_ends_where_they_do(engine):
    """A demonstration's episode: each turn is its next reply (tokens, then EOS), recorded to train with the
    logprobs the policy gives those tokens, which are those it reports when it samples them itself."""

    async def score(ids, reply_ids):
        return replace(reply := await engine.score(ids, reply_ids), versions=[3] * len(reply.completion_ids))

    server = ChatServer(engine.tokenizer, Recording(engine), BPE.max_positions, max_new_tokens=8, score=score)
    await server.start()
    try:
        async with server.episode(sampling_seeds(0, "shown", TURNS), False, ["ab", "cd"]) as record:
            client = client_of(server, record)
            messages = [{"role": "user", "content": "Hello there!"}]
            said = []
            for _ in range(2):
                reply = await client.chat.completions.create(model=SERVED_MODEL, messages=messages)
                said.append(reply.choices[0].message.content)
                messages += [{"role": "assistant", "content": said[-1]}, {"role": "user", "content": "more"}]
            with pytest.raises(openai.BadRequestError, match="a demonstration writes every reply its agent asks for"):
                await client.chat.completions.create(model=SERVED_MODEL, messages=messages)
    finally:
        await server.stop()
    (trajectory,) = record.trajectories()
    assert said == ["ab", "cd"] and trajectory.sampled_versions() == [3] * 6
    eos = engine.tokenizer.eos_token_id
    trained = [t for t, m in zip(trajectory.completion_ids, trajectory.loss_mask, strict=True) if m]
    encoded = [engine.tokenizer(text, add_special_tokens=False).input_ids + [eos] for text in said]
    assert trained == encoded[0] + encoded[1]
    sampled = await engine.continue_from(trajectory.prompt_ids, seed=0)
    rescored = await engine.score(trajectory.prompt_ids, sampled.completion_ids)
    assert rescored.completion_ids == sampled.completion_ids
    assert rescored.logprobs == pytest.approx(sampled.logprobs, abs=1e-4)


async def test_streaming_and_completions_give_the_reply_and_its_logprobs(server, engine):
    async with server.episode(sampling_seeds(0, "e3", TURNS), True) as record:
        client = client_of(server, record)
        chunks = [c async for c in await client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, logprobs=True
        )]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = server.sampler.replies[-1]
        assert streamed == reply.text and chunks[-1].choices[0].finish_reason in ("stop", "length")
        completion = await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], logprobs=1, max_tokens=2)
        cut = server.sampler.replies[-1]
        assert completion.choices[0].logprobs.token_logprobs == cut.logprobs[:2]
        assert completion.usage.prompt_tokens == 3
        assert completion.usage.completion_tokens == min(2, len(cut.completion_ids))
        text = engine.tokenizer.decode(cut.completion_ids, skip_special_tokens=True)  # greedy: the same again
        assert len(text) >= 3
        stop = text[1:3]
        stopped = await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], stop=[stop])
        kept = stopped.usage.completion_tokens  # the tokens up to the one that completes the stop string
        assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"
        assert stop not in engine.tokenizer.decode(cut.completion_ids[: kept - 1], skip_special_tokens=True)
        assert record.trajectories()[-1].completion_ids[-kept:] == cut.completion_ids[:kept]  # those train


async def test_bad_requests_are_refused_in_openais_shape_saying_what_to_send(server):
    async with open_episode(server, "e4", 1) as record:
        base, own = f"http://127.0.0.1:{server.port}", f"/episodes/{record.episode_id}/v1/chat/completions"
        good = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        auth = {"Authorization": f"Bearer {record.key}"}
        async with httpx.AsyncClient(base_url=base) as http:
            cases = [
                (own, good, {}, 401, "send the api_key the agent was given"),
                (own, good | {"model": "gpt-4o"}, auth, 404, "send model='policy'"),
                (own, good | {"tools": [TOOL]}, auth, 400, "does not render them"),
                (own, good | {"messages": "hi"}, auth, 400, "non-empty list"),
            ]
            for path, body, headers, status, said in cases:
                answer = await http.post(path, json=body, headers=headers)
                assert answer.status_code == status and said in answer.json()["error"]["message"], path
            deep = "[" * 100_000 + "]" * 100_000  # nested past Python's stack
            headers = auth | {"Content-Type": "application/json"}
            answer = await http.post(own, content=deep, headers=headers)
            assert answer.status_code == 400 and "not JSON" in answer.json()["error"]["message"]
            assert record.tokens.segments == []  # nothing refused is recorded
            models = (await http.get(f"/episodes/{record.episode_id}/v1/models", headers=auth)).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [(SERVED_MODEL, BPE.max_positions)]
            assert (await http.post("/v1/chat/completions", json=good, headers=auth)).status_code == 200  # its key
            over = await http.post(own, json=good, headers=auth)
            assert over.status_code == 400 and "past the task's max_turns (1)" in over.json()["error"]["message"]
            episode = await http.post(own, json=good, headers=auth)
            assert "has ended" in episode.json()["error"]["message"]  # the episode failed: no more turns


async def test_an_episode_answers_only_its_own_key_and_no_repr_shows_a_key(server):
    good = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    async with open_episode(server, "a", 2) as mine, open_episode(server, "b", 2) as theirs:
        assert mine.key != theirs.key and mine.episode_id != theirs.episode_id
        assert len(mine.episode_id) >= 16 and len(mine.key) >= 32  # random (secrets), never <seed>-<j>
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            for path, headers in (
                (f"/episodes/{theirs.episode_id}/v1/chat/completions", {"Authorization": f"Bearer {mine.key}"}),
                ("/v1/chat/completions", {"Authorization": f"Bearer {mine.key}", "X-Episode-Id": theirs.episode_id}),
                (f"/episodes/{theirs.episode_id}/v1/chat/completions", {"Authorization": "Bearer mesh-guess"}),
            ):
                answer = await http.post(path, json=good, headers=headers)
                assert answer.status_code in (401, 404) and set(answer.json()["error"]) >= {"message", "type", "code"}
        assert theirs.turns == mine.turns == 0 and theirs.tokens.segments == mine.tokens.segments == []
        endpoint = server.endpoint(theirs)
        shown = f"{endpoint!r} {endpoint} {theirs!r}"
        assert theirs.key not in shown and theirs.episode_id in shown
        assert theirs.key not in theirs.redact(f"the agent raised RuntimeError: {endpoint.api_key}")
    answer = await ask(server, theirs, good)  # its episode ended: the key is dead
    assert answer.status_code == 401


TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}
HERMES = (  # a template that renders tools and tool calls, as Qwen's and SmolLM's do
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_are_read_from_the_reply_and_rendered_back_for_the_next_turn(engine):
    text = 'Let me run it.<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    content, calls = _tool_calls(text + "<tool_call>not json</tool_call>")
    assert content == "Let me run it.<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("python", {"code": "print(1)"})
    ]
    tokenizer = engine.tokenizer.__class__.from_pretrained(engine.tokenizer.name_or_path)
    tokenizer.chat_template = HERMES
    tokens = ChatTokens(tokenizer)
    asked = [{"role": "user", "content": "Compute."}]
    sampled = tokenizer(text + "<|im_end|>", add_special_tokens=False).input_ids
    tokens.add(tokens.prompt(asked, [TOOL]), Trajectory([], sampled, [0.0] * len(sampled), [True] * len(sampled), text),
               {"role": "assistant", "content": content, "tool_calls": calls}, tokenizer.eos_token_id)
    answered = [*asked, {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1"}]
    following = tokens.prompt(answered, [TOOL])
    assert following.extends is tokens.segments[0] and tokens.split == 0  # stitched after the sampled call
    assert tokenizer.decode(following.ids).endswith("<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- credentials and abuse (issue 52)


class Scripted:
    """A policy whose every reply is ``text``: what a model may write, served through the real endpoint."""

    def __init__(self, tokenizer, text: str):
        self.ids, self.text, self.prompts = tokenizer(text, add_special_tokens=False).input_ids, text, []

    async def __call__(self, ids, seed, greedy):
        self.prompts.append(list(ids))
        n = len(self.ids)
        return Trajectory(list(ids), self.ids, [0.0] * n, [True] * n, self.text, [0] * n)


def tokenizer_with(engine: HFEngine, template: str | None):
    tokenizer = engine.tokenizer.__class__.from_pretrained(engine.tokenizer.name_or_path)
    tokenizer.chat_template = template
    return tokenizer


@asynccontextmanager
async def serving(tokenizer, sample, **limits):
    """A started server; ``limits`` replace its connection and read limits before it starts."""
    server = ChatServer(tokenizer, sample, positions=BPE.max_positions, max_new_tokens=8)
    for name, value in limits.items():
        setattr(server, name, value)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection (EOF or reset) within ``within`` seconds."""
    try:
        await asyncio.wait_for(reader.read(), within)  # read() returns at EOF
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True


async def test_connections_past_the_cap_are_closed_as_they_come_and_the_endpoint_serves_on(engine):
    sampler = Scripted(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler, spare_connections=8, read_timeout_s=600) as server:
        opened = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8 + 40)]
        closed = await asyncio.gather(*(closed_by_server(reader, 60) for reader, _ in opened[8:]))
        assert all(closed) and len(server._runner.server.connections) == 8  # refused, not queued
        async with open_episode(server, "e", 1) as record:  # an open episode's agent gets connections of its own
            answer = await ask(server, record, {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            assert answer.status_code == 200
        for _, writer in opened:
            writer.close()


async def test_a_connection_that_sends_no_whole_request_head_is_dropped(engine):
    async with serving(engine.tokenizer, Scripted(engine.tokenizer, "ok"), read_timeout_s=1) as server:
        silent = await asyncio.open_connection("127.0.0.1", server.port)
        half = await raw_request(server.port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert await closed_by_server(silent[0], 60) and await closed_by_server(half[0], 60)
        for _, writer in (silent, half):
            writer.close()


async def raw_request(port: int, head: str, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def test_a_body_past_the_limit_or_too_slow_is_refused_before_any_parsing(engine):
    async with serving(engine.tokenizer, Scripted(engine.tokenizer, "ok"), read_timeout_s=1.0) as server:
        async with open_episode(server, "e", 1) as record:
            path = f"/episodes/{record.episode_id}/v1/chat/completions"
            auth = f"Authorization: Bearer {key_of(server, record)}\r\nContent-Type: application/json\r\n"
            declared = f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {15 * 2**20}\r\n\r\n"
            reader, writer = await raw_request(server.port, declared, b'{"messages": [')
            status = await asyncio.wait_for(reader.readline(), 10)  # answered from Content-Length alone
            assert b" 413 " in status
            writer.close()
            chunked = f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n"
            reader, writer = await raw_request(server.port, chunked)
            chunk = b"x" * 2**20
            with contextlib.suppress(ConnectionError):
                for _ in range(16):
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
            assert b" 413 " in await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            slow = f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n"
            reader, writer = await raw_request(server.port, slow, b'{"model": ')  # and then nothing
            assert await closed_by_server(reader, 20)
            writer.close()
            assert record.turns == 0 and record.tokens.segments == []


NESTED = '<tool_call>{"name": "python", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"


async def test_a_reply_nested_past_any_call_is_answered_as_text(engine):
    tokenizer = tokenizer_with(engine, HERMES)
    async with serving(tokenizer, Scripted(tokenizer, NESTED)) as server:
        async with open_episode(server, "e", 1) as record:
            body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Go"}], "tools": [TOOL]}
            answer = await ask(server, record, body)
            assert answer.status_code == 200, answer.text
            message = answer.json()["choices"][0]["message"]
            assert message["content"] == NESTED and not message.get("tool_calls")


@pytest.mark.parametrize("template", ["chatml", None])
async def test_content_as_a_list_of_text_parts_is_the_same_prompt_as_its_text(engine, template):
    tokenizer = tokenizer_with(engine, engine.tokenizer.chat_template if template else None)
    sampler = Scripted(tokenizer, "ok")
    async with serving(tokenizer, sampler) as server:
        for content in ("Hi\nthere", [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]):
            async with open_episode(server, "e", 1) as record:
                messages = [{"role": "system", "content": content}, {"role": "user", "content": content}]
                answer = await ask(server, record, {"model": SERVED_MODEL, "messages": messages})
                assert answer.status_code == 200, answer.text
        assert sampler.prompts[0] == sampler.prompts[1]


MALFORMED = [  # (what the body changes, what the refusal says)
    ({"messages": [{"role": "user", "content": 7}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
    ({"messages": [{"role": 3, "content": "Hi"}]}, "role"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]}, "tool_calls"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "UTF-8"),
    ({"tools": "python"}, "tools"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"n": 2}, "send n requests for n replies"),
    ({"stop": ["a", 3]}, "stop must be a string or a list"),
    ({"messages": [{"role": "user", "content": "Hi", "extra": json.loads("[" * 100 + "]" * 100)}]}, "nested"),
]


async def test_malformed_requests_are_refused_in_openais_shape_and_spend_nothing(engine):
    async with serving(engine.tokenizer, Scripted(engine.tokenizer, "ok")) as server:
        async with open_episode(server, "e", 1) as record:
            good = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            for change, said in MALFORMED:
                answer = await ask(server, record, good | change)
                error = answer.json()["error"]
                assert 400 <= answer.status_code < 500 and said in error["message"], (change, answer.text)
                assert set(error) >= {"message", "type", "code"}
            for prompt in ([len(engine.tokenizer) + 5], [-1], "", []):
                answer = await ask(server, record, {"model": SERVED_MODEL, "prompt": prompt}, "completions")
                assert answer.status_code == 400 and "prompt" in answer.json()["error"]["message"], prompt
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
                for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/chat/completions")):
                    answer = await http.request(method, path, headers={"Authorization": f"Bearer {key_of(server, record)}"})
                    assert 400 <= answer.status_code < 500 and answer.json()["error"]["message"], path
            assert record.turns == 0 and record.tokens.segments == [] and record.failure is None
            assert (await ask(server, record, good)).status_code == 200  # its one turn is still there


def open_episode(server: ChatServer, name: str, turns: int):
    return server.episode(sampling_seeds(0, name, turns), False)


def key_of(server: ChatServer, record) -> str:
    return record.key


async def ask(server: ChatServer, record, body: dict, route: str = "chat/completions") -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(
            f"{server.endpoint(record).base_url}/{route}", content=json.dumps(body),  # a lone surrogate escaped
            headers={"Authorization": f"Bearer {key_of(server, record)}", "Content-Type": "application/json"},
            timeout=60,
        )
