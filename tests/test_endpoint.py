"""The run's OpenAI-compatible endpoint (``actors/agents/endpoint.py``): the official ``openai`` client
talks to a real engine on a tiny BPE model with a ChatML template, and every episode trains on the very tokens
sampled (``actors/agents/chat_tokens.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from actors.agents.chat_tokens import ChatTokens
from actors.agents.endpoint import (
    CONNECTIONS_PER_EPISODE,
    REQUESTS_PER_EPISODE,
    SERVED_MODEL,
    ChatServer,
    EpisodeRecord,
    _tool_calls,
    dropped_for_new,
)
from actors.agents.openai_fields import FIELDS
from actors.contract.rollouts import ReplyRequest, Trajectory
from actors.generator.engines import Sampling, sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.models.tokenizers import char_tokenizer

openai = pytest.importorskip("openai", reason="the openai client is installed with the agents extra")

BPE = TinyModelSpec(hidden_size=64, heads=4, kv_heads=2, max_positions=512, tokenizer="bpe")
TURNS = 4
TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    model = build_tiny_model(tmp_path_factory.mktemp("bpe"), BPE, None, seed=0)
    return HFEngine(str(model), Sampling(max_new_tokens=8))


class Recording:
    """The engine as the server's sampler, keeping every reply it sampled."""

    def __init__(self, engine: HFEngine):
        self.engine, self.replies, self.requests = engine, [], []

    async def __call__(self, ids, seed, greedy, request=ReplyRequest()):
        reply = await self.engine.continue_from(
            ids, seed, greedy, request.max_tokens, None, request.stop, request.top_logprobs
        )
        self.replies.append(reply)
        self.requests.append(request)
        version = len(self.replies) // 2  # a new policy version every other turn
        return replace(reply, versions=[version] * len(reply.completion_ids))


@pytest.fixture
async def server(engine):
    sampler = Recording(engine)
    server = ChatServer(engine.tokenizer, sampler, positions=BPE.max_positions, sampling=engine.sampling)
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

    server = ChatServer(engine.tokenizer, Recording(engine), BPE.max_positions, engine.sampling, score=score)
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
        assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it
        whole = await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], logprobs=1)
        sampled = server.sampler.replies[-1]
        assert whole.choices[0].logprobs.token_logprobs == sampled.logprobs and whole.usage.prompt_tokens == 3
        assert whole.choices[0].logprobs.top_logprobs[0] == {engine.tokenizer.decode(sampled.completion_ids[:1]):
                                                             sampled.logprobs[0]}  # greedy: the top one is it
        chunks = [c async for c in await client.completions.create(
            model=SERVED_MODEL, prompt=[5, 6, 7], stream=True, stream_options={"include_usage": True}
        )]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(sampled.completion_ids)


async def test_max_tokens_and_stop_end_the_engines_sampling_not_a_cut_after_it(server, engine):
    async with server.episode(sampling_seeds(0, "limits", TURNS), True) as record:
        client = client_of(server, record)
        whole = server.sampler  # greedy: the same prompt continues the same way every time
        await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7])
        full = whole.replies[-1].completion_ids
        text = engine.tokenizer.decode(full, skip_special_tokens=True)
        assert len(full) >= 3 and len(text) >= 3
        short = await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], max_tokens=2)
        assert whole.requests[-1].max_tokens == 2 and whole.replies[-1].completion_ids == full[:2]  # sampled 2 only
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
        stop = text[1:3]
        stopped = await client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], stop=[stop])
        sampled = whole.replies[-1].completion_ids  # the engine ended with the token that completed the stop string
        assert whole.requests[-1].stop == (stop,) and len(sampled) < len(full) and sampled == full[: len(sampled)]
        assert stop in engine.tokenizer.decode(sampled) and stop not in engine.tokenizer.decode(sampled[:-1])
        assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens == len(sampled)
        assert record.trajectories()[-1].completion_ids[-len(sampled):] == sampled  # those train


async def test_top_logprobs_are_the_engines_and_a_seed_draws_the_same_reply_in_its_episode(server, engine):
    async with open_episode(server, "top", 4) as record:
        client = client_of(server, record)
        body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
        answer = await client.chat.completions.create(**body, top_logprobs=3, seed=11)
        reply = server.sampler.replies[-1]
        content = answer.choices[0].logprobs.content
        assert len(content) == len(reply.completion_ids) and reply.top_logprobs is not None
        for place, token, top in zip(content, reply.completion_ids, reply.top_logprobs, strict=True):
            assert [(t.token, t.logprob) for t in place.top_logprobs] == [
                (engine.tokenizer.decode([t]), lp) for t, lp in top
            ]
            assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and place.logprob <= top[0][1]
            assert place.token == engine.tokenizer.decode([token])
        again = await client.chat.completions.create(**body, seed=11)  # the same request, seeded: the same draw
        other = await client.chat.completions.create(**body, seed=12)  # (a tiny random model: near-uniform draws)
        assert again.choices[0].message.content == answer.choices[0].message.content
        assert other.choices[0].message.content != answer.choices[0].message.content


async def test_completions_extend_their_episode_by_its_ids_or_the_text_served(server, engine):
    async with open_episode(server, "extend", 4) as record:
        client = client_of(server, record)
        first = await client.completions.create(model=SERVED_MODEL, prompt="Count: 1, 2,")
        said = "Count: 1, 2," + first.choices[0].text + " then"
        await client.completions.create(model=SERVED_MODEL, prompt=said)  # the text it was served, and more
        (row,) = record.trajectories()
        one, two = (r.completion_ids for r in server.sampler.replies[-2:])
        assert row.completion_ids == one + engine.tokenizer(" then", add_special_tokens=False).input_ids + two
        assert [t for t, mine in zip(row.completion_ids, row.loss_mask, strict=True) if mine] == one + two
        ids = row.prompt_ids + row.completion_ids + [5, 6]
        await client.completions.create(model=SERVED_MODEL, prompt=ids)  # its ids, and more
        (row,) = record.trajectories()
        three = server.sampler.replies[-1].completion_ids
        assert row.prompt_ids + row.completion_ids == ids + three and server.sampler.replies[-1].prompt_ids == ids
        await client.completions.create(model=SERVED_MODEL, prompt="Something else")  # not a continuation
        assert len(record.trajectories()) == 2 and record.tokens.split == 1


async def test_a_turn_renders_the_chat_template_once(server):
    turns = 10
    async with open_episode(server, "renders", turns) as record:
        await converse(client_of(server, record), turns)
    (trajectory,) = record.trajectories()
    assert record.tokens.renders == turns and record.tokens.split == 0


def field_cases() -> list[tuple[str, str, dict, int, str]]:
    """(route, field, the fields sent, status, what the answer says): a value of every field of OpenAI's requests
    that asks for something, and for a field fixed by the topology or refused, its value that asks for nothing."""
    chat, completions = "chat/completions", "completions"
    sent = {
        "max_tokens": 2, "max_completion_tokens": 2, "stop": ["zz"], "seed": 3, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u-1", "metadata": {"run": "a"}, "store": True,
        "service_tier": "auto", "safety_identifier": "s-1", "prompt_cache_key": "k-1",
    }
    cases = []
    for route in (chat, completions):
        kind = "chat" if route == chat else "completions"
        for name, spec in FIELDS.items():
            if kind not in spec.routes or name in ("model", "messages", "prompt"):
                continue
            if spec.rule == "refused":
                cases.append((route, name, {name: REFUSED_ASKS[name]}, 400, name))
                if name in NEUTRAL:
                    cases.append((route, name, {name: NEUTRAL[name]}, 200, ""))
            elif spec.rule == "fixed":
                cases.append((route, name, {name: 0.5}, 400, f"actors.generator.{name}"))
                cases.append((route, name, {name: 1.0}, 200, ""))
            elif name == "logprobs":
                cases.append((route, name, {name: True if kind == "chat" else 2}, 200, ""))
            elif name == "top_logprobs":
                cases.append((route, name, {name: 2, "logprobs": True}, 200, ""))
            elif name == "stream_options":
                cases.append((route, name, {name: sent[name], "stream": True}, 200, ""))
            elif name in ("tools", "tool_choice"):
                cases.append((route, name, {"tools": [TOOL], "tool_choice": "none"}, 200, ""))
                cases.append((route, name, {"tools": [TOOL], "tool_choice": "required"}, 400, "tool_choice"))
            else:
                cases.append((route, name, {name: sent[name]}, 200, ""))
        cases.append((route, "top_k", {"top_k": 5}, 400, "does not take 'top_k'"))
    return cases


REFUSED_ASKS = {
    "n": 2, "best_of": 2, "parallel_tool_calls": False, "logit_bias": {"5": 10}, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "response_format": {"type": "json_object"}, "prediction": {"type": "content"},
    "modalities": ["text", "audio"], "audio": {"voice": "alloy"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "functions": [TOOL["function"]], "function_call": "auto", "echo": True, "suffix": "x",
}
NEUTRAL = {"n": 1, "best_of": 1, "parallel_tool_calls": True, "logit_bias": {}, "presence_penalty": 0,
           "frequency_penalty": 0.0, "response_format": {"type": "text"}, "modalities": ["text"], "echo": False}


@pytest.mark.parametrize(("route", "field", "sent", "status", "said"), field_cases(),
                         ids=lambda value: value if isinstance(value, str) else None)
async def test_every_openai_request_field_is_honoured_fixed_by_the_topology_or_refused(
    server, route, field, sent, status, said
):
    async with open_episode(server, f"field {route} {field}", 1) as record:
        base = {"model": SERVED_MODEL} | (GOOD if route == "chat/completions" else {"prompt": [5, 6, 7]})
        answer = await ask(server, record, base | sent, route)
        assert answer.status_code == status, answer.text
        if status == 400:
            assert said in answer.json()["error"]["message"] and record.turns == 0  # refused: no turn spent


def test_the_field_cases_cover_every_field():
    covered = {(route.split("/")[0], name) for route, name, *_ in field_cases()}
    assert {(route, name) for name, spec in FIELDS.items() for route in spec.routes
            if name not in ("model", "messages", "prompt")} <= covered
    docs = (Path(__file__).parent.parent / "docs" / "environments-and-agents.md").read_text()
    assert [name for name in FIELDS if f"`{name}`" not in docs] == []  # each listed for the people who send it


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

    async def __call__(self, ids, seed, greedy, request=ReplyRequest()):
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
    server = ChatServer(tokenizer, sample, positions=BPE.max_positions, sampling=Sampling(max_new_tokens=8))
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
    ({"n": 2}, "send n requests"),
    ({"seed": "7"}, "seed must be an integer"),
    ({"stream_options": {"include_usage": "yes"}}, "include_usage must be true or false"),
    ({"tool_choice": {"type": "function", "function": {"name": "python"}}}, "cannot make the reply call a tool"),
    ({"stop": ["a", 3]}, "stop must be a string or a list"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop": {"a": 1}}, "stop must be a string or a list"),
    ({"stream": "false"}, "stream must be true or false"),
    ({"stream": 1}, "stream must be true or false"),
    ({"logprobs": "true"}, "logprobs must be true or false"),
    ({"logprobs": 1}, "logprobs must be true or false"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"top_logprobs": "2"}, "top_logprobs must be an integer"),
    ({"top_logprobs": -1}, "top_logprobs must be an integer"),
    ({"messages": [{"role": "user", "content": "Hi", "extra": json.loads("[" * 100 + "]" * 100)}]}, "nested"),
]


COMPLETION_MALFORMED = [  # (what a /completions body changes, what the refusal says)
    ({"prompt": [10**6]}, "prompt"),  # past the vocabulary
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ""}, "prompt encodes to no token"),
    ({"prompt": []}, "prompt"),
    ({"logprobs": 6}, "logprobs must be an integer from 0 to 5"),
    ({"logprobs": -1}, "logprobs must be an integer from 0 to 5"),
    ({"logprobs": True}, "logprobs must be an integer from 0 to 5"),
    ({"logprobs": "1"}, "logprobs must be an integer from 0 to 5"),
    ({"stream": "true"}, "stream must be true or false"),
    ({"stop": 5}, "stop must be a string or a list"),
]


async def test_malformed_requests_are_refused_in_openais_shape_and_spend_nothing(engine):
    sampler = Scripted(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler) as server:
        async with open_episode(server, "e", 1) as record:
            good = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            for change, said in MALFORMED:
                answer = await ask(server, record, good | change)
                error = answer.json()["error"]
                assert answer.status_code == 400 and said in error["message"], (change, answer.text)
                assert error["type"] == "invalid_request_error" and set(error) >= {"message", "code", "param"}
            for change, said in COMPLETION_MALFORMED:
                body = {"model": SERVED_MODEL, "prompt": [5, 6]} | change
                answer = await ask(server, record, body, "completions")
                assert answer.status_code == 400 and said in answer.json()["error"]["message"], (change, answer.text)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
                for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/chat/completions")):
                    answer = await http.request(method, path, headers={"Authorization": f"Bearer {key_of(server, record)}"})
                    assert 400 <= answer.status_code < 500 and answer.json()["error"]["message"], path
            assert record.turns == 0 and record.tokens.segments == [] and record.failure is None
            assert sampler.prompts == []  # refused before sampling
            assert (await ask(server, record, good)).status_code == 200  # its one turn is still there


# ----------------------------------------------------------------------------- agents are guests (issue 59)

GOOD = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}


async def test_empty_or_out_of_vocabulary_prompts_are_refused_before_sampling():
    tokenizer = char_tokenizer("abc ok")  # drops what is not in its alphabet; no chat template
    sampler = Scripted(tokenizer, "ok")
    async with serving(tokenizer, sampler) as server, open_episode(server, "e", 1) as record:
        for content in ("", "\U0001f600\u4e2d"):
            answer = await ask(server, record, GOOD | {"messages": [{"role": "user", "content": content}]})
            error = answer.json()["error"]
            assert answer.status_code == 400 and "encode to no token" in error["message"], answer.text
            assert error["code"] == "invalid_prompt" and error["type"] == "invalid_request_error"
        answer = await ask(server, record, {"model": SERVED_MODEL, "prompt": "\U0001f600"}, "completions")
        assert answer.status_code == 400 and "encodes to no token" in answer.json()["error"]["message"]
        assert sampler.prompts == [] and record.turns == 0


async def test_flags_of_the_right_type_and_a_bearer_scheme_in_any_case_are_served(engine):
    sampler = Scripted(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler) as server, open_episode(server, "e", 6) as record:
        for change in ({"top_logprobs": 0, "logprobs": True}, {"top_logprobs": None, "stream": False}):
            answer = await ask(server, record, GOOD | change)
            assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "ok"
        answer = await ask(server, record, {"model": SERVED_MODEL, "prompt": "Hi", "logprobs": 0}, "completions")
        assert answer.json()["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * len(sampler.ids)
        async with httpx.AsyncClient(base_url=server.endpoint(record).base_url) as http:
            for scheme in ("bearer", "BEARER", "BeArEr"):
                headers = {"Authorization": f"{scheme} {record.key}"}
                answer = await http.post("/chat/completions", json=GOOD, headers=headers)
                assert answer.status_code == 200, (scheme, answer.text)


class Held(Scripted):
    """Scripted, the turns sampled with a seed in ``held`` kept in flight until ``release`` is set."""

    def __init__(self, tokenizer, text: str):
        super().__init__(tokenizer, text)
        self.held, self.release, self.holding = set(), asyncio.Event(), 0

    async def __call__(self, ids, seed, greedy, request=ReplyRequest()):
        if seed in self.held:
            self.holding += 1
            try:
                await self.release.wait()
            finally:
                self.holding -= 1
        return await super().__call__(ids, seed, greedy, request)


async def wait_until(condition, within: float = 30) -> None:
    async with asyncio.timeout(within):
        while not condition():
            await asyncio.sleep(0.01)


async def hold_idle(port: int, opened: list[int]) -> None:
    """One connection that never shows a key, opened again each time the server drops it, until cancelled."""
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(1)
        try:
            with contextlib.suppress(ConnectionError):
                await reader.read()
        finally:
            writer.close()


async def paced(server: ChatServer, record, turns: int, opened: list[int]) -> list[tuple[int, int]]:
    """An agent's turns a little apart, each on a connection of its own: (status, connections opened by then)."""
    served = []
    for _ in range(turns):
        served.append(((await ask(server, record, GOOD)).status_code, len(opened)))
        await asyncio.sleep(0.25)
    return served


async def test_idle_keyless_connections_opened_again_as_dropped_keep_no_agent_out(engine):
    """A local process holding 120 idle connections, opening each again as the server drops it, while two
    episodes' agents send 20 requests: every one is served."""
    async with serving(engine.tokenizer, Scripted(engine.tokenizer, "ok")) as server:
        opened: list[int] = []
        holders = [asyncio.create_task(hold_idle(server.port, opened)) for _ in range(120)]
        try:
            await wait_until(lambda: len(server._anonymous) >= 120)
            async with open_episode(server, "a", 10) as a, open_episode(server, "b", 10) as b:
                agents = await asyncio.gather(paced(server, a, 10, opened), paced(server, b, 10, opened))
            await wait_until(lambda: len(opened) >= 240)  # each dropped at its deadline and opened again
        finally:
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    served = [*agents[0], *agents[1]]
    assert [status for status, _ in served] == [200] * 20
    assert any(count > 120 for _, count in served)  # served while the flood was opening connections again


async def test_when_every_anonymous_place_is_taken_the_oldest_connection_goes(engine):
    sampler = Scripted(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler, anonymous_connections=8, key_deadline_s=600) as server:
        opened = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(40)]
        dropped = await asyncio.gather(*(closed_by_server(reader, 60) for reader, _ in opened[:32]))
        assert all(dropped) and len(server._anonymous) == 8  # the oldest went, one for each new one
        assert not await closed_by_server(opened[-1][0], 0.2)
        async with open_episode(server, "e", 1) as record:  # an agent's new connection takes the oldest's place
            assert (await ask(server, record, GOOD)).status_code == 200
        assert len(server._anonymous) <= 8
        for _, writer in opened:
            writer.close()


def test_a_connection_whose_request_came_outlives_a_flood_of_idle_ones():
    """On a loaded host the bytes of a request may wait several loop turns to be read and its key longer to be
    checked: the idle connections opened meanwhile take other idle ones' places, never its own."""
    waiting = {"sent": True}.get
    anonymous = {"heard": True, "sent": False, "idle 1": False, "idle 2": False}
    assert dropped_for_new(anonymous, lambda c: bool(waiting(c))) == "idle 1"
    assert dropped_for_new({"heard": True, "sent": False}, lambda c: bool(waiting(c))) == "heard"  # none idle: oldest


async def test_a_connection_knows_whether_bytes_wait_on_it_unread(engine):
    async with serving(engine.tokenizer, Scripted(engine.tokenizer, "ok"), key_deadline_s=600) as server:
        _, idle = await asyncio.open_connection("127.0.0.1", server.port)
        await wait_until(lambda: len(server._anonymous) == 1)
        (connection,) = server._anonymous
        assert not connection.sent_something()
        connection.transport.pause_reading()  # as a busy loop that has not got to it yet
        idle.write(b"POST /episodes/x/v1/chat/completions HTTP/1.1\r\n")
        await wait_until(connection.sent_something)
        connection.transport.resume_reading()
        idle.close()


def request_bytes(record, body: dict = GOOD) -> bytes:
    """A chat request to ``record``'s episode with its key, as sent on the wire."""
    data = json.dumps(body).encode()
    return (
        f"POST /episodes/{record.episode_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {record.key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    """One request on an open connection: its answer's status, the answer read whole."""
    writer.write(request)
    await writer.drain()
    status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        length = int(value) if name.strip().lower() == "content-length" else length
    await reader.readexactly(length)
    return status


async def test_a_connection_shows_a_live_key_in_time_or_is_dropped_then_serves_that_episode_only(engine):
    sampler = Scripted(engine.tokenizer, "ok")
    async with (
        serving(engine.tokenizer, sampler, key_deadline_s=0.5, read_timeout_s=2) as server,
        open_episode(server, "a", 2) as a, open_episode(server, "b", 1) as b,
    ):
        start = asyncio.get_running_loop().time()
        silent = await asyncio.open_connection("127.0.0.1", server.port)
        half = await raw_request(server.port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert await closed_by_server(silent[0], 60) and await closed_by_server(half[0], 60)
        assert asyncio.get_running_loop().time() - start >= 0.4  # at the deadline, not as they came
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await exchange(reader, writer, request_bytes(a)) == 200
        await asyncio.sleep(1.0)  # past the key deadline, within the read timeout: the episode's, it stays
        assert await exchange(reader, writer, request_bytes(a)) == 200
        assert await closed_by_server(reader, 60)  # idle past the read timeout
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        models = f"GET /episodes/{a.episode_id}/v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.key}\r\n\r\n"
        assert await exchange(reader, writer, models.encode()) == 200  # the connection is a's now
        assert await exchange(reader, writer, request_bytes(b)) == 403
        assert await closed_by_server(reader, 60) and b.turns == 0
        for _, w in (silent, half, (reader, writer)):
            w.close()


async def test_one_agents_flood_is_refused_past_its_own_bounds_while_a_sibling_is_served(engine):
    sampler = Held(engine.tokenizer, "ok")
    async with (
        serving(engine.tokenizer, sampler) as server,
        open_episode(server, "hog", 150) as hog, open_episode(server, "sibling", 10) as sibling,
    ):
        sampler.held = set(hog.seeds)  # the hog's turns stay in flight: its places stay taken
        url, headers = f"{server.endpoint(hog).base_url}/chat/completions", {"Authorization": f"Bearer {hog.key}"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=60) as http:
            flood = [asyncio.create_task(http.post(url, json=GOOD, headers=headers)) for _ in range(150)]
            served = [(await ask(server, sibling, GOOD)).status_code for _ in range(10)]
            await wait_until(lambda: sum(task.done() for task in flood) == 150 - REQUESTS_PER_EPISODE)
            assert served == [200] * 10 and sibling.turns == 10
            assert len(hog.requests) == REQUESTS_PER_EPISODE and len(hog.connections) <= CONNECTIONS_PER_EPISODE
            refused = [task.result() for task in flood if task.done()]
            assert {answer.status_code for answer in refused} == {429}
            said = {answer.json()["error"]["message"].split(",")[0] for answer in refused}
            assert said == {
                f"this episode holds {CONNECTIONS_PER_EPISODE} connections already",
                f"this episode has {REQUESTS_PER_EPISODE} requests in flight already",
            }
            assert {answer.json()["error"]["code"] for answer in refused} == {"rate_limit_exceeded"}
            sampler.release.set()
            answers = await asyncio.gather(*flood)
        assert sum(answer.status_code == 200 for answer in answers) == REQUESTS_PER_EPISODE == hog.turns


async def test_an_agent_that_returns_with_turns_in_flight_leaves_whole_turns_only(engine):
    """The agent starts requests and returns its reward without their answers: the episode's end cancels them,
    so its record holds its whole turns and no half-made one (a row with no prompt token stopped the trainer)."""
    sampler = Held(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler) as server:
        for whole in (0, 1):
            async with asyncio.timeout(30):
                async with open_episode(server, f"e{whole}", 3) as record:
                    for _ in range(whole):
                        assert (await ask(server, record, GOOD)).status_code == 200
                    sampler.held = set(record.seeds[whole:])
                    left = [asyncio.create_task(ask(server, record, GOOD)) for _ in range(2)]
                    await wait_until(lambda: sampler.holding == 1 and len(record.requests) == 2)
            assert record.requests == set() and sampler.holding == 0
            await wait_until(lambda: not record.connections)  # closed with the episode
            await asyncio.gather(*left, return_exceptions=True)
            rows = record.trajectories()
            assert len(rows) == whole and record.turns == whole + 1  # the cancelled turn spent its seed
            assert all(row.prompt_ids and row.completion_ids == sampler.ids for row in rows)
            if whole:
                assert record.problem() is None
            else:
                assert "took no answer" in record.problem() and "await each request's answer" in record.problem()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_to_a_client_that_left_is_not_recorded(engine, stream):
    sampler = Held(engine.tokenizer, "ok")
    async with serving(engine.tokenizer, sampler) as server, open_episode(server, "e", 2) as record:
        sampler.held = {record.seeds[0]}
        _, writer = await raw_request(server.port, "", request_bytes(record, GOOD | {"stream": stream}))
        await wait_until(lambda: sampler.holding == 1)
        writer.close()
        await wait_until(lambda: not record.connections)
        sampler.release.set()
        await wait_until(lambda: not record.requests)
        assert record.tokens.segments == [] and record.turns == 1  # its tokens were never seen: not recorded
        assert (await ask(server, record, GOOD)).status_code == 200
        (row,) = record.trajectories()
        assert [t for t, mine in zip(row.completion_ids, row.loss_mask, strict=True) if mine] == sampler.ids


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
