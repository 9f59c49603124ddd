"""A fork server for this host's Monarch processes: the libraries every process imports, imported once.

A Monarch process spends its first seconds importing torch, transformers and a model's classes, the same in
every process of every run. A fork server imports them once and forks each process from itself; the process
then bootstraps Monarch as ``python -m monarch._src.actor.bootstrap_main`` would, in a few milliseconds::

    Monarch's host ── starts ──> fork_client.py  ── request (argv, env, cwd, its fds) ──> fork server
                                  │  forwards signals to the process              │ (torch, transformers
                                  │  exits as the process exits                   │  imported; no Monarch)
                                  └──────────── pid, then exit status <───────────┴── fork ──> the process

``MESH_FORK_SERVER`` names the server's socket; the ``local`` launcher then starts its processes through it
(``mesh/launchers/procs.py``). The test suite starts one for its whole session, as anyone running many short
local runs may: ``python -m mesh.launchers.forkserver /tmp/mesh.sock &`` and ``MESH_FORK_SERVER=/tmp/mesh.sock``.

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
import errno
import fcntl
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass

from mesh.launchers.procs import PROC_ENV

# what every process imports before its first call: torch, transformers and the tiny model's classes
PRELOAD = ("torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen2.modeling_qwen2")
# what may differ between the server's environment and a process's: set per process (SHLVL by the GPU-choosing
# shell), read after the fork
PER_PROCESS = ("HYPERACTOR_", "MONARCH_", "CUDA_VISIBLE_DEVICES", "SHLVL", "MESH_FORK_SERVER", "PYTEST_CURRENT_TEST")
SHELL = {"PWD", "OLDPWD", "_", "COLUMNS", "LINES"}  # set by shells and terminals; no library reads them at import
_PR_SET_PDEATHSIG = 1


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

    def search_path_of(self, request: dict) -> list[str]:
        """sys.path as `python -m` in the request's directory, with its PYTHONPATH, would set it."""
        return [request["cwd"], *_entries(request["env"].get("PYTHONPATH", "")), *self.base_path]


def refusal(request: dict, preloaded: Preloaded) -> str | None:
    """Why ``request`` cannot be forked from a server with ``preloaded``; None if it can."""
    argv = request["argv"]
    if len(argv) < 3 or argv[1] != "-m":
        return f"not a '-m module' command: {argv[:3]}"
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return f"another Python ({argv[0]})"
    theirs = request["env"]
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


def _shadowing(request: dict, preloaded: Preloaded) -> str | None:
    """A search-path entry that only one side has and that holds a module the server imported: a fresh process
    would import that module from elsewhere, or not at all."""
    head = [request["cwd"], *_entries(request["env"].get("PYTHONPATH", ""))]
    for entry in {*head} ^ {*preloaded.search_path}:
        try:
            names = {name.partition(".")[0] for name in os.listdir(os.path.join(request["cwd"], entry))}
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

    def __init__(self, listener: socket.socket, preloaded: Preloaded):
        self.listener, self.selector, self.preloaded = listener, selectors.DefaultSelector(), preloaded
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection
        self.told: set[str] = set()  # each reason for not forking, said once
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, self._reap)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _accept(self, listener: socket.socket) -> None:
        connection, _ = listener.accept()
        self.selector.register(connection, selectors.EVENT_READ, self._request)

    def _request(self, connection: socket.socket) -> None:
        message, fds = _receive(connection)
        self.selector.unregister(connection)
        if not message:
            return connection.close()
        try:
            request = json.loads(message)
            why = _stranger(connection) or refusal(request, self.preloaded)
            if why is None and len(fds) != len(request["fds"]):
                why = f"{len(request['fds'])} fds named, {len(fds)} received"
            pid = None if why else os.fork()
        except (ValueError, KeyError, TypeError, OSError) as error:  # a client not of this version; no memory
            request, why = None, f"cannot fork it: {error!r}"
        if why is not None:
            self._refuse(connection, fds, why)
            return None
        if pid == 0:
            self._become(request, fds, connection)
        _close_all(fds)
        self.children[pid] = connection
        connection.sendall(json.dumps({"pid": pid}).encode())
        self.selector.register(connection, selectors.EVENT_READ, self._client_gone)

    def _refuse(self, connection: socket.socket, fds: list[int], why: str) -> None:
        if why not in self.told:
            self.told.add(why)
            print(f"fork server: a process starts the usual way, not forked: {why}", file=sys.stderr, flush=True)
        _close_all(fds)
        connection.sendall(json.dumps({"refused": why}).encode())
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
            try:
                connection.sendall(json.dumps(outcome).encode())
            except OSError:
                pass  # its client is gone
            if connection.fileno() in self.selector.get_map():
                self.selector.unregister(connection)
            connection.close()

    def _become(self, request: dict, fds: list[int], connection: socket.socket) -> None:
        """In the forked child: take the client's fds, directory, environment and process group, then run the
        module as ``python -m`` would; never returns."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)  # and the signals as a fresh Python has them
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the server gone, its processes go too
            server_fds = [self.listener.fileno(), self.selector.fileno(), self.wakeup_read, connection.fileno()]
            server_fds += [theirs.fileno() for theirs in self.children.values()]
            _adopt_fds(request["fds"], fds, server_fds)
            os.chdir(request["cwd"])
            sys.path[:] = self.preloaded.search_path_of(request)
            os.environ.clear()
            os.environ.update({**self.preloaded.imported_env, **request["env"]})
            with contextlib.suppress(OSError):
                os.setpgid(0, request["pgid"])  # where Monarch signals its process's group
            code = _run_module(request["argv"][2], request["argv"][3:])
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


def _receive(connection: socket.socket) -> tuple[bytes, list[int]]:
    fds: list[int] = []
    try:
        message, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 1024))
    except OSError:
        return b"", fds
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(memoryview(data).cast("i"))
    return message, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _parser() -> argparse.ArgumentParser:
    """The command line, apart from ``main`` so that tests parse the commands the docs show."""
    parser = argparse.ArgumentParser(
        prog="python -m mesh.launchers.forkserver",
        description="Import torch and transformers once, and fork from here each process that a local run started "
        "with MESH_FORK_SERVER=SOCKET starts; serves until stopped (Ctrl-C, SIGTERM).",
    )
    parser.add_argument("socket", help="the unix socket to serve on (a path of at most 107 bytes)")
    return parser


def main(argv: list[str] | None = None) -> int:
    path = _parser().parse_args(argv).socket
    try:
        listener = _listen(path)
    except ForkServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.environ.update(PROC_ENV)  # as Monarch starts every process
    environment = dict(os.environ)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        ForkServer(listener, Preloaded.of_this_process(environment)).serve()
    except KeyboardInterrupt:
        pass
    finally:
        os.unlink(path)
    return 0


class ForkServerError(Exception):
    """The socket cannot be served: the message says why and what to do."""


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path``, where clients queue while the libraries import; a socket file that a killed
    server left behind is replaced, one that a server still answers on is not."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        try:
            listener.bind(path)
        except OSError as error:
            if error.errno != errno.EADDRINUSE or _answers(path):
                raise
            os.unlink(path)
            listener.bind(path)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise ForkServerError(f"a fork server already serves {path}; let runs use it, or choose another path")
        if "too long" in str(error):
            raise ForkServerError(f"{path} is longer than a unix socket's path may be; choose a shorter one") from None
        raise ForkServerError(f"cannot serve on {path}: {error.strerror}; choose a path in a directory you can write")
    os.chmod(path, 0o600)  # this user's processes only: whoever connects gets code run as the server's user
    listener.listen(64)
    return listener


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
