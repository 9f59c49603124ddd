"""An episode as the tokens the policy really sampled, whatever its messages re-tokenize to.

The one stitcher of every multi-turn path: an agent's requests (``actors.agents.endpoint``) and an
environment's episodes (``actors.environments.token_policy``). An agent talks to the run in OpenAI messages.
Rendering each request's messages with the chat template and tokenizing them would train on tokens the engine
never produced: a reply's text can tokenize differently from the ids sampled, most visibly
where a tokenizer merges characters across the end of the reply and the next turn's header.
So an episode keeps the token ids it has so far (``Segment``) and each request that extends
the conversation (the same messages, the reply the server gave, then new ones) adds only the
new messages' tokens after the sampled ids: the model's tokens are kept byte for byte and train
(loss mask 1); the system, user and tool tokens around them do not. A request's tokens
(``Prompt``) are recorded only with the reply sampled for them: a request refused or failed on
the way records nothing.

The new messages' tokens come from the template itself, rendered once a turn: the whole conversation with a
generation prompt begins with what the last reply's turn rendered (the conversation up to that reply), then the
reply as the template writes it, closed by the end-of-sequence token; what follows that token (``"\\n"`` in
ChatML, the new turns and the next assistant header) is tokenized alone. A template that closes a reply without
that token, or a reply whose text holds it, is rendered twice more (the conversation up to the reply, without and
with it) to find the same place. A request that
does not extend the conversation (the agent edited or dropped earlier messages, or answered
with another reply than the one it was given) starts a new segment: its own row in the batch,
counted, never stitched into wrong tokens. A tokenizer without a chat template writes a
conversation as its messages' texts, each reply closed by the end-of-sequence token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from actors.contract.rollouts import Trajectory
from actors.models.chat import has_chat_template

Message = dict[str, Any]


class TemplateError(ValueError):
    """The chat template cannot render what a request holds (a tool call, a tool result, tools)."""


@dataclass
class Segment:
    """One stitched sequence of an episode: the opening prompt, then every reply as sampled and the
    messages between them. ``messages`` is the conversation it covers, ending with the last reply."""

    prompt_ids: list[int]
    messages: list[Message]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per completion token (see ``Trajectory.versions``)
    replies: list[str] = field(default_factory=list)
    ended_with_eos: bool = True
    rendered: str = ""  # the template's text that the last reply continued (its turn's one render)
    completion: bool = False  # made by /completions requests, which extend it by its ids or the text served
    served: str | None = None  # a text-prompted completion's: its prompt's text and the replies' as served

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_context(self, ids: list[int]) -> None:
        """Tokens the model reads but did not write: they do not train."""
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [False] * len(ids)
        self.versions += self.versions[-1:] * len(ids)  # the version of the reply before them

    def add_reply(self, reply: Trajectory, message: Message, eos_id: int | None) -> None:
        """The model's reply as sampled (these train) and the message the server answered with."""
        self.completion_ids += reply.completion_ids
        self.logprobs += reply.logprobs
        self.loss_mask += [True] * len(reply.completion_ids)
        self.versions += reply.versions or []
        self.replies.append(reply.text)
        self.messages.append(message)
        self.ended_with_eos = bool(reply.completion_ids) and reply.completion_ids[-1] == eos_id

    def trajectory(self) -> Trajectory:
        """The segment as one row; ``versions`` only when every reply said which versions sampled it."""
        versions = self.versions if len(self.versions) == len(self.completion_ids) else None
        text = "\n".join(self.replies)
        return Trajectory(self.prompt_ids, self.completion_ids, self.logprobs, self.loss_mask, text, versions)


@dataclass
class Prompt:
    """The ids the next reply continues: ``extends``'s ids and ``context`` (the new messages' tokens), or a
    new segment's. Recorded only with its reply (``ChatTokens.add``), so a turn refused or failed between
    the two leaves the episode as it was."""

    ids: list[int]
    messages: list[Message]
    extends: Segment | None = None
    context: list[int] = field(default_factory=list)
    rendered: str = ""  # ``messages`` as the template writes them, with the generation prompt
    completion: bool = False  # a /completions request's
    text: str | None = None  # a /completions request's text prompt, whole


@dataclass
class ChatTokens:
    """Renders an episode's requests into token ids, keeping every sampled token; see the module docstring."""

    tokenizer: Any
    segments: list[Segment] = field(default_factory=list)
    renders: int = 0  # the chat template's renders so far: one a turn, unless the template needs the fallback

    def prompt(self, messages: list[Message], tools: list[dict] | None = None) -> Prompt:
        """What the next reply continues: the current segment extended by the new messages when
        ``messages`` extends its conversation, else a new segment. Nothing is recorded yet."""
        now = self.render(messages, tools, generation=True)  # the turn's one render
        current = self.segments[-1] if self.segments else None
        if current is not None and self._extends(current, messages):
            context = self._context(current, messages, tools, now)
            if context is not None:
                return Prompt(current.ids + context, list(messages), current, context, now)
        return Prompt(self._encode(now), list(messages), rendered=now)

    def _context(
        self, segment: Segment, messages: list[Message], tools: list[dict] | None, now: str
    ) -> list[int] | None:
        """The tokens of ``now`` (the whole conversation rendered) after the segment's last reply, closed as the
        template closes it; None when the conversation before them renders otherwise than it did (a new segment)."""
        eos = self.tokenizer.eos_token or ""
        closing = "" if segment.ended_with_eos else eos
        reply_holds_eos = eos in json.dumps(segment.messages[-1])
        if eos and not reply_holds_eos and segment.rendered and now.startswith(segment.rendered):
            end = now.find(eos, len(segment.rendered))  # the end of the reply as the template wrote it
            if end >= 0:
                return self._encode(closing + now[end + len(eos) :])
        return self._context_rendered_again(segment, messages, tools, now, closing)

    def _context_rendered_again(
        self, segment: Segment, messages: list[Message], tools: list[dict] | None, now: str, closing: str
    ) -> list[int] | None:
        """``_context`` for a template that closes a reply without the end-of-sequence token: the conversation up
        to the reply rendered without a generation prompt says where the reply ends, and ``_after_eos`` what the
        template writes after that token."""
        before = self.render(messages[: len(segment.messages)], tools, generation=False)
        if not now.startswith(before):
            return None
        return self._encode(closing + self._after_eos(segment, before, tools) + now[len(before) :])

    def continued(self, prompt: list[int] | str) -> Prompt:
        """A /completions request's prompt: the current completion segment and the prompt's new part when the
        prompt continues it (its ids and more, or the text its agent was served and more), its new text tokenized
        alone; else a new segment, its text tokenized whole. Nothing is recorded yet."""
        text = prompt if isinstance(prompt, str) else None
        messages = [{"role": "user", "content": text or ""}]
        current = self.segments[-1] if self.segments else None
        if current is not None and current.completion:
            context = None
            if text is not None and current.served is not None and text.startswith(current.served):
                context = self._encode(text[len(current.served) :])
            elif text is None and prompt[: len(current.ids)] == current.ids:
                context = list(prompt[len(current.ids) :])
            if context is not None:
                return Prompt(current.ids + context, messages, current, context, completion=True, text=text)
        ids = self._encode(text) if text is not None else list(prompt)
        return Prompt(ids, messages, completion=True, text=text)

    def add(self, prompt: Prompt, reply: Trajectory, message: Message, eos_id: int | None) -> None:
        """Records ``prompt`` and the reply sampled for it (``message``: the reply as the server gave it)."""
        segment = prompt.extends
        if segment is None:
            segment = Segment(prompt.ids, prompt.messages, completion=prompt.completion)
            self.segments.append(segment)
        else:
            segment.add_context(prompt.context)
            segment.messages = prompt.messages
        segment.add_reply(reply, message, eos_id)
        segment.rendered = prompt.rendered
        segment.served = None if prompt.text is None else prompt.text + (message.get("content") or "")

    def render(self, messages: list[Message], tools: list[dict] | None, generation: bool) -> str:
        self.renders += 1
        if not has_chat_template(self.tokenizer):
            return _plain(messages, self.tokenizer.eos_token or "")
        try:
            return self.tokenizer.apply_chat_template(
                [_for_template(m) for m in messages], tools=tools or None, tokenize=False,
                add_generation_prompt=generation,
            )
        except Exception as error:  # jinja's own errors: a template that cannot render a role or a field
            raise TemplateError(
                f"the model's chat template cannot render these messages ({type(error).__name__}: {error}); send "
                "only the roles and fields this model's template knows (system, user, assistant, and tool only "
                "where its template renders tool calls)"
            ) from None

    @property
    def split(self) -> int:
        """Segments past the first: requests that could not be stitched into the episode's sequence."""
        return max(len(self.segments) - 1, 0)

    def _extends(self, segment: Segment, messages: list[Message]) -> bool:
        """``messages`` is the segment's conversation (its reply as the server gave it) and more."""
        known = len(segment.messages)
        return len(messages) > known and all(
            same_message(a, b) for a, b in zip(messages[:known], segment.messages, strict=True)
        )

    def _after_eos(self, segment: Segment, history: str, tools: list[dict] | None) -> str:
        """What the template writes after the end-of-sequence token that closes the last reply."""
        eos = self.tokenizer.eos_token or ""
        if not has_chat_template(self.tokenizer) or not eos:
            return ""
        head = self.render(segment.messages[:-1], tools, generation=True)
        reply = history[len(head) :] if history.startswith(head) else history
        end = reply.rfind(eos)
        return reply[end + len(eos) :] if end >= 0 else ""

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids


def same_message(a: Message, b: Message) -> bool:
    """The same message whatever optional fields a client adds (``None`` values, ids of tool calls)."""
    return _essence(a) == _essence(b)


def _essence(message: Message) -> tuple:
    calls = tuple((c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in _calls(message))
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id"), message.get("name")


def _calls(message: Message) -> list[dict]:
    return [c for c in message.get("tool_calls") or [] if isinstance(c, dict) and isinstance(c.get("function"), dict)]


def _arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON: OpenAI sends a JSON string, templates read an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _for_template(message: Message) -> Message:
    """A message as Hugging Face templates read it: tool-call arguments as objects, no ``None`` fields."""
    out = {k: v for k, v in message.items() if v is not None}
    if "tool_calls" in out:
        out["tool_calls"] = [
            {"type": "function", "id": c.get("id"), "function": {"name": c["function"]["name"],
             "arguments": json.loads(_arguments(c["function"].get("arguments")))}}
            for c in _calls(message)
        ]
    return out


def _plain(messages: list[Message], eos: str) -> str:
    """A conversation without a chat template: the system prompt on its own line, each other message's
    text in order, each reply closed by EOS (``actors.models.chat.render`` for the first turn)."""
    parts = []
    for message in messages:
        text = message.get("content") or ""
        if message.get("role") == "system":
            parts.append(f"{text}\n")
        else:
            parts.append(text + (eos if message.get("role") == "assistant" else ""))
    return "".join(parts)
