"""The ``openai`` teacher binding against a real OpenAI-compatible server on localhost (tests/openai_server.py)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from openai_server import CompletionServer

from actors.models.facts import TinyModelSpec
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.tasks.strings import Reverse, Sort
from actors.teachers.bindings import BindingConfig, BindingError, Student, TopKRequest
from actors.teachers.bindings import openai as openai_binding
from actors.teachers.bindings.openai import OpenAITeacher

TASK = Reverse()
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("student"), TinyModelSpec(), TASK.alphabet, seed=0))


@pytest.fixture(scope="module")
def server(student_dir):
    with CompletionServer(student_dir, name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def other_server(tmp_path_factory):
    """The same model name, served over another alphabet: a tokenizer the student's text does not survive."""
    path = build_tiny_model(tmp_path_factory.mktemp("other"), TinyModelSpec(), Sort(letters="xyz").alphabet, seed=1)
    with CompletionServer(str(path), name="tiny") as running:
        yield running


def bind(url: str, student_dir: str, model: str = "tiny", top_k: int = 5) -> OpenAITeacher:
    cfg = BindingConfig(kind="openai", use=("distill", "replay"), url=url, model=model, top_k=top_k)
    return OpenAITeacher(cfg, Student(model_path=student_dir, max_new_tokens=MAX_NEW_TOKENS, seed=0))


@pytest.fixture(scope="module")
def policy(student_dir):
    model, tokenizer = load_policy(student_dir)
    return model.eval(), tokenizer


def hf_top_k(policy, request: TopKRequest, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own top-k at every completion position, the completion's token in place of the least likely where
    it is not among them: what the teacher's scores must equal. Not at a closing EOS: the server scores that position
    as the generated token's, whose top logprobs hold the generated token, not the student's EOS."""
    model, tokenizer = policy
    prompt = tokenizer(request.prompt).input_ids
    ids = torch.tensor([prompt + request.completion_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    values, top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    own = torch.tensor(request.completion_ids)
    missing = (top != own[:, None]).all(-1) & (own != tokenizer.eos_token_id)
    top[missing, -1] = own[missing]
    values[missing, -1] = logprobs[missing, own[missing]]
    return top, values


def completions(tokenizer) -> list[TopKRequest]:
    """Student samples as the generator returns them: EOS-terminated, plus one cut at the length limit."""
    eos = tokenizer.eos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    problems = TASK.problems(seed=0, step=0, count=3)
    return [
        TopKRequest(problems[0].prompt, encode(problems[0].answer) + [eos]),
        TopKRequest(problems[1].prompt, encode("ha=ha") + [eos]),
        TopKRequest(problems[2].prompt, [eos]),
        TopKRequest(problems[0].prompt, encode("abcdefgh")),  # truncated: no EOS to score
    ]


@pytest.mark.parametrize("top_k", [5, 50], ids=["top5", "top_k_over_vocab"])
def test_score_equals_the_models_own_top_k(server, student_dir, policy, top_k):
    teacher = bind(server.url, student_dir, top_k=top_k)
    requests = completions(policy[1])
    for request, scores in zip(requests, teacher.top_k(requests), strict=True):
        ids, values = hf_top_k(policy, request, top_k)
        assert (
            scores.ids.shape == scores.logprobs.shape == (len(request.completion_ids), min(top_k, teacher.vocab_size))
        )
        assert all(len(set(row)) == len(row) for row in scores.ids.tolist())
        np.testing.assert_array_equal(scores.ids, ids.numpy())
        np.testing.assert_allclose(scores.logprobs, values.numpy(), atol=1e-4)


def test_trace_is_the_greedy_completion(server, student_dir, policy):
    problems = TASK.problems(seed=0, step=1, count=4)
    model, tokenizer = policy
    expected = []
    for problem in problems:
        ids = tokenizer(problem.prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert bind(server.url, student_dir).trace(problems) == expected


def test_a_model_the_server_does_not_serve_is_refused(server, student_dir):
    with pytest.raises(BindingError, match=r"serves \['tiny'\], not 'llama'.*model:"):
        bind(server.url, student_dir, model="llama")


def test_a_dead_port_is_refused_with_the_url(student_dir):
    with socket.socket() as bound:  # bound, never listening: refused, and no other program can take the port
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1"
        with pytest.raises(BindingError, match=rf"cannot reach the openai teacher at {url}/models.*start the server"):
            bind(url, student_dir)


def test_a_silent_server_times_out(student_dir, monkeypatch):
    monkeypatch.setattr(openai_binding, "TIMEOUT_S", 0.2)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with pytest.raises(BindingError, match=r"did not answer within 0.2 s"):
            bind(url, student_dir)


def test_a_server_with_another_tokenizer_is_refused(other_server, student_dir):
    with pytest.raises(BindingError, match=r"tokenizes differently from the student.*--tokenizer"):
        bind(other_server.url, student_dir)


def test_scoring_refuses_a_completion_the_server_splits_differently(server, other_server, student_dir, policy):
    teacher = bind(server.url, student_dir)
    teacher.url = other_server.url  # the server was swapped for one with another tokenizer after binding
    with pytest.raises(BindingError, match=r"split the completion .* where the student has"):
        teacher.top_k(completions(policy[1])[:1])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": "tiny"}, "needs url"),
        ({"url": "http://localhost:8000/v1"}, "needs model"),
        ({"url": "localhost:8000/v1", "model": "tiny"}, "not an http"),
    ],
)
def test_check_refuses_a_config_without_url_or_model(fields, message):
    with pytest.raises(ValueError, match=message):
        BindingConfig(kind="openai", **fields)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_server_echoes_like_vllm(server):
    status, body = post(
        f"{server.url}/completions", {"model": "tiny", "prompt": "abc=", "echo": True, "logprobs": 2, "max_tokens": 1}
    )
    assert status == 200 and body["object"] == "text_completion"
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"][:4] == ["a", "b", "c", "="] and len(logprobs["tokens"]) == 5
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])  # top 2, plus the token itself
    assert logprobs["text_offset"][:4] == [0, 1, 2, 3]


def test_server_refuses_an_unknown_model_with_an_openai_error(server):
    status, body = post(f"{server.url}/completions", {"model": "gpt-4", "prompt": "abc="})
    assert status == 404
    assert body["error"]["type"] == "NotFoundError" and "gpt-4" in body["error"]["message"]
