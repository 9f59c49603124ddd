"""``replay``: recorded teacher traces from a JSONL file, one ``{"prompt", "completion"}`` per line.

Traces are looked up by the exact prompt text; a prompt with several recorded
completions replays the first, and a prompt with none gets no trace.
"""

from __future__ import annotations

import json
from pathlib import Path

from actors.tasks import Problem
from actors.teachers.bindings import BindingConfig, BindingError, Student


class ReplayTeacher:
    needs_hint = False
    follows_policy = False

    def __init__(self, cfg: BindingConfig, student: Student):
        self.traces: dict[str, str] = {}
        path = Path(cfg.path).expanduser()
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                prompt, completion = _record(path, number, line)
                self.traces.setdefault(prompt, completion)
        if not self.traces:
            raise BindingError(f"{path} holds no traces; write one JSON object per line with prompt and completion")

    def trace(self, problems: list[Problem]) -> list[str | None]:
        return [self.traces.get(problem.prompt) for problem in problems]


def _record(path: Path, number: int, line: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
        prompt, completion = record["prompt"], record["completion"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise BindingError(
            f"{path}:{number} is not a trace: each line must be a JSON object with string keys "
            '"prompt" and "completion", e.g. {"prompt": "abc=", "completion": "cba"}'
        ) from None
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise BindingError(f"{path}:{number}: prompt and completion must be strings")
    return prompt, completion
