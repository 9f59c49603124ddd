"""A small OpenAI-compatible completions server over a local Hugging Face model, for tests.

It answers the way vLLM's OpenAI server does, so the ``openai`` teacher binding can be
tested end to end on a CPU without vLLM:

- ``GET {base}/models``: ``{"object": "list", "data": [{"id": name, "object": "model"}]}``.
- ``POST {base}/completions`` (legacy completions): ``prompt`` (a string or a list),
  ``max_tokens``, ``temperature`` (0: greedy), ``logprobs`` (k), ``echo``, ``seed``.
  The prompt is tokenized with the tokenizer's special tokens, as vLLM does; ``text``
  leaves special tokens out. Each ``top_logprobs`` entry holds the position's own
  token first, then the top k (so up to k+1 strings); tokens are written as
  ``tokenizer.decode([id])``. With ``echo`` the prompt's tokens come first and the
  first one has ``null`` logprob and top_logprobs; ``max_tokens: 0`` is accepted only
  with ``echo``.
- An unknown model is a 404, a malformed request a 400, with an OpenAI-style body
  ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import torch

from actors.models.policy import load_policy

BASE = "/v1"


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class CompletionModel:
    """The model behind the server: generation and per-position logprobs, one request at a time."""

    def __init__(self, model_path: str, name: str):
        self.name = name
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()
        self.lock = threading.Lock()

    def complete(self, request: dict) -> dict:
        """The response body of one ``/completions`` request."""
        params = _params(request, self.name)
        prompts = params.pop("prompts")
        with self.lock:
            choices = [self._choice(index, prompt, **params) for index, prompt in enumerate(prompts)]
        created = int(time.time())
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": created,
            "model": self.name,
            "choices": choices,
        }

    @torch.no_grad()
    def _choice(
        self,
        index: int,
        prompt: str,
        max_tokens: int,
        temperature: float,
        logprobs: int | None,
        echo: bool,
        seed: int | None,
    ) -> dict:
        prompt_ids = self.tokenizer(prompt).input_ids
        if not prompt_ids:
            raise RequestError(HTTPStatus.BAD_REQUEST, "the prompt must hold at least one token", "prompt")
        generated, finish_reason = self._generate(prompt_ids, max_tokens, temperature, seed)
        all_ids = prompt_ids + generated
        positions = self.model(input_ids=torch.tensor([all_ids])).logits[0].float().log_softmax(-1)
        start = 0 if echo else len(prompt_ids)
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        choice = {"index": index, "text": prompt + text if echo else text, "finish_reason": finish_reason}
        choice["logprobs"] = None if logprobs is None else self._logprobs(all_ids, positions, start, logprobs)
        return choice

    def _generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> tuple[list[int], str]:
        """Up to ``max_tokens`` tokens, stopping after EOS (which stays in the ids, as in vLLM)."""
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        generated: list[int] = []
        for _ in range(max_tokens):
            logits = self.model(input_ids=torch.tensor([ids + generated])).logits[0, -1].float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
            generated.append(token)
            if token == self.tokenizer.eos_token_id:
                return generated, "stop"
        return generated, "length"

    def _logprobs(self, ids: list[int], positions: torch.Tensor, start: int, k: int) -> dict:
        """OpenAI ``logprobs`` for ``ids[start:]``; ``positions[t]`` is the log-distribution over token ``t + 1``."""
        tokens = [self.tokenizer.decode([i]) for i in ids[start:]]
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        for t in range(start, len(ids)):
            if t == 0:  # nothing precedes the first token
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            row = positions[t - 1]
            token_logprobs.append(_json_float(row[ids[t]]))
            top_logprobs.append(self._top(row, ids[t], k))
        offsets = [sum(len(token) for token in tokens[:n]) for n in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _top(self, row: torch.Tensor, own: int, k: int) -> dict[str, float]:
        """The position's own token, then its top k (vLLM's order: up to k+1 entries)."""
        best = row.topk(min(k, row.shape[-1])).indices.tolist()
        chosen = list(dict.fromkeys([own, *best]))[: k + 1]
        return {self.tokenizer.decode([i]): _json_float(row[i]) for i in chosen}


def _params(request: dict, served: str) -> dict[str, Any]:
    """The request's fields, checked as vLLM checks them."""
    if request.get("model") != served:
        raise RequestError(HTTPStatus.NOT_FOUND, f"The model `{request.get('model')}` does not exist.", "model")
    prompt = request.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(HTTPStatus.BAD_REQUEST, "prompt must be a string or a non-empty list of strings", "prompt")
    echo = bool(request.get("echo", False))
    max_tokens = request.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < (0 if echo else 1):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens must be at least {0 if echo else 1}", "max_tokens")
    logprobs = request.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise RequestError(HTTPStatus.BAD_REQUEST, "logprobs must be a non-negative integer", "logprobs")
    temperature = float(request.get("temperature", 1.0))
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": logprobs,
        "echo": echo,
        "seed": request.get("seed"),
    }


def _json_float(value: torch.Tensor) -> float:
    """vLLM clamps -inf to -9999.0, which JSON can carry."""
    return max(float(value), -9999.0)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path.rstrip("/") != f"{BASE}/models":
            return self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}"))
        model = {"id": self.server.model.name, "object": "model", "created": 0, "owned_by": "tests"}
        self._send(HTTPStatus.OK, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != f"{BASE}/completions":
            return self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}"))
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if not isinstance(request, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
            self._send(HTTPStatus.OK, self.server.model.complete(request))
        except (json.JSONDecodeError, TypeError, ValueError) as error:
            self._error(RequestError(HTTPStatus.BAD_REQUEST, f"malformed request: {error}"))
        except RequestError as error:
            self._error(error)

    def _error(self, error: RequestError) -> None:
        kind = "NotFoundError" if error.status == HTTPStatus.NOT_FOUND else "BadRequestError"
        body = {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.status.value}}
        self._send(error.status, body)

    def _send(self, status: HTTPStatus, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read responses, not access logs."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, model: CompletionModel):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model = model


class CompletionServer:
    """``with CompletionServer(path, name) as server:`` serves ``path`` at ``server.url`` on a free local port."""

    def __init__(self, model_path: str, name: str):
        self.httpd = _Server(CompletionModel(model_path, name))
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=f"openai-server-{name}", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}{BASE}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
