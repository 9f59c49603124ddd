"""The agent host: a supervisor that runs each episode's agent in a fork of itself, as a guest.

``python -m actors.agents.host`` is started by a generator (``actors.agents.task.Agents``),
fresh, never a fork of the generator's threads. It reads the agent's spec, imports the agent's module, builds its
task and (a class agent) its instance, once; then for each episode asked for it forks a child, which becomes a guest
(``actors/agents/guests.py``: a user of its own where the host is root) and runs the agent on the problem::

    generator ── start (key, endpoint, problem) ──▶ host ── fork ──▶ episode: the agent, as a guest
        ▲                JSON, length-prefixed       │ ◀── its outcome (JSON), its output (bounded) ─┘
        └──────────── ended (key, reward | failure) ─┘  kills it at timeout_s, and what it left

The host's loop never waits on one episode: every fd it reads is non-blocking, a child's end arrives as SIGCHLD, and
each episode's deadline is the loop's own timer. Whatever an agent does ends with its episode: an exit, any
exception, a hang or a spin (killed at ``timeout_s``), memory (the out-of-memory killer takes an agent first), and
every process it started, double-forked or in a session of its own: orphans come back to the episode's process
while it lives (a subreaper), then to the host, which kills every child that is not a running episode's; where
episodes have users of their own, an episode's uid is used again only once no process of it is left. What an
episode prints is kept up to ``OUTPUT_SHOWN`` bytes and counted past that. The host and its generator are not
dumpable, and an episode holds no fd of theirs: nothing an agent does reaches either, and both read only JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import math
import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from actors.agents import guests, wire
from actors.agents.endpoint import Endpoint
from actors.agents.task import AgentSpec, load_agent
from actors.tasks import Problem

_SAID = 500  # the most characters of an agent's exception that reach its failure
OUTPUT_SHOWN = 4096  # bytes of what an episode prints that reach the generator's log; the rest is counted
_OUTCOME = 3  # the fd an episode writes its outcome to
_STRAY_SCANS = 100  # at shutdown: passes over the host's children, 10 ms apart, until none is left


@dataclass
class _Episode:
    key: int
    pid: int
    outcome: int  # read ends: its outcome, and what it prints
    output: int
    deadline: float
    uid: int | None  # its guest uid; None where episodes run as the host's user
    said: bytearray = field(default_factory=bytearray)
    printed: bytearray = field(default_factory=bytearray)
    printed_total: int = 0
    stopped: str | None = None  # why the host killed it (its timeout, the generator's cancel)


class Host:
    """The supervisor's state and loop: requests in, episodes forked, each one's end told back."""

    def __init__(
        self, spec: AgentSpec, agent: Any, params: dict, isolation: guests.Isolation, requests: int, replies: int
    ):
        self.spec, self.agent, self.params, self.pid = spec, agent, params, os.getpid()
        self.requests, self.replies = requests, replies
        self.isolation = isolation
        self.users = None
        if self.isolation.own_users:
            self.users = guests.GuestUsers(self.isolation.first_uid)
            for uid in self.users.left_dirty():  # an earlier host's, which died holding them
                _clean(uid)
                self.users.give_back(uid)
        self.episodes: dict[int, _Episode] = {}  # by pid
        self.draining: set[int] = set()  # guest uids whose episode ended, back to the pool once no process has them
        self.frames = wire.Frames(wire.MAX_REQUEST)
        self.selector = selectors.DefaultSelector()
        self.wakeup, wakeup_write = os.pipe()
        for fd in (requests, self.wakeup, wakeup_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
        self.selector.register(requests, selectors.EVENT_READ, self._read_requests)
        self.selector.register(self.wakeup, selectors.EVENT_READ, self._reap)

    def serve(self) -> None:
        self._reply({"ready": {"guarantees": self.isolation.guarantees()}})
        while True:
            deadline = min((e.deadline for e in self.episodes.values() if e.stopped is None), default=None)
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            for key, _ in self.selector.select(timeout):
                key.data()
            now = time.monotonic()
            for episode in [e for e in self.episodes.values() if e.deadline <= now and e.stopped is None]:
                self._stop(episode, f"the agent did not finish within task.timeout_s ({self.spec.timeout_s:g} s)")

    # ----------------------------------------------------------------------------------------------- requests

    def _read_requests(self) -> None:
        try:
            data = os.read(self.requests, 2**16)
        except BlockingIOError:
            return
        if not data:  # the generator is gone: so are its episodes
            self._shutdown()
        for kind, value in self.frames.feed(data):
            if kind == "start":
                self._start(*wire.start_of(value))
            elif kind == "cancel":
                for episode in [e for e in self.episodes.values() if e.key == value]:
                    self._stop(episode, "the generator stopped waiting for the episode")
            elif kind == "ping":
                self._reply({"pong": value})
            else:
                raise wire.WireError(f"a request of kind {kind!r}")

    def _start(self, key: int, endpoint: Endpoint, problem: Problem) -> None:
        pipes, uid = [], None
        try:
            uid = self._guest_uid()
            pipes += os.pipe()
            pipes += os.pipe()
            outcome_read, outcome_write, output_read, output_write = pipes
            pid = os.fork()
        except (guests.GuestError, OSError) as error:  # no uid, fd or process left for it: this episode fails alone
            for fd in pipes:
                os.close(fd)
            if uid is not None:
                self.users.give_back(uid)
            failure = f"the agent's episode could not start: {error}"
            return self._reply(wire.ended_message(key, {"reward": None, "failure": failure}))
        if pid == 0:
            _episode(self, endpoint, problem, uid, outcome_write, output_write)
        os.close(outcome_write)
        os.close(output_write)
        episode = _Episode(key, pid, outcome_read, output_read, time.monotonic() + self.spec.timeout_s, uid)
        self.episodes[pid] = episode
        for fd, read in ((outcome_read, self._read_outcome), (output_read, self._read_output)):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, lambda read=read: read(episode))

    def _guest_uid(self) -> int | None:
        """A guest uid for the next episode, none of whose processes is left (None: episodes run as the host)."""
        if self.users is None:
            return None
        uid, dirty = self.users.take()
        if dirty:  # its last holder died holding it: its processes may be left
            _clean(uid)
        return uid

    # ----------------------------------------------------------------------------------------- what episodes say

    def _read_outcome(self, episode: _Episode) -> None:
        chunk = _read(episode.outcome)
        if chunk:
            episode.said += chunk[: wire.MAX_REPLY - len(episode.said)]
        elif chunk is not None:  # its end: every holder of the pipe closed it
            self._forget(episode.outcome)

    def _read_output(self, episode: _Episode) -> None:
        chunk = _read(episode.output)
        if chunk:
            episode.printed += chunk[: OUTPUT_SHOWN - len(episode.printed)]
            episode.printed_total += len(chunk)
        elif chunk is not None:
            self._forget(episode.output)

    def _forget(self, fd: int) -> None:
        if fd in self.selector.get_map():
            self.selector.unregister(fd)

    # ------------------------------------------------------------------------------------------------ endings

    def _stop(self, episode: _Episode, why: str) -> None:
        """Kill an episode's process (and its group); its end arrives as SIGCHLD."""
        episode.stopped = why
        _kill(episode.pid)

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup, 4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.episodes:
                self._finish(self.episodes.pop(pid), status)
        left = self._kill_strays()
        for uid in self.draining - left:
            self.draining.remove(uid)
            self.users.give_back(uid)

    def _finish(self, episode: _Episode, status: int) -> None:
        self._read_outcome(episode)  # what it wrote before it ended; a process it left may hold the pipe open
        self._read_output(episode)
        for fd in (episode.outcome, episode.output):
            self._forget(fd)
            os.close(fd)
        _log_output(episode)  # before its end is told: the log holds what an episode printed once it has ended
        self._reply(wire.ended_message(episode.key, _told(episode, status)))
        if episode.uid is not None:
            self.draining.add(episode.uid)

    def _kill_strays(self) -> set[int]:
        """Kill every child of the host that is no running episode's process: an orphan of an episode, come back to
        the host (a subreaper) once its episode's process ended. The uids of those killed (being reaped): once none
        is left, no process of that uid is (every one descends from its episode's process, which has ended, through
        strays), and the uid may be used again."""
        left = set()
        for pid in _children() - self.episodes.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                left.add(_uid_of(pid))
        return left

    def _shutdown(self) -> None:
        """The generator is gone: end every episode and every process they started, then exit."""
        for episode in self.episodes.values():
            _kill(episode.pid)
        self.episodes.clear()
        for _ in range(_STRAY_SCANS):
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            if not _children():
                break
            self._kill_strays()
            time.sleep(0.01)
        for uid in list(self.users.held if self.users else ()):
            _clean(uid)
            self.users.give_back(uid)
        sys.exit(0)

    def _reply(self, message: dict) -> None:
        data = wire.frame(message)
        while data:
            data = data[os.write(self.replies, data) :]


def main() -> None:
    guests.not_dumpable()
    guests.subreaper()
    requests, replies = sys.stdin.fileno(), os.dup(1)
    os.dup2(2, 1)  # whatever this process prints goes to the log, not into the replies
    try:
        host = _started(requests, replies)
    except Exception as error:  # noqa: BLE001  its own cause, told to the generator, which fails its episodes with it
        said = f"the agent host could not start: {type(error).__name__}: {_said(error)}"
        os.write(replies, wire.frame({"failed": said}))
        raise
    host.serve()


def _started(requests: int, replies: int) -> Host:
    """The host, its spec read, its isolation found and its agent loaded."""
    kind, value = _first_message(requests)
    if kind != "spec":
        raise wire.WireError(f"a first message of kind {kind!r}, not the spec")
    spec = wire.spec_of(value, AgentSpec)
    isolation = guests.isolation(sys.path)
    if isolation.own_users:  # a guest's home is its private /tmp: so too for paths its modules make as they load
        os.environ.update(guests.GUEST_HOME)
    agent, params, _ = load_agent(spec)
    _warm()
    return Host(spec, agent, params, isolation, requests, replies)


def _first_message(fd: int) -> tuple[str, Any]:
    header = _exactly(fd, wire.LENGTH.size)
    return wire.parse(_exactly(fd, wire.size_of(header, wire.MAX_REQUEST)))


def _exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the generator closed the agent host's input before its spec")
        data += chunk
    return data


def _warm() -> None:
    """Pay once, here, what each episode's fork would otherwise pay again: the OpenAI client's construction and the
    modules its routes import on first use (agents talk through it; more CPU than a short episode), and the python
    tool's survey of the host (the files its sandbox shows). The forks inherit all of it."""
    with contextlib.suppress(ImportError):
        import openai

        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="unused")
        client.chat.completions, client.completions, client.models  # noqa: B018  imported as they are first read
    from actors.sandbox.tool import host_view

    with contextlib.suppress(Exception):  # no sandbox here: an agent that runs the tool fails with its own error
        host_view()


# ------------------------------------------------------------------------------------------------ in an episode


def _episode(host: Host, endpoint: Endpoint, problem: Problem, uid: int | None, outcome: int, output: int) -> None:
    """In the fork: become a guest, run the agent and write how it ended; never returns."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)  # its group: the host ends it with every process it started and left in it
        guests.die_with_parent()
        _hold_only(outcome, output)
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adjust:
            adjust.write("1000")  # the first the out-of-memory killer takes (set as root: a guest cannot undo it)
        guests.subreaper()  # its orphans stay with it while it runs, then go to the host, which kills them
        if uid is not None:
            guests.enter_view(host.isolation.covers)
            guests.become(uid)
            guests.die_with_parent()  # again: a change of uid clears it
            os.chdir("/tmp")
        if os.getppid() != host.pid:  # the host died before it could take this process with it
            os._exit(1)
        guests.drop_capabilities()
        guests.no_new_privileges()
        guests.not_dumpable()
        if host.isolation.scoped:
            guests.scope_to_episode()
    except BaseException as error:  # noqa: BLE001  the guest could not be made: the agent never runs
        _tell({"reward": None, "failure": f"the agent's episode could not start as a guest: {_said(error)}"})
    try:
        told = _reward(asyncio.run(_call(host.agent, endpoint, problem, host.params)))
    except BaseException as error:  # noqa: BLE001  whatever it raised, SystemExit and KeyboardInterrupt included
        told = {"reward": None, "failure": f"the agent raised {type(error).__name__}: {_said(error)}"}
    _tell(told)


def _hold_only(outcome: int, output: int) -> None:
    """Keep the outcome pipe (as fd 3) and point stdout and stderr at the output pipe; nothing else of the host (its
    requests and replies, the other episodes' pipes) stays open. Stdin reads nothing."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(outcome, _OUTCOME)
    os.closerange(_OUTCOME + 1, os.sysconf("SC_OPEN_MAX"))


def _tell(told: dict) -> None:
    with contextlib.suppress(BaseException):
        os.write(_OUTCOME, json.dumps(told).encode()[: wire.MAX_REPLY])
    os._exit(0)


async def _call(agent: Any, endpoint: Endpoint, problem: Problem, params: dict) -> Any:
    if not callable(agent):
        raise TypeError(f"the agent is a {type(agent).__name__}, not an async function or a class")
    result = agent(endpoint, problem, **params)
    if not inspect.isawaitable(result):
        raise TypeError("the agent is not async: define it with async def (it returned before awaiting)")
    return await result


def _reward(result: Any) -> dict:
    """The agent's return value as a reward: None, or a finite number (a bool, a string or an object is not)."""
    if result is None:
        return {"reward": None, "failure": None}
    if isinstance(result, bool) or not isinstance(result, int | float):
        shown = repr(result)[:_SAID] if isinstance(result, str) else f"a {type(result).__name__}"  # not its own repr
        return {"reward": None, "failure": f"the agent returned {shown}, not a reward (a number) or None"}
    try:
        reward = float(result)
    except OverflowError:
        return {"reward": None, "failure": "the agent returned an integer too large for a reward"}
    if not math.isfinite(reward):
        return {"reward": None, "failure": f"the agent returned the reward {reward}, which is not finite"}
    return {"reward": reward, "failure": None}


def _said(error: BaseException) -> str:
    """What an exception says, cut short; its own ``__str__`` may raise."""
    try:
        return str(error)[:_SAID]
    except BaseException:  # noqa: BLE001
        return "(its message could not be read)"


# ------------------------------------------------------------------------------------------------ in the host


def _told(episode: _Episode, status: int) -> dict:
    """How an episode ended: why the host stopped it, else what it wrote, else how its process ended."""
    if episode.stopped is not None:
        return {"reward": None, "failure": episode.stopped}
    with contextlib.suppress(ValueError, RecursionError):  # WireError is a ValueError
        told = json.loads(episode.said) if episode.said else None
        if isinstance(told, dict) and told.keys() == {"reward", "failure"}:
            _, reward, failure = wire.ended_of({"key": 0, **told})
            return {"reward": reward, "failure": failure}
    code = os.waitstatus_to_exitcode(status)
    how = f"was killed by signal {-code}" if code < 0 else f"exited ({code})"
    return {"reward": None, "failure": f"the agent's process {how} before it returned"}


def _log_output(episode: _Episode) -> None:
    """What an episode printed, to the generator's log: its first ``OUTPUT_SHOWN`` bytes, the rest counted."""
    if not episode.printed_total:
        return
    text = episode.printed.decode(errors="replace").rstrip("\n")
    hidden = episode.printed_total - len(episode.printed)
    more = f"\n[{hidden} more bytes of its output not shown]" if hidden else ""
    print(f"agent episode {episode.key} printed:\n{text}{more}", file=sys.stderr, flush=True)


def _read(fd: int) -> bytes | None:
    """What ``fd`` holds now: bytes, b"" at its end, None when nothing is there yet."""
    try:
        return os.read(fd, 2**16)
    except BlockingIOError:
        return None
    except OSError as error:
        if error.errno == errno.EBADF:
            return b""
        raise


def _children() -> set[int]:
    """This process's children now."""
    found = set()
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{thread}/children") as children:
                found.update(map(int, children.read().split()))
    return found


def _kill(pid: int) -> None:
    """A process and every process of its group (what it started and did not move out)."""
    for target in (-pid, pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)


def _uid_of(pid: int) -> int | None:
    """The real uid of process ``pid`` (its /proc directory's owner says nothing of a process that is not dumpable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    return None


def _clean(uid: int) -> None:
    """Kill every process of the guest ``uid`` at once, from a fork that becomes the uid (root may signal anything;
    as the uid, ``kill(-1)`` reaches its processes only, and the kernel lets none fork while it does)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
