"""A fork server for this host's Monarch processes: the libraries every process imports, imported once.

A Monarch process spends its first seconds importing torch, transformers and a model's classes, the same in
every process of every run. A fork server imports them once and forks each process from itself; the process
then bootstraps Monarch as ``python -m monarch._src.actor.bootstrap_main`` would, in a few milliseconds::

    Monarch's host ── starts ──> fork_client.py ─ request (token, argv, env, cwd, fds) ─> fork server
                                  │  forwards signals to the process              │ (torch, transformers
                                  │  exits as the process exits                   │  imported; no Monarch)
                                  └──────────── pid, then exit status <───────────┴── fork ──> the process

``MESH_FORK_SERVER`` names the server's directory; the ``local`` launcher then starts its processes through it
(``mesh/launchers/procs.py``). The test suite starts one for its whole session, as anyone running many short
local runs may: ``python -m mesh.launchers.forkserver /tmp/mesh-forks &`` and ``MESH_FORK_SERVER=/tmp/mesh-forks``.

A fork runs code as the server's user, so the server serves only the run's own processes: its directory is its
user's alone (mode 0700) and holds the socket and a token, a random secret written there at start that every request
carries, compared in constant time; a process of another user is refused by its peer credentials as well. A process
that cannot read the directory (model code in the tool sandbox, which sees nothing of the host) has no way in. The
token stays in that file: never in an argument, an environment or a file of a run. Whatever a request holds (too
long, truncated, malformed, nested deeper than the parser goes), it is refused, and the server goes on serving. Out
of fds, it stops watching its socket until one may have freed (a connection closed, a process reaped) or a short
pause passes, so it sleeps rather than spins while its clients wait queued.

A process is forked only when the fork would be indistinguishable from a fresh start: the same Python, a
``-m module`` command, the same environment as the server's but for Monarch's per-process variables (the libraries
read theirs at import), and no search-path entry of its own that holds a module the server imported. Otherwise the
server says why, once, and the client starts the command itself. The server never imports Monarch, whose runtime
threads a fork would not carry, and forks from its one thread. Stopping it stops the processes forked from it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hmac
import importlib
import json
import os
import runpy
import secrets
import selectors
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from dataclasses import dataclass

from mesh.launchers.fork_client import SOCKET, TOKEN, TOKEN_LENGTH
from mesh.launchers.procs import PROC_ENV

# what every process imports before its first call: torch, transformers and the tiny model's classes
PRELOAD = ("torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen2.modeling_qwen2")
# what may differ between the server's environment and a process's: set per process (SHLVL by the GPU-choosing
# shell), read after the fork
PER_PROCESS = ("HYPERACTOR_", "MONARCH_", "CUDA_VISIBLE_DEVICES", "SHLVL", "MESH_FORK_SERVER", "PYTEST_CURRENT_TEST")
SHELL = {"PWD", "OLDPWD", "_", "COLUMNS", "LINES"}  # set by shells and terminals; no library reads them at import
_PR_SET_PDEATHSIG = 1
# a request's bound, checked before it is read: far above what a client sends (its environment, a few kB), and
# above what a client's socket can send at all by default (its send buffer, about 200 kB)
MAX_REQUEST = 1 << 18
MAX_FDS = 1024
MAX_SOCKET_PATH = 107  # bytes, as a unix socket's address holds them
# accept's errors that say the server (or the system) has no fd or memory left for another connection
EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE = 0.1  # seconds the listener goes unwatched after such an error, unless an fd may have freed first


@dataclass(frozen=True)
class Preloaded:
    """What a process forked from the server starts with, against which a request is compared."""

    environment: dict[str, str]  # as the server started
    imported_env: dict[str, str]  # what importing the libraries set (torch sets TORCHINDUCTOR_CACHE_DIR)
    search_path: tuple[str, ...]  # sys.path's head: the server's directory and its PYTHONPATH entries
    base_path: tuple[str, ...]  # and the rest: the standard library and site-packages
    modules: frozenset[str]  # the top-level modules imported

    @classmethod
    def of_this_process(cls, environment: dict[str, str]) -> Preloaded:
        head = (sys.path[0], *_entries(environment.get("PYTHONPATH", "")))
        return cls(
            environment,
            {key: value for key, value in os.environ.items() if key not in environment},
            head,
            tuple(entry for entry in sys.path if entry not in head),
            frozenset(name.partition(".")[0] for name in sys.modules),
        )

    def search_path_of(self, request: Request) -> list[str]:
        """sys.path as `python -m` in the request's directory, with its PYTHONPATH, would set it."""
        return [request.cwd, *_entries(request.env.get("PYTHONPATH", "")), *self.base_path]


@dataclass(frozen=True)
class Request:
    """A process to fork, as ``fork_client.py`` asks for it: its command, environment, directory, the numbers its
    fds (sent alongside) had in the client, and its process group."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]
    pgid: int

    @classmethod
    def parsed(cls, body: bytes) -> Request:
        """The request ``body`` holds; ValueError (RecursionError for one nested deeper than the parser goes) for
        anything but what the client sends."""
        fields, names = json.loads(body), [field.name for field in dataclasses.fields(cls)]
        if not isinstance(fields, dict) or sorted(fields) != sorted(names):
            raise ValueError("not the fields of a request")
        argv, env, cwd, fds, pgid = (fields[name] for name in names)
        texts = _strings(argv) and isinstance(env, dict) and _strings([*env, *env.values(), cwd])
        if not (texts and isinstance(fds, list) and all(_whole_number(number) for number in [*fds, pgid])):
            raise ValueError("a field of the wrong type")
        return cls(argv, env, cwd, fds, pgid)


def _strings(values: object) -> bool:
    """A list of strings as a process's arguments and environment hold them (no NUL)."""
    return isinstance(values, list) and all(isinstance(value, str) and "\0" not in value for value in values)


def _whole_number(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 31


def refusal(request: Request, preloaded: Preloaded) -> str | None:
    """Why ``request`` cannot be forked from a server with ``preloaded``; None if it can."""
    argv = request.argv
    if len(argv) < 3 or argv[1] != "-m":
        return f"not a '-m module' command: {argv[:3]}"
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return f"another Python ({argv[0]})"
    theirs = request.env
    changed = sorted(key for key in {*theirs, *preloaded.environment} if _differs(key, theirs, preloaded))
    if changed:
        return f"a different environment ({', '.join(changed[:5])})"
    return _shadowing(request, preloaded)


def _differs(key: str, theirs: dict[str, str], preloaded: Preloaded) -> bool:
    if key.startswith(PER_PROCESS) or key in SHELL or key == "PYTHONPATH":  # the search path is compared apart
        return False
    if key in preloaded.imported_env:  # its own imports set it as the server's did, unless it has another value
        return theirs.get(key, preloaded.imported_env[key]) != preloaded.imported_env[key]
    return theirs.get(key) != preloaded.environment.get(key)


def _shadowing(request: Request, preloaded: Preloaded) -> str | None:
    """A search-path entry that only one side has and that holds a module the server imported: a fresh process
    would import that module from elsewhere, or not at all."""
    head = [request.cwd, *_entries(request.env.get("PYTHONPATH", ""))]
    for entry in {*head} ^ {*preloaded.search_path}:
        try:
            names = {name.partition(".")[0] for name in os.listdir(os.path.join(request.cwd, entry))}
        except OSError:
            continue
        if names & preloaded.modules:
            return f"{entry}, on one search path only, holds {', '.join(sorted(names & preloaded.modules)[:3])}"
    return None


def _stranger(connection: socket.socket) -> str | None:
    """Another user's process on the socket, which must not have code run as this one's."""
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return None if uid == os.getuid() else f"a process of another user (uid {uid})"


def _entries(pythonpath: str) -> list[str]:
    return [entry for entry in pythonpath.split(os.pathsep) if entry]


class ForkServer:
    """Accepts requests on a unix socket; forks, answers the pid, later the exit status. One thread."""

    def __init__(self, served: Served, preloaded: Preloaded):
        self.served, self.selector, self.preloaded = served, selectors.DefaultSelector(), preloaded
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection
        self.told: set[str] = set()  # each reason for not forking, said once
        self.paused_until: float | None = None  # while out of fds: when the listener is watched again at the latest
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
        self.selector.register(served.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, self._reap)

    def serve(self) -> None:
        while True:
            waiting = None if self.paused_until is None else max(0.0, self.paused_until - time.monotonic())
            handled = self.selector.select(waiting)
            for key, _ in handled:
                key.data(key.fileobj)
            if self.paused_until is not None and self._may_accept(handled):
                self._resume_accepting()

    def _accept(self, listener: socket.socket) -> None:
        try:
            connection, _ = listener.accept()
        except OSError as error:  # a client gone before it was accepted, or no fd left for it until one frees
            if error.errno in EXHAUSTED:
                self._pause_accepting()
            return
        self.selector.register(connection, selectors.EVENT_READ, self._request)

    def _pause_accepting(self) -> None:
        """Stop watching the listener: with no fd left, the clients queued on it keep it readable, and watching it
        would wake the loop at once, for ever. Every other event the loop handles may free an fd (a connection
        answered and closed, a child reaped), so the listener is watched again after the next one, or after
        ACCEPT_PAUSE, whichever comes first."""
        self.selector.unregister(self.served.listener)
        self.paused_until = time.monotonic() + ACCEPT_PAUSE

    def _may_accept(self, handled: list[tuple[selectors.SelectorKey, int]]) -> bool:
        """Whether an fd may have freed since accepting failed: an event other than the listener's was handled
        (the listener's own is the failed accept), or ACCEPT_PAUSE passed."""
        others = any(key.fileobj is not self.served.listener for key, _ in handled)
        return others or time.monotonic() >= self.paused_until

    def _resume_accepting(self) -> None:
        self.selector.register(self.served.listener, selectors.EVENT_READ, self._accept)
        self.paused_until = None

    def _request(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        message, fds, cut = _receive(connection)
        if not message:
            _close_all(fds)
            return connection.close()
        try:
            request, why = self._admitted(connection, message, len(fds), cut)
        except Exception as error:  # whatever a request holds (RecursionError included), the server goes on serving
            request, why = None, f"a request it cannot read ({type(error).__name__}: {error})"
        try:
            pid = None if why else os.fork()
        except OSError as error:
            pid, why = None, f"cannot fork ({error.strerror})"
        if why is not None:
            return self._refuse(connection, fds, why)
        if pid == 0:
            self._become(request, fds, connection)
        _close_all(fds)
        self.children[pid] = connection
        _send(connection, {"pid": pid})  # if its client is gone, the process goes too (_client_gone)
        self.selector.register(connection, selectors.EVENT_READ, self._client_gone)
        return None

    def _admitted(
        self, connection: socket.socket, message: bytes, fds: int, cut: bool
    ) -> tuple[Request | None, str | None]:
        """The request ``message`` holds, and why it is not forked (None if it is). Only a whole message from a
        process of this user that holds the token is parsed at all; a body that is not a request raises."""
        if (stranger := _stranger(connection)) is not None:
            return None, stranger
        if not hmac.compare_digest(message[:TOKEN_LENGTH], self.served.token):
            return None, "a process without the server's token"
        if cut:
            return None, f"a request over {MAX_REQUEST} bytes or {MAX_FDS} fds"
        request = Request.parsed(message[TOKEN_LENGTH:])
        if fds != len(request.fds):
            return None, f"{len(request.fds)} fds named, {fds} received"
        return request, refusal(request, self.preloaded)

    def _refuse(self, connection: socket.socket, fds: list[int], why: str) -> None:
        if why not in self.told:
            self.told.add(why)
            print(f"fork server: a process starts the usual way, not forked: {why}", file=sys.stderr, flush=True)
        _close_all(fds)
        _send(connection, {"refused": why})
        connection.close()

    def _client_gone(self, connection: socket.socket) -> None:
        """The client exited (killed, say) while its process runs: the process goes with it."""
        for pid, theirs in self.children.items():
            if theirs is connection:
                os.kill(pid, signal.SIGKILL)
        self.selector.unregister(connection)

    def _reap(self, wakeup: int) -> None:
        os.read(wakeup, 4096)
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            connection = self.children.pop(pid)
            if os.WIFSIGNALED(status):
                outcome = {"signal": os.WTERMSIG(status)}
            else:
                outcome = {"exit": os.waitstatus_to_exitcode(status)}
            _send(connection, outcome)  # unless its client is gone
            if connection.fileno() in self.selector.get_map():
                self.selector.unregister(connection)
            connection.close()

    def _become(self, request: Request, fds: list[int], connection: socket.socket) -> None:
        """In the forked child: take the client's fds, directory, environment and process group, then run the
        module as ``python -m`` would; never returns."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)  # and the signals as a fresh Python has them
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the server gone, its processes go too
            server_fds = [self.served.lock, self.served.listener.fileno(), self.selector.fileno(), self.wakeup_read]
            server_fds += [connection.fileno(), *(theirs.fileno() for theirs in self.children.values())]
            _adopt_fds(request.fds, fds, server_fds)
            os.chdir(request.cwd)
            sys.path[:] = self.preloaded.search_path_of(request)
            os.environ.clear()
            os.environ.update({**self.preloaded.imported_env, **request.env})
            with contextlib.suppress(OSError):
                os.setpgid(0, request.pgid)  # where Monarch signals its process's group
            code = _run_module(request.argv[2], request.argv[3:])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module args``: its exit code; exit handlers run, the interpreter is not torn down."""
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int | None):  # as the interpreter does with sys.exit("message")
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


def _adopt_fds(targets: list[int], received: list[int], server_fds: list[int]) -> None:
    """Put each received fd at the number it had in the client, and close the server's own."""
    floor = max([*targets, *received, *server_fds]) + 1
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in received]
    _close_all([*received, *server_fds])
    for target, fd in zip(targets, parked):
        os.dup2(fd, target)
        os.close(fd)


def _receive(connection: socket.socket) -> tuple[bytes, list[int], bool]:
    """A message, the fds that came with it, and whether either was cut to its bound (MAX_REQUEST, MAX_FDS)."""
    fds: list[int] = []
    try:
        message, ancillary, flags, _ = connection.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(4 * MAX_FDS))
    except OSError:
        return b"", fds, False
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(memoryview(data[: len(data) - len(data) % 4]).cast("i"))
    return message, fds, bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))


def _send(connection: socket.socket, reply: dict) -> None:
    with contextlib.suppress(OSError):  # its client is gone
        connection.sendall(json.dumps(reply).encode())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _parser() -> argparse.ArgumentParser:
    """The command line, apart from ``main`` so that tests parse the commands the docs show."""
    parser = argparse.ArgumentParser(
        prog="python -m mesh.launchers.forkserver",
        description="Import torch and transformers once, and fork from here each process that a local run started "
        "with MESH_FORK_SERVER=DIRECTORY starts; serves until stopped (Ctrl-C, SIGTERM).",
    )
    parser.add_argument(
        "directory",
        help="the server's directory, made if new (mode 0700: this user's alone): it holds the socket and the token "
        "that only this user's processes can read",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        served = Served.claim(_parser().parse_args(argv).directory)
    except ForkServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.environ.update(PROC_ENV)  # as Monarch starts every process
    environment = dict(os.environ)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        ForkServer(served, Preloaded.of_this_process(environment)).serve()
    except KeyboardInterrupt:
        pass
    finally:
        served.remove()
    return 0


class ForkServerError(Exception):
    """The directory cannot be served: the message says why and what to do."""


@dataclass(frozen=True)
class Served:
    """The server's directory, locked for its life (so no second server takes it over), the socket listening in it
    and the token written beside it."""

    directory: str
    lock: int  # the directory's fd, which holds the lock
    listener: socket.socket
    token: bytes = dataclasses.field(repr=False)

    @classmethod
    def claim(cls, directory: str) -> Served:
        """``directory`` made (or found) this user's alone, then its token and socket, where clients queue while the
        libraries import; a socket and token that a killed server left behind are replaced."""
        socket_path = os.path.join(directory, SOCKET)
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise ForkServerError(f"{socket_path} is longer than a unix socket's path may be; choose a shorter one")
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as error:
            raise ForkServerError(
                f"cannot serve in {directory}: {error.strerror}; choose a path in a directory you can write"
            ) from None
        try:
            _hold(directory, lock)
            token = _write_token(os.path.join(directory, TOKEN))
            return cls(directory, lock, _listen(socket_path), token)
        except BaseException:
            os.close(lock)
            raise

    def remove(self) -> None:
        """The socket, the token and the directory (if nothing else is in it) go; the lock with the process."""
        for name in (SOCKET, TOKEN):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)


def _hold(directory: str, lock: int) -> None:
    """Refuse a directory that another user owns or can enter, or that a live server holds; else lock it."""
    owner = os.fstat(lock)
    if owner.st_uid != os.getuid() or owner.st_mode & 0o077:
        raise ForkServerError(
            f"{directory} is not this user's alone (owner uid {owner.st_uid}, mode {stat.S_IMODE(owner.st_mode):04o}), "
            "and whoever can enter it can have code run as this user; give a path that does not exist yet (the "
            "server makes it, mode 0700)"
        )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        served = f"a fork server already serves {directory}; let runs use it, or choose another path"
        raise ForkServerError(served) from None


def _write_token(path: str) -> bytes:
    """A fresh random token in a file of mode 0600, written before the socket is bound: a client that reaches the
    socket reads this token."""
    token = secrets.token_hex(TOKEN_LENGTH // 2).encode()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(token)
    return token


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path``, in place of one a killed server left behind."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
    except OSError as error:
        listener.close()
        raise ForkServerError(f"cannot serve on {path}: {error.strerror}; choose a path in a directory you can write")
    os.chmod(path, 0o600)  # this user's processes only, in a directory of theirs only
    listener.listen(64)
    return listener


if __name__ == "__main__":
    sys.exit(main())
