"""What went wrong, in words a user can act on (how much failure a run absorbs: the topology's
``fault_tolerance``, ``FaultTolerance`` in ``mesh/topology/schema.py``).

A failed actor call reaches the controller as one of Monarch's errors: an ``ActorError``
(the endpoint raised; ``.exception`` is the actor's own exception and
``.exception_formatted`` its remote traceback) or a ``SupervisionError`` (the actor or
its process is gone; the text says why, and holds the remote traceback when a
constructor raised). :func:`explain` turns either into a :class:`Cause`: one paragraph
naming the original exception, whole, and the traceback kept apart for ``error.log``.
The user never reads only "the actor ... has failed:".
"""

from __future__ import annotations

from dataclasses import dataclass

TRACEBACK = "Traceback (most recent call last):"
_FRAME_NOISE = ("Traceback", "During handling", "The above exception", "File ")
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
