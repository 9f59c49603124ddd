"""Monarch's command for a process started through the fork server (``mesh/launchers/forkserver.py``).

Run as ``python -S fork_client.py DIRECTORY -- COMMAND...`` with the standard library alone, so it starts in
milliseconds. DIRECTORY is the server's, this user's alone (mode 0700): it holds the server's socket and its token,
a secret the server asks of every request, so that a process that cannot read the directory (a sandbox's, another
user's) has nothing run for it. The client hands the token, its arguments, environment, directory and open fds to
the server, which forks the process; from then on it stands in for that process: signals sent to it are passed on,
and it exits as the process exits (by the same signal, or with the same code), and it dies with its parent,
Monarch's host, as a Monarch process does (its bootstrap sets that, but a forked one's parent is the server),
taking the process with it. If the server cannot be reached or refuses, or DIRECTORY is not this user's alone
(another user's server would be handed this process's environment), it runs COMMAND itself.

DIRECTORY is opened once, not following a symlink, and checked by that fd; the socket and the token are reached
through the same fd, so a directory swapped in under its name after the check is never the one connected through.
"""

import array
import ctypes
import json
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM,
             signal.SIGCONT, signal.SIGWINCH)
# in the server's directory (mesh/launchers/forkserver.py writes them): its socket, and its token (hex, the first
# TOKEN_LENGTH bytes of every request)
SOCKET, TOKEN = "socket", "token"
TOKEN_LENGTH = 64


def open_fds(exclude: int) -> list[int]:
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    fds = []
    for fd in listed:
        try:
            os.fstat(fd)  # the directory listdir read from is closed by now
        except OSError:
            continue
        if fd != exclude:
            fds.append(fd)
    return fds


def let_go(fds: list[int]) -> None:
    """Close the fds the process now holds: an end of a pipe that only the process should hold open (Monarch's
    host watches for its process's end, and the process for its host's) must not be held open here too."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd in (0, 1, 2):
            os.dup2(null, fd)
        elif fd != null:
            os.close(fd)
    if null > 2:
        os.close(null)


def die_with_parent() -> None:
    parent = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def connected(directory: str) -> tuple[socket.socket, bytes]:
    """A connection to the server serving ``directory``, and its token; OSError where ``directory`` is a symlink,
    is not this user's alone, or has no server listening. Checked by its fd, and reached through that fd, so that
    the directory checked is the one connected through (checking the path after connecting through the path lets a
    directory swapped in between go unchecked)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        check_alone(fd, directory)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server.connect(f"/proc/self/fd/{fd}/{SOCKET}")
            return server, read_token(fd)  # read once connected: a listening server wrote it before it bound
        except OSError:
            server.close()
            raise
    finally:
        os.close(fd)


def check_alone(fd: int, directory: str) -> None:
    """PermissionError unless the directory open at ``fd`` is this user's alone: another user's server, or one that
    another user could enter, would be handed this process's environment."""
    owner = os.fstat(fd)
    if owner.st_uid != os.getuid() or owner.st_mode & 0o077:
        raise PermissionError(f"{directory} is not this user's alone")


def read_token(fd: int) -> bytes:
    """The token in the directory open at ``fd``, read from the file itself, never through a symlink."""
    token = os.open(TOKEN, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    with open(token, "rb") as file:
        return file.read(TOKEN_LENGTH)


def main() -> None:
    die_with_parent()
    split = sys.argv.index("--")
    directory, command = sys.argv[1], sys.argv[split + 1 :]
    server = None
    try:
        server, token = connected(directory)
        fds = open_fds(server.fileno())
        request = {"argv": command, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds, "pgid": os.getpgid(0)}
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        server.sendmsg([token + json.dumps(request).encode()], rights)
        reply = json.loads(server.recv(1 << 16) or b'{"refused": "the server closed"}')
    except (OSError, ValueError):
        reply = {"refused": "unreachable"}
    if "pid" not in reply:
        if server is not None:
            server.close()
        os.execv(command[0], command)
    pid = reply["pid"]
    let_go(fds)
    for number in FORWARDED:
        signal.signal(number, lambda received, _frame: os.kill(pid, received))
    outcome = json.loads(server.recv(1 << 16) or b'{"signal": 9}')
    if "signal" in outcome:  # die of it too, as Monarch would have seen the process die
        if outcome["signal"] in FORWARDED:
            signal.signal(outcome["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), outcome["signal"])
    sys.exit(outcome.get("exit", 1))


if __name__ == "__main__":
    main()
