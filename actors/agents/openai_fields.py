"""Every field of OpenAI's chat and completions requests, and what the run's endpoint does with it.

An agent framework sets sampling fields on every call; a field the endpoint took and ignored would make its calls
mean something else than they say. So each field is one of:

- ``honoured``: it does what OpenAI documents (``max_tokens`` and ``stop`` reach the engine, ``seed`` fixes the
  turn's draw within its episode, ``top_logprobs`` returns the engine's values);
- ``fixed``: the run's topology sets it, because the trainer computes each token's logprob under the distribution
  the generator samples from; a request may send the topology's value (or none), another value is refused with
  the topology key to change;
- ``no effect``: bookkeeping that does not touch the reply (``user``, ``metadata``);
- ``refused``: the endpoint cannot do what it asks without changing what the trainer assumes or without
  constrained decoding, so a request that asks for it is refused; the value that asks for nothing passes.

A field that is none of these (a typo, another server's extension) is refused by name. ``docs/environments-and-
agents.md`` lists them all; a test sends each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Route = Literal["chat", "completions"]
Rule = Literal["honoured", "fixed", "no effect", "refused"]
BOTH: tuple[Route, ...] = ("chat", "completions")


class SamplingSettings(Protocol):
    """The generator's sampling settings (``actors.generator.config.Sampling``)."""

    max_new_tokens: int
    temperature: float
    top_p: float


class FieldRefused(ValueError):
    """A request field the endpoint will not take: its ``code`` and a message saying what to send instead."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Field:
    """One request field: the routes that take it, its rule, the values that ask for nothing (a refused field's),
    and why it is refused."""

    routes: tuple[Route, ...]
    rule: Rule
    asks_nothing: Callable[[Any], bool] = lambda value: value is None
    why: str = ""


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


def _zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == ""


def _text_only(value: Any) -> bool:
    return value is None or value == {"type": "text"} or value == ["text"]


DISTRIBUTION = "it changes the distribution sampled from, which the trainer's logprobs assume"
NO_CONSTRAINT = "the engine samples the policy freely (no constrained decoding), and the trainer trains what it samples"

FIELDS: dict[str, Field] = {
    "model": Field(BOTH, "honoured"),
    "messages": Field(("chat",), "honoured"),
    "prompt": Field(("completions",), "honoured"),
    "max_tokens": Field(BOTH, "honoured"),
    "max_completion_tokens": Field(("chat",), "honoured"),
    "stop": Field(BOTH, "honoured"),
    "logprobs": Field(BOTH, "honoured"),
    "top_logprobs": Field(("chat",), "honoured"),
    "seed": Field(BOTH, "honoured"),
    "stream": Field(BOTH, "honoured"),
    "stream_options": Field(BOTH, "honoured"),
    "tools": Field(("chat",), "honoured"),
    "tool_choice": Field(("chat",), "honoured"),
    "temperature": Field(BOTH, "fixed"),
    "top_p": Field(BOTH, "fixed"),
    "user": Field(BOTH, "no effect"),
    "metadata": Field(("chat",), "no effect"),
    "store": Field(("chat",), "no effect"),
    "service_tier": Field(("chat",), "no effect"),
    "safety_identifier": Field(("chat",), "no effect"),
    "prompt_cache_key": Field(("chat",), "no effect"),
    "n": Field(BOTH, "refused", _is(1), "each request is one turn of the episode with one reply: send n requests"),
    "best_of": Field(("completions",), "refused", _is(1), "each request is one turn with one reply"),
    "parallel_tool_calls": Field(
        ("chat",), "refused", _is(True), "the model may write several calls in one reply, and each is answered"
    ),
    "logit_bias": Field(BOTH, "refused", _empty, DISTRIBUTION),
    "presence_penalty": Field(BOTH, "refused", _zero, DISTRIBUTION),
    "frequency_penalty": Field(BOTH, "refused", _zero, DISTRIBUTION),
    "response_format": Field(("chat",), "refused", _text_only, NO_CONSTRAINT),
    "prediction": Field(("chat",), "refused", why="the engine has no predicted outputs"),
    "modalities": Field(("chat",), "refused", _text_only, "the policy reads and writes text only"),
    "audio": Field(("chat",), "refused", why="the policy reads and writes text only"),
    "reasoning_effort": Field(("chat",), "refused", why="the policy has no reasoning setting"),
    "verbosity": Field(("chat",), "refused", why="the policy has no verbosity setting"),
    "web_search_options": Field(("chat",), "refused", why="the endpoint has no web search"),
    "functions": Field(("chat",), "refused", why="functions is OpenAI's deprecated form of tools: send tools"),
    "function_call": Field(("chat",), "refused", why="function_call is OpenAI's deprecated form: send tool_choice"),
    "echo": Field(("completions",), "refused", _is(False), "the answer holds the reply only: keep the prompt"),
    "suffix": Field(("completions",), "refused", _empty, "the engine continues a prompt; it does not fill in"),
}
FIXED_BY = {"temperature": "actors.generator.temperature", "top_p": "actors.generator.top_p"}


def check_fields(body: dict, route: Route, sampling: SamplingSettings, greedy: bool) -> None:
    """``FieldRefused`` for the first field of ``body`` this endpoint does not do as asked (see the module
    docstring); a greedy episode's turns also take temperature 0, which is what they do."""
    for name, value in body.items():
        spec = FIELDS.get(name)
        if spec is None or route not in spec.routes:
            raise FieldRefused(
                "unknown_parameter",
                f"this endpoint does not take {name!r} on /{route.replace('chat', 'chat/completions')}: it takes "
                "OpenAI's fields, each listed in docs/environments-and-agents.md as honoured, fixed by the topology "
                "or refused; leave it out",
            )
        if spec.rule == "refused" and not spec.asks_nothing(value):
            raise FieldRefused(f"unsupported_{name}", f"{name} is refused here ({spec.why}); leave it out")
        if spec.rule == "fixed":
            _check_fixed(name, value, getattr(sampling, name), greedy)


def _check_fixed(name: str, value: Any, run: float, greedy: bool) -> None:
    if value is None or (type(value) in (int, float) and (value == run or (greedy and name == "temperature"
                                                                               and value == 0))):
        return
    raise FieldRefused(
        f"unsupported_{name}",
        f"{name} is {str(value)[:40]}, but this run samples with {name} {run:g} ({FIXED_BY[name]} in the topology): "
        f"the trainer computes each token's logprob under the distribution sampled from, so a turn cannot take "
        f"another; send {name} {run:g} or leave it out, or change {FIXED_BY[name]}",
    )
