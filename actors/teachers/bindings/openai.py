"""``openai``: a teacher behind an OpenAI-compatible completions server (vLLM and the like).

It speaks the legacy ``POST {url}/completions`` API with the standard library, the way
vLLM's OpenAI server implements it. That API names tokens by their *strings*, not ids,
so the teacher must split text exactly as the student does: ``__init__`` sends a probe
text built from the student's vocabulary and refuses the binding unless the server
echoes the student's own tokens, and every scoring call checks that the echoed
completion lines up with the student's tokens. (Token strings map to student ids
whatever ``token_map`` says; a differing tokenizer cannot line up, so it is refused.)

**Scoring** sends ``prompt + completion text`` with ``echo: true, logprobs: top_k,
max_tokens: 1``; the prompt is rendered with the student's chat template (the server shares the
student's tokenizer, template included). With echo, vLLM returns every prompt token's ``top_logprobs`` (the
teacher's top-k given the text before that token; ``null`` for the very first token),
which are the distributions at the completion's positions. The student's closing EOS
is not in the text, so no echoed position scores it; the one generated token's
``top_logprobs`` are the teacher's distribution *after* the completion text, which is
exactly the distribution the EOS position needs (the generated token itself is
ignored). ``max_tokens`` is 1 and not 0 because that one position is needed, and
because vLLM's sampling parameters long rejected ``max_tokens: 0``.

vLLM's ``top_logprobs`` hold the top ``logprobs`` tokens plus the echoed token itself
(so up to k+1); the k most likely are kept, the echoed token (the student's) in place of
the least likely where it is not among them (``top_k_from_entries``), and strings the
student's vocabulary lacks are dropped (their mass falls into the tail of the top-k
divergence). The EOS position's entries are the generated token's, so there the student's
EOS is among the ids only if it is among the teacher's top k (the sampled-token divergence
leaves such a position out).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from actors.contract.top_k import TopK
from actors.models.chat import render
from actors.tasks import Problem
from actors.teachers.bindings import BindingConfig, BindingError, Student, TopKRequest
from actors.teachers.bindings.tokens import top_k_from_entries

TIMEOUT_S = 60.0  # per HTTP call; a call carries a whole batch of prompts
PROBE_TOKENS = 64  # vocabulary entries the tokenizer probe spells out
SAME_TOKENIZER = (
    "serve a model with the student's tokenizer (vLLM: vllm serve MODEL --tokenizer STUDENT_MODEL_DIR); if it already "
    "has it, add --return-tokens-as-token-ids so that vLLM names tokens by id rather than by decoded text"
)


@dataclass(frozen=True)
class Spelling:
    """How a server writes the student's tokens: ``strings[id]``, and back (strings several ids share are left out).

    vLLM writes a token as ``tokenizer.decode([id])``; older versions wrote the raw
    vocabulary piece (``convert_ids_to_tokens``), and ``--return-tokens-as-token-ids``
    writes ``token_id:<id>``. These differ for byte-level BPE (``Ġthe`` vs `` the``), so
    the probe finds out which one a server uses.
    """

    name: str
    strings: list[str]
    ids: dict[str, int]

    @classmethod
    def of(cls, name: str, strings: list[str]) -> Spelling:
        counts = Counter(strings)
        return cls(name, strings, {s: i for i, s in enumerate(strings) if counts[s] == 1})


class OpenAITeacher:
    needs_hint = False
    follows_policy = False

    def __init__(self, cfg: BindingConfig, student: Student):
        from transformers import AutoTokenizer

        self.cfg, self.student = cfg, student
        self.url = cfg.url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(student.model_path)
        self.vocab_size = max(self.tokenizer.get_vocab().values()) + 1
        self._check_model_served()
        self.spelling = self._probe_spelling()

    def trace(self, problems: list[Problem]) -> list[str | None]:
        """The teacher's greedy completion of each prompt, cut at the student's length limit."""
        if not problems:
            return []
        prompts = [render(self.tokenizer, p.prompt, p.system_prompt) for p in problems]
        choices = self._complete(prompts, max_tokens=self.student.max_new_tokens)
        return [choice.get("text") for choice in choices]

    def top_k(self, requests: list[TopKRequest]) -> list[TopK]:
        """The teacher's top-k at each of the student's completion positions, EOS included (see the module doc)."""
        if not requests:
            return []
        texts = [
            render(self.tokenizer, r.prompt, r.system_prompt) + self._text(self._body(r.completion_ids))
            for r in requests
        ]
        choices = self._complete(texts, echo=True, logprobs=self.cfg.top_k, max_tokens=1)
        return [self._top_k(choice, request) for choice, request in zip(choices, requests)]

    def _check_model_served(self) -> None:
        served = [m.get("id") for m in _call(self.url + "/models").get("data", []) if isinstance(m, dict)]
        if self.cfg.model not in served:
            raise BindingError(
                f"the openai teacher server at {self.url} serves {served}, not {self.cfg.model!r}; set the "
                "binding's model: to one of these (vLLM serves --served-model-name, by default the model path)"
            )

    def _probe_spelling(self) -> Spelling:
        """Echo a text spelled from the student's vocabulary; the server must split it into the student's tokens."""
        special = set(self.tokenizer.all_special_ids)
        regular = sorted(i for i in self.tokenizer.get_vocab().values() if i not in special)
        text = self._text(regular[:: max(1, len(regular) // PROBE_TOKENS)][:PROBE_TOKENS])
        ids = self.tokenizer(text).input_ids  # vLLM's completions add special tokens (e.g. BOS) by default
        # logprobs=top_k here too, so that a server capping logprobs below top_k (vLLM: --max-logprobs) fails now
        (choice,) = self._complete([text], echo=True, logprobs=self.cfg.top_k, max_tokens=1)
        echoed = _echoed(choice, self.url)[0][:-1]  # the last token is the generated one
        for spelling in self._spellings():
            if echoed == [spelling.strings[i] for i in ids]:
                return spelling
        raise BindingError(
            f"the openai teacher at {self.url} ({self.cfg.model!r}) tokenizes differently from the student: it "
            f"splits the probe text {text[:80]!r} into {echoed[:12]} where the student's tokenizer "
            f"({self.student.model_path}) gives {self.tokenizer.convert_ids_to_tokens(ids)[:12]}. The API names "
            "tokens by their strings, so its logprobs would be read at the wrong positions and as the wrong "
            f"tokens. Fix: {SAME_TOKENIZER}."
        )

    def _spellings(self) -> Iterator[Spelling]:
        """The ways servers write tokens, built lazily: vLLM's current one first."""
        ids = list(range(self.vocab_size))
        yield Spelling.of("decoded", self.tokenizer.batch_decode([[i] for i in ids]))
        yield Spelling.of("vocabulary", [t or "" for t in self.tokenizer.convert_ids_to_tokens(ids)])
        yield Spelling.of("token ids", [f"token_id:{i}" for i in ids])

    def _complete(self, prompts: list[str], **params: Any) -> list[dict]:
        """One ``/completions`` call for a batch of prompts (greedy); the choices in prompt order."""
        body = {"model": self.cfg.model, "prompt": prompts, "temperature": 0, **params}
        choices = _call(self.url + "/completions", body).get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise BindingError(
                f"the openai teacher at {self.url} answered {len(prompts)} prompts with "
                f"{len(choices) if isinstance(choices, list) else 'no'} choices; it must accept a list of prompts "
                "as the OpenAI completions API does"
            )
        return sorted(choices, key=lambda choice: choice.get("index", 0))

    def _text(self, ids: list[int]) -> str:
        """The tokens' text exactly (no clean-up of spaces), so that the server can split it back into them."""
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def _body(self, completion_ids: list[int]) -> list[int]:
        """The completion's tokens without the closing EOS (which is scored from the generated position)."""
        ends = bool(completion_ids) and completion_ids[-1] == self.tokenizer.eos_token_id
        return completion_ids[:-1] if ends else completion_ids

    def _top_k(self, choice: dict, request: TopKRequest) -> TopK:
        tokens, tops = _echoed(choice, self.url)
        body = self._body(request.completion_ids)
        start = len(tokens) - 1 - len(body)  # echo: prompt tokens, completion tokens, one generated token
        want = [self.spelling.strings[i] for i in body]
        if start < 0 or tokens[start:-1] != want:
            raise BindingError(
                f"the openai teacher at {self.url} split the completion after {request.prompt[-40:]!r} into "
                f"{tokens[max(start, 0) : -1]} where the student has {want}, so its logprobs cannot be read at the "
                "student's positions. The server's tokenizer differs from the student's, or prompt and completion "
                f"merge into one token across their boundary; {SAME_TOKENIZER}"
            )
        positions = tops[start:] if len(body) < len(request.completion_ids) else tops[start:-1]
        entries = [self._entry(top) for top in positions]
        return top_k_from_entries(entries, self.cfg.top_k, self.vocab_size, sampled=request.completion_ids)

    def _entry(self, top: dict[str, float] | None) -> dict[int, float]:
        """One position's ``{token string: logprob}`` in student ids; strings the student lacks are dropped."""
        if not isinstance(top, dict):
            raise BindingError(
                f"the openai teacher at {self.url} gave no top_logprobs at a completion position (a server has "
                "none for the first token of a text, so the prompt must not be empty)"
            )
        return {self.spelling.ids[s]: float(lp) for s, lp in top.items() if s in self.spelling.ids}


def _echoed(choice: dict, url: str) -> tuple[list[str], list[dict | None]]:
    """A choice's echoed ``tokens`` and ``top_logprobs``, or why the server cannot give top-k."""
    logprobs = choice.get("logprobs") or {}
    tokens, tops = logprobs.get("tokens"), logprobs.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops) or not tokens:
        raise BindingError(
            f"the openai teacher at {url} did not return the prompt's logprobs with echo: true; it needs a "
            "server whose /completions echoes the prompt with top_logprobs, as vLLM's does"
        )
    return tokens, tops


def _call(url: str, body: dict | None = None) -> dict:
    """GET (no body) or POST JSON; every failure is a ``BindingError`` naming the URL and what to check."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:
        raise BindingError(
            f"the openai teacher at {url} answered HTTP {error.code}: {_error_message(error)}; check that url: is "
            "the API base (e.g. http://host:8000/v1) and that the server accepts echo with logprobs up to top_k"
        ) from None
    except (OSError, http.client.HTTPException) as error:  # URLError and timeouts are OSErrors
        raise BindingError(_unreachable(url, error)) from None
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict):
        raise BindingError(f"{url} did not answer with a JSON object; is url: an OpenAI-compatible API base?")
    return answer


def _unreachable(url: str, error: BaseException) -> str:
    reason = getattr(error, "reason", error)
    if isinstance(reason, TimeoutError):
        return (
            f"the openai teacher at {url} did not answer within {TIMEOUT_S:g} s; check that the server is up and "
            "not overloaded, and that url: points at it"
        )
    return (
        f"cannot reach the openai teacher at {url} ({reason}); start the server (e.g. vllm serve MODEL --port 8000) "
        "or fix the binding's url: (the API base, e.g. http://host:8000/v1)"
    )


def _error_message(error: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message"}}``, or vLLM's older flat one)."""
    try:
        body = json.loads(error.read())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return str(error.reason)
    inner = body.get("error") if isinstance(body, dict) else None
    source = inner if isinstance(inner, dict) else body if isinstance(body, dict) else {}
    return str(source.get("message", error.reason))
