"""The owner-only control channel between a live run and ``python -m mesh.ctl``.

This module is named for what travels through it (commands), so that it does not read as a
part of ``controller.py``; ``ctl.py`` is its command line. The channel keeps the name of
the run directory's ``control/`` that it lives in (``ControlChannel``, ``ControlError``).

The channel is plain files in the run directory, so it needs no port, no server and no
network setup, and it works wherever the run directory is visible:

```
<run>/control/                   mode 0700: only the run's owner can enter it
  token                          mode 0600: a random secret every request must carry
  pid                            the run's process and host; removed when the run ends
  requests/<time_ns>-<id>.json   a command, written by the client (temp file + rename)
  replies/<id>.json              the run's answer to it
<run>/events.jsonl               one line per applied or rejected change, with the step it applies from
<run>/teachers.json              the bound teachers, published at start and after each change
```

**Who can send commands.** File permissions are the gate: ``control/`` is 0700 and its
token 0600, so only the user who started the run (and root) can read the token or drop
a request. The run also refuses any request whose token does not match, so a request
the current run did not authorize (one left from an earlier start of the run, or one
written after someone loosened the directory's mode without reading the token) is never
applied.

**Protocol.** The run calls ``pending()`` at step boundaries, applies each command, and
answers it with ``answer()``. A request is claimed by deleting it: the run deletes it
when it takes the command, the client when it gives up waiting (timeout, Ctrl-C), and
whichever deletes it first wins, so a command the client gave up on is never applied
later and a command the run took is never silently dropped.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from actors.basics.disk import RefusedFile, open_regular, read_regular
from mesh.records.layout import CONTROL, EVENTS, LINE_FILE_BYTES, REWRITE, ControlError, read_owner
from mesh.topology.schema import MAX_FILE_BYTES, TopologyError, check_bounded

TEACHERS = "teachers.json"
VERBS = ("bind", "unbind")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]*$")
POLL_S = 0.05


@dataclass(frozen=True)
class Command:
    """One command for the run: ``bind`` (args ``{"name", "spec"}``) or ``unbind`` (args ``{"name"}``)."""

    id: str
    verb: str
    args: dict


class _Refused(ValueError):
    """A request the run answers at once with ok=False instead of applying it."""


@dataclass(frozen=True)
class ControlChannel:
    """The run's side of the channel."""

    run_path: Path
    token: str

    @classmethod
    def create(cls, run_path: Path) -> ControlChannel:
        """Open the channel for a starting run; requests and replies of an earlier start of the run are dropped."""
        control = run_path / CONTROL
        for folder in (control, control / "requests", control / "replies"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.chmod(0o700)  # mkdir's mode is cut by the umask and ignored for a folder that exists
        for stale in [*(control / "requests").iterdir(), *(control / "replies").iterdir()]:
            stale.unlink(missing_ok=True)
        channel = cls(run_path, secrets.token_hex(16))
        _write_atomic(control / "token", channel.token + "\n", 0o600)
        _write_atomic(control / "pid", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n", 0o644)
        return channel

    @property
    def control(self) -> Path:
        return self.run_path / CONTROL

    def pending(self) -> list[Command]:
        """The commands sent since the last call, oldest first; malformed or unauthorized ones are refused here."""
        commands = []
        for path in sorted((self.control / "requests").glob("*.json")):
            text = _claim(path)
            if text is None:
                continue  # its client withdrew it
            command_id = path.stem.partition("-")[2]
            try:
                commands.append(self._parse(command_id, text))
            except _Refused as refusal:
                self._reply(command_id, False, f"refused: {refusal}; nothing changed", None)
        return commands

    def answer(self, command: Command, ok: bool, message: str, step: int) -> None:
        """Record the outcome: ``step`` is the first step whose data the change affects (for ``ok=False``, the
        step it would have applied from). The event is written before the reply, so a client that has its reply
        finds the event already in ``events.jsonl``."""
        event = {"step": step, "time": time.time(), "verb": command.verb, "name": command.args["name"]}
        if command.verb == "bind":
            event["spec"] = command.args["spec"]
        event |= {"status": "applied" if ok else "rejected", "message": message}
        with (self.run_path / EVENTS).open("a") as f:
            f.write(json.dumps(event) + "\n")
        self._reply(command.id, ok, message, step)

    def write_teachers(self, view: dict[str, dict]) -> None:
        """Write the bound teachers (name -> {"spec", "bound_at_step", ...}) for ``mesh.ctl teachers list``, which
        reads them from the file so it works during and after the run, without a round trip to it."""
        _write_atomic(self.run_path / TEACHERS, json.dumps(view, indent=2) + "\n", 0o644)

    def close(self) -> None:
        """The run has ended: clients are told so at once instead of waiting for a reply that will not come."""
        (self.control / "pid").unlink(missing_ok=True)

    def _parse(self, command_id: str, text: bytes) -> Command:
        if len(text) > MAX_FILE_BYTES:
            raise _Refused(
                f"the request is larger than {MAX_FILE_BYTES // 1000} kB; send commands with python -m mesh.ctl"
            )
        try:
            request = json.loads(text)
            check_bounded(request, "the request")  # the limits of a topology file (mesh/topology/schema.py)
        except TopologyError as error:
            raise _Refused(f"{error}; send commands with python -m mesh.ctl") from None
        except (ValueError, RecursionError) as error:
            raise _Refused(f"the request is not JSON ({error}); send commands with python -m mesh.ctl") from None
        if not isinstance(request, dict):
            raise _Refused("the request is not a JSON object; send commands with python -m mesh.ctl")
        token = str(request.get("token", "")).encode()
        if not hmac.compare_digest(token, self.token.encode()):
            raise _Refused(
                "the request's token does not match this run's control/token (was it written for an earlier start "
                "of the run?)"
            )
        verb, args = request.get("verb"), request.get("args")
        _check_command(verb, args)
        return Command(command_id, verb, args)

    def _reply(self, command_id: str, ok: bool, message: str, step: int | None) -> None:
        reply = {"id": command_id, "ok": ok, "message": message, "step": step}
        _write_atomic(self.control / "replies" / f"{command_id}.json", json.dumps(reply) + "\n", 0o600)


def _check_command(verb: object, args: object) -> None:
    if verb not in VERBS:
        raise _Refused(f"unknown verb {verb!r}; the run accepts {list(VERBS)}")
    if not isinstance(args, dict) or not isinstance(args.get("name"), str) or not NAME_PATTERN.match(args["name"]):
        raise _Refused(f"a {verb} command needs args.name matching {NAME_PATTERN.pattern}, got {args!r}")
    if verb == "bind" and not isinstance(args.get("spec"), dict):
        raise _Refused(f"a bind command needs args.spec as a mapping, got {args.get('spec')!r}")


def send(run_path: str | Path, verb: str, args: dict, timeout: float = 120.0) -> dict:
    """Send a command to the live run in ``run_path`` and wait for its reply ``{"id", "ok", "message", "step"}``.

    Raises ``ControlError`` if the command cannot be delivered or is not answered within ``timeout`` seconds; a
    command that is not delivered (timeout, Ctrl-C, the run ended) is withdrawn, so it is never applied later.
    """
    run_path = Path(run_path)
    token = _read_token(run_path)
    _check_live(run_path)
    command_id = uuid.uuid4().hex
    request = run_path / CONTROL / "requests" / f"{time.time_ns():020d}-{command_id}.json"
    _write_atomic(request, json.dumps({"id": command_id, "verb": verb, "args": args, "token": token}), 0o600)
    try:
        return _await_reply(run_path, request, command_id, timeout)
    finally:
        request.unlink(missing_ok=True)  # already claimed by the run, unless we are giving up


def read_teachers(run_path: str | Path) -> dict[str, dict]:
    """The teachers the run last published (name -> {"spec", "bound_at_step", ...}); works after the run ended."""
    run_path = Path(run_path)
    _check_run_dir(run_path)
    path = run_path / TEACHERS
    try:
        teachers = json.loads(read_regular(path, MAX_FILE_BYTES))
    except FileNotFoundError:
        raise ControlError(
            f"{run_path} has no {TEACHERS}: the run has not started its teachers yet, or it was started before "
            "mesh.ctl existed. Wait for the run to start, or look up its teachers in its topology.yaml "
            "(actors.teachers.bindings)."
        ) from None
    except (OSError, ValueError, RecursionError) as error:
        teachers = error
    if not isinstance(teachers, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("spec"), dict) for entry in teachers.values()
    ):
        why = f" ({teachers})" if isinstance(teachers, Exception) else ""
        raise ControlError(
            f"{path} is not the run's record of its teachers{why}: it was edited or damaged. The run rewrites it at "
            "its next change of teachers; until then its topology.yaml (actors.teachers.bindings) names them."
        )
    return teachers


def _await_reply(run_path: Path, request: Path, command_id: str, timeout: float) -> dict:
    reply_path = run_path / CONTROL / "replies" / f"{command_id}.json"
    deadline = time.monotonic() + timeout
    while True:
        ended = _ended(run_path)  # looked at before the reply: a run that answers and then ends is not called dead
        reply = _claim(reply_path)
        if reply is not None:
            return _reply_of(reply_path, reply)
        if ended:
            raise ControlError(ended)
        if time.monotonic() > deadline:
            raise ControlError(_unanswered(run_path, request, timeout))
        time.sleep(POLL_S)


def _reply_of(path: Path, data: bytes) -> dict:
    """The run's reply ``{"id", "ok", "message", "step"}`` read from ``path``, or a ControlError if it is not one."""
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        reply = None
    if not (isinstance(reply, dict) and isinstance(reply.get("ok"), bool) and isinstance(reply.get("message"), str)):
        raise ControlError(
            f"the reply in {path} is not the run's (a JSON object with ok and message), so whether the command was "
            f"applied is unknown; see {path.parent.parent.parent / EVENTS} or python -m mesh.ctl "
            f"{path.parent.parent.parent} teachers list"
        )
    return reply


def _unanswered(run_path: Path, request: Path, timeout: float) -> str:
    if _claim(request) is not None:
        return (
            f"the run did not pick up the command within {timeout:g} s, so it was withdrawn and nothing changed. "
            "The run applies commands at step boundaries: is a step very long? (see time/step in "
            f"{run_path / 'metrics.jsonl'}). Retry with a larger --timeout."
        )
    return (
        f"the run took the command but did not answer within {timeout:g} s (building a binding loads its model, "
        "which can take a while). It will still be applied or rejected: see "
        f"{run_path / EVENTS} or python -m mesh.ctl {run_path} teachers list."
    )


def _check_run_dir(run_path: Path) -> None:
    if not run_path.is_dir():
        raise ControlError(
            f"{run_path} is not a run directory (no such directory). Give the directory python -m mesh.run printed "
            "as 'run directory: ...', e.g. runs/tiny-20261121-101500."
        )


def _read_token(run_path: Path) -> str:
    try:
        _check_run_dir(run_path)
        return read_regular(run_path / CONTROL / "token", LINE_FILE_BYTES).decode(errors="replace").strip()
    except PermissionError:
        raise ControlError(
            f"permission denied reading {run_path / CONTROL / 'token'}: only the run's owner can send commands "
            "(control/ is mode 0700 and its token 0600). Run mesh.ctl as the user who started the run."
        ) from None
    except FileNotFoundError:
        raise ControlError(
            f"{run_path} has no {CONTROL}/ channel: the run was started before mesh.ctl existed, or this is not a "
            "run directory. Only a run started by a current python -m mesh.run can change its teachers while it "
            "trains; restart it from its last checkpoint to get one."
        ) from None
    except RefusedFile as error:
        token = run_path / CONTROL / "token"
        raise ControlError(f"cannot read {token}: {error}, which a run never writes there; {REWRITE}") from None


def _check_live(run_path: Path) -> None:
    ended = _ended(run_path)
    if ended:
        raise ControlError(ended)


def _ended(run_path: Path) -> str | None:
    """Why the run in ``run_path`` is no longer running, or None if it is (or may be: another host's run)."""
    owner = read_owner(run_path)
    if owner is None:
        return (
            f"the run in {run_path} has ended ({CONTROL}/pid is gone), so there is nothing to change. Start it again "
            "(its teachers are in actors.teachers.bindings of the topology) to train with other teachers."
        )
    if not owner.here or owner.alive:
        return None  # another host's processes are not ours to see: the reply, or the timeout, will tell
    return (
        f"the run in {run_path} has ended: its process {owner.pid} is gone (it stopped without closing the "
        "channel, e.g. it was killed or crashed), so there is nothing to change. Start it again to train with "
        "other teachers."
    )


def _claim(path: Path) -> bytes | None:
    """Read (at most one byte past a topology file's limit) and delete ``path``; None if it is gone
    (another party claimed it first). Deleting is the claim."""
    try:
        with open_regular(path) as file:
            data = file.read(MAX_FILE_BYTES + 1)
        path.unlink()
    except FileNotFoundError:
        return None
    except RefusedFile:  # a pipe or a link, which no party of the channel writes: dropped, never waited on
        path.unlink(missing_ok=True)
        return None
    return data


def _write_atomic(path: Path, text: str, mode: int) -> None:
    """Readers see the whole old file or the whole new one, never part of one; ``mode`` holds from the first byte."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        f.write(text)
    os.replace(temp, path)
