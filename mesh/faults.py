"""What went wrong, in words a user can act on, and how much failure a run absorbs.

A failed actor call reaches the controller as one of Monarch's errors: an ``ActorError``
(the endpoint raised; ``.exception`` is the actor's own exception and
``.exception_formatted`` its remote traceback) or a ``SupervisionError`` (the actor or
its process is gone; the text says why, and holds the remote traceback when a
constructor raised). :func:`explain` turns either into a :class:`Cause`: one paragraph
naming the original exception, whole, and the traceback kept apart for ``error.log``.
The user never reads only "the actor ... has failed:".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TRACEBACK = "Traceback (most recent call last):"
_FRAME_NOISE = ("Traceback", "During handling", "The above exception", "File ")
# Past these a run would never end on its own: a day for one actor call (a step, a checkpoint of
# a large model), and a thousand replaced processes (a fault loop, not bad luck).
MAX_CALL_TIMEOUT_S = 86_400
MAX_RESTARTS = 1000


@dataclass(frozen=True)
class FaultTolerance:
    """The topology's ``fault_tolerance`` section: how much failure a run absorbs.

    ``max_restarts``: processes the run may replace in all (a generator, rewarder or
    teacher process that died or hung, or the trainer mesh, restarted from its last
    checkpoint); one more failure ends the run. ``call_timeout``: seconds any call to an
    actor may take before its process counts as hung and is replaced; it must exceed the
    slowest normal step (a long generation, a checkpoint of a large model).
    """

    max_restarts: int = 3
    call_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ValueError(
                f"max_restarts must be an integer in [0, {MAX_RESTARTS}] (0: never restart), got {self.max_restarts!r}"
            )
        if not math.isfinite(self.call_timeout) or not 0 < self.call_timeout <= MAX_CALL_TIMEOUT_S:
            raise ValueError(
                f"call_timeout must be a number of seconds in (0, {MAX_CALL_TIMEOUT_S}] (a day), "
                f"got {self.call_timeout!r}"
            )


@dataclass(frozen=True)
class Cause:
    """Why a call failed: ``summary`` is one paragraph (``ExceptionType: message``),
    ``traceback`` the remote traceback when one exists (it goes to ``error.log``)."""

    summary: str
    traceback: str | None = None


def explain(error: BaseException) -> Cause:
    """The original cause of a failed actor call (or of any exception)."""
    original = getattr(error, "exception", None)  # monarch's ActorError carries the actor's own exception
    if isinstance(original, BaseException):
        return Cause(_summary(original), getattr(error, "exception_formatted", None))
    return explain_report(str(error)) if str(error).strip() else Cause(type(error).__name__)


def explain_report(text: str) -> Cause:
    """The cause in a Monarch failure text (a ``SupervisionError``'s, or a ``MeshFailure.report()``)."""
    detail = text.split("have failed:", 1)[1] if "have failed:" in text else text
    if TRACEBACK in detail:  # a constructor raised: Monarch's text holds the whole remote traceback
        return Cause(_last_exception(detail), detail.strip())
    return Cause(paragraph(detail))


def paragraph(text: str) -> str:
    """``text`` on one line: runs of whitespace (newlines included) become one space."""
    return " ".join(text.split())


def _summary(error: BaseException) -> str:
    message = paragraph(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _last_exception(text: str) -> str:
    """The ``Type: message`` that ends the last traceback in ``text`` (message lines included)."""
    lines = text.splitlines()
    header = max(i for i, line in enumerate(lines) if line.strip() == TRACEBACK)
    indent = _indent(lines[header])
    for i in range(header + 1, len(lines)):
        line = lines[i]
        if line.strip() and _indent(line) == indent and not line.strip().startswith(_FRAME_NOISE):
            return paragraph(" ".join(lines[i:]))
    return paragraph(lines[-1])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def name_actor(actor: str, mesh: str, proc: int | None = None) -> str:
    """How messages name an actor: ``generator (mesh generator1, proc 0)``."""
    where = f"mesh {mesh}" + ("" if proc is None else f", proc {proc}")
    return f"{actor} ({where})"
