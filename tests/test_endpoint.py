"""The run's OpenAI-compatible endpoint (``actors/environments/endpoint.py``): the official ``openai`` client
talks to a real engine on a tiny BPE model with a ChatML template, and every episode trains on the very tokens
sampled (``actors/environments/chat_tokens.py``)."""

from __future__ import annotations

import json

import httpx
import pytest

from actors.engines import Sampling, sampling_seeds
from actors.engines.hf import HFEngine
from actors.environments.chat_tokens import ChatTokens
from actors.environments.endpoint import SERVED_MODEL, ChatServer, _tool_calls
from actors.model import TinyModelSpec, build_tiny_model

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
        return reply, len(self.replies) // 2  # a new policy version every other turn


@pytest.fixture
async def server(engine):
    sampler = Recording(engine)
    server = ChatServer(engine.tokenizer, sampler, positions=BPE.max_positions, max_new_tokens=8)
    server.sampler = sampler
    await server.start()
    yield server
    await server.stop()


def client_of(server: ChatServer, episode: str) -> openai.AsyncOpenAI:
    endpoint = server.endpoint(episode)
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
    async with server.episode("e1", sampling_seeds(0, "e1", TURNS), False) as record:
        messages = await converse(client_of(server, "e1"), TURNS)
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
    assert stitched.replace("<|im_end|>", "") .strip() == rendered.replace("<|im_end|>", "").strip()
    assert record.turns == TURNS and record.tokens.split == 0
    assert record.turn_versions == [(len(r.completion_ids), (i + 1) // 2) for i, r in enumerate(replies)]


async def test_an_agent_that_edits_its_history_gets_a_row_of_its_own_not_wrong_tokens(server):
    async with server.episode("e2", sampling_seeds(0, "e2", TURNS), False) as record:
        await converse(client_of(server, "e2"), 3, edit_at=2)
    first, second = record.trajectories()
    assert record.tokens.split == 1
    assert sum(first.loss_mask) == sum(len(r.completion_ids) for r in server.sampler.replies[:2])
    assert sum(second.loss_mask) == len(server.sampler.replies[2].completion_ids)


async def test_streaming_and_completions_give_the_reply_and_its_logprobs(server, engine):
    async with server.episode("e3", sampling_seeds(0, "e3", TURNS), True):
        client = client_of(server, "e3")
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


async def test_bad_requests_are_refused_in_openais_shape_saying_what_to_send(server):
    async with server.episode("e4", sampling_seeds(0, "e4", 1), False):
        base = f"http://127.0.0.1:{server.port}"
        good = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        auth = {"Authorization": f"Bearer {server.key}"}
        async with httpx.AsyncClient(base_url=base) as http:
            cases = [
                ("/episodes/e4/v1/chat/completions", good, {}, 401, "send the api_key the agent was given"),
                ("/v1/chat/completions", good, auth, 400, "the request names no episode"),
                ("/episodes/nope/v1/chat/completions", good, auth, 404, "episode 'nope' is not open"),
                ("/episodes/e4/v1/chat/completions", good | {"model": "gpt-4o"}, auth, 404, "send model='policy'"),
                ("/episodes/e4/v1/chat/completions", good | {"tools": [TOOL]}, auth, 400, "does not render them"),
                ("/episodes/e4/v1/chat/completions", good | {"messages": "hi"}, auth, 400, "non-empty list"),
            ]
            for path, body, headers, status, said in cases:
                answer = await http.post(path, json=body, headers=headers)
                assert answer.status_code == status and said in answer.json()["error"]["message"], path
            deep = "[" * 100_000 + "]" * 100_000  # nested past Python's stack
            headers = auth | {"Content-Type": "application/json"}
            answer = await http.post("/episodes/e4/v1/chat/completions", content=deep, headers=headers)
            assert answer.status_code == 400 and "not JSON" in answer.json()["error"]["message"]
            assert server.episodes["e4"].tokens.segments == []  # nothing refused is recorded
            models = (await http.get("/episodes/e4/v1/models", headers=auth)).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [(SERVED_MODEL, BPE.max_positions)]
            assert (await http.post("/episodes/e4/v1/chat/completions", json=good, headers=auth)).status_code == 200
            over = await http.post("/episodes/e4/v1/chat/completions", json=good, headers=auth)
            assert over.status_code == 400 and "past the task's max_turns (1)" in over.json()["error"]["message"]
            episode = await http.post("/v1/chat/completions", json=good | {"user": "e4"}, headers=auth)
            assert "has ended" in episode.json()["error"]["message"]  # the episode failed: no more turns


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
    segment = tokens.prompt(asked, [TOOL])
    from actors.rollout import Trajectory

    sampled = tokenizer(text + "<|im_end|>", add_special_tokens=False).input_ids
    segment.add_reply(Trajectory([], sampled, [0.0] * len(sampled), [True] * len(sampled), text),
                      {"role": "assistant", "content": content, "tool_calls": calls}, tokenizer.eos_token_id)
    answered = [*asked, {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1"}]
    assert tokens.prompt(answered, [TOOL]) is segment and tokens.split == 0  # stitched after the sampled call
    assert tokenizer.decode(segment.ids).endswith("<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n")
