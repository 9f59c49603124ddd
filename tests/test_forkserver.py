"""The fork server (``mesh/launchers/forkserver.py``) with real processes: a forked process is the module run as
``python -m`` would run it, signals and deaths pass through its client both ways, whatever cannot be forked
faithfully starts the usual way, only the run's own processes (those that can read its token) are served, the
client connects through the directory it checked, no request can stop it, at its fd limit it sleeps, and a Monarch
proc mesh started through it runs actors and stops."""

from __future__ import annotations

import array
import dataclasses
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle
import pytest
from monarch.actor import Actor, endpoint, this_host

from mesh.launchers import fork_client
from mesh.launchers.fork_client import SOCKET, TOKEN
from mesh.launchers.forkserver import MAX_REQUEST, Preloaded, Request, main, refusal
from mesh.launchers.procs import FORK_CLIENT, FORK_SERVER_ENV, PROC_ENV, spawn_procs
from mesh.topology.plan import ProcStart

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its actor runs in procs that cannot import this file
ROOT = Path(__file__).resolve().parents[1]
PROBE = '''
import json, os, sys, time
report = {"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
          "torch_preloaded": "torch" in sys.modules, "color": os.environ.get("PROBE_COLOR")}
os.write(int(sys.argv[1]), (json.dumps(report) + "\\n").encode())
if sys.argv[2] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[3]))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server of this module's own; its processes find the probe on a PYTHONPATH entry of their own."""
    modules = tmp_path_factory.mktemp("modules")
    (modules / "probe.py").write_text(PROBE)
    directory = tmp_path_factory.mktemp("sock") / "forks"
    server_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = _serve(directory, server_env)
    env = {**server_env, **PROC_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{modules}"}
    yield str(directory), env
    process.terminate()
    process.wait(timeout=10)


def _serve(directory: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A fork server on ``directory``, once its socket is there."""
    process = subprocess.Popen([sys.executable, "-m", "mesh.launchers.forkserver", str(directory)], cwd=ROOT, env=env)
    deadline = time.monotonic() + 30
    while not (directory / SOCKET).exists() and time.monotonic() < deadline:
        assert process.poll() is None, "the fork server did not start"
        time.sleep(0.05)
    return process


def start(directory: str, env: dict[str, str], cwd: Path, *args: str):
    """The probe started through the client, as Monarch starts a process; its report comes back on a pipe."""
    read, write = os.pipe()
    command = [sys.executable, "-m", "probe", str(write), *args]
    client = subprocess.Popen(
        [sys.executable, "-S", str(FORK_CLIENT), directory, "--", *command], cwd=cwd, env=env, pass_fds=(write,)
    )
    os.close(write)
    with os.fdopen(read) as reports:
        line = reports.readline()
    return client, json.loads(line) if line else None


def test_a_forked_process_is_the_module_run_with_the_clients_arguments_directory_and_fds(server, tmp_path):
    directory, env = server
    client, report = start(directory, env, tmp_path, "exit", "3")
    assert client.wait(timeout=60) == 3  # its exit code is the client's
    assert report["torch_preloaded"] and report["pid"] != client.pid  # forked from the server, not started
    assert report["argv"][1:] == ["exit", "3"]  # and its fd (argv[0]) reached it at the same number
    assert report["cwd"] == report["path0"] == str(tmp_path)  # sys.path[0] as `python -m` puts it


def test_signals_reach_the_forked_process_and_its_death_is_the_clients(server, tmp_path):
    directory, env = server
    client, report = start(directory, env, tmp_path, "wait", "0")
    client.send_signal(signal.SIGTERM)  # Monarch stopping its process
    assert client.wait(timeout=30) == -signal.SIGTERM
    assert not _alive(report["pid"])

    client, report = start(directory, env, tmp_path, "wait", "0")
    os.kill(report["pid"], signal.SIGKILL)  # the process dies (a chaos test kills it by its own pid)
    assert client.wait(timeout=30) == -signal.SIGKILL

    client, report = start(directory, env, tmp_path, "wait", "0")
    client.kill()  # the client dies: the process must not outlive it
    client.wait(timeout=30)
    assert _gone_within(report["pid"], 10)


def test_the_process_dies_with_its_clients_parent_as_a_monarch_process_dies_with_its_host(server, tmp_path):
    directory, env = server
    read, write = os.pipe()
    client = [sys.executable, "-S", str(FORK_CLIENT), directory, "--", sys.executable, "-m", "probe", str(write)]
    host = f"import subprocess, time; subprocess.Popen({[*client, 'wait', '0']!r}, pass_fds=({write},)); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", host], cwd=tmp_path, env=env, pass_fds=(write,))
    os.close(write)
    with os.fdopen(read) as reports:
        report = json.loads(reports.readline())
    assert report["torch_preloaded"]
    parent.kill()
    parent.wait()
    assert _gone_within(report["pid"], 10)


def test_what_cannot_be_forked_faithfully_starts_the_usual_way(server, tmp_path):
    directory, env = server
    client, report = start(directory, {**env, "PROBE_COLOR": "blue"}, tmp_path, "exit", "0")
    assert client.wait(timeout=60) == 0
    assert report["color"] == "blue" and not report["torch_preloaded"]  # an environment of its own: started

    client, report = start(str(tmp_path / "no-server"), env, tmp_path, "exit", "5")
    assert client.wait(timeout=60) == 5 and not report["torch_preloaded"]  # no server: started


def test_a_process_without_the_servers_token_is_not_forked_and_the_token_is_the_users_alone(server, tmp_path):
    directory, env = server
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(f"{directory}/{TOKEN}").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"{directory}/{SOCKET}").st_mode) == 0o600
    request = json.dumps(_request(env, tmp_path)).encode()  # what a process of this user that lacks it can send
    without = {"refused": "a process without the server's token"}
    assert _ask(directory, request) == without
    assert _ask(directory, b"0" * 64 + request) == without
    assert _ask(directory, _token(directory)[:-1] + request) == without
    assert "pid" in _ask(directory, _token(directory) + request)  # the same request with the token is forked


def test_no_request_stops_the_server_nor_its_processes(server, tmp_path):
    """Hostile and broken requests in a row, from processes with the token and without: each is refused, no fd is
    left open in the server, a process forked before lives on, and a good request is forked after."""
    directory, env = server
    client, report = start(directory, env, tmp_path, "wait", "0")
    server_fds = f"/proc/{_parent(report['pid'])}/fd"
    fds_before = len(os.listdir(server_fds))
    token, good = _token(directory), _request(env, tmp_path)
    nested = [b"[" * 100_000, b'{"argv":' * 50_000, b'{"a": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"]
    broken = [b"{", b'{"argv": [', b"\xff\xfe\x00", b"null", b"1e999", b'"x"', b"[]", b"9" * 5000]
    wrong = [{**good, "env": []}, {**good, "env": {"A": 1}}, {**good, "argv": [1, "-m", "x"]}, {**good, "argv": "x"},
             {**good, "fds": [-1]}, {**good, "fds": [2**40]}, {**good, "pgid": None}, {**good, "cwd": ["/"]},
             {**good, "extra": 1}, {key: value for key, value in good.items() if key != "env"},
             {**good, "argv": [sys.executable, "-m", "probe\u0000"]}, {**good, "cwd": "/\u0000"}, {**good, "fds": [0]}]
    bodies = [*nested, *broken, *(json.dumps(request).encode() for request in wrong)]
    for body in bodies:
        for key in (b"", token):
            assert "refused" in _ask(directory, key + body), body[:40]
    assert "refused" in _ask(directory, token)  # nothing after the token
    assert "refused" in _ask(directory, token + b" " * MAX_REQUEST)  # too long: refused unread
    with open(os.devnull) as null:
        many = [null.fileno()] * 200
        assert "refused" in _ask(directory, token + json.dumps(good).encode(), fds=many)  # fds it did not name
        assert "refused" in _ask(directory, b"{", fds=many)
    for body in (token + bodies[0], token + json.dumps(wrong[0]).encode()):  # the client gone before the answer
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as gone:
            gone.connect(f"{directory}/{SOCKET}")
            gone.sendall(body)
    after, fresh = start(directory, env, tmp_path, "exit", "4")
    assert after.wait(timeout=60) == 4 and fresh["torch_preloaded"]  # forked, by the same server
    assert client.poll() is None and _alive(report["pid"])
    deadline = time.monotonic() + 10  # the last client's connection closes as the server reaps its process
    while len(os.listdir(server_fds)) != fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir(server_fds)) == fds_before
    client.kill()
    client.wait(timeout=30)


def test_the_client_connects_through_the_directory_it_checked_not_one_swapped_in_after(tmp_path, monkeypatch):
    """The race a path invites, made deterministic: right after the client checks the server's directory, its name
    is pointed (a symlink) at another directory holding a socket and a token of its own. The client still reaches
    the socket and the token of the directory it checked: it reaches both through the fd it checked, not the name.
    (What this shows is where connect and the token read go; a real race needs another user's process.)"""
    checked = _listening(tmp_path / "forks", b"c" * 64)
    swapped = _listening(tmp_path / "other", b"s" * 64)
    check = fork_client.check_alone

    def check_then_swap(fd: int, directory: str) -> None:
        check(fd, directory)
        (tmp_path / "forks").rename(tmp_path / "checked")
        (tmp_path / "forks").symlink_to(tmp_path / "other")

    monkeypatch.setattr(fork_client, "check_alone", check_then_swap)
    server, token = fork_client.connected(str(tmp_path / "forks"))
    server.close()
    assert token == b"c" * 64
    checked.settimeout(5)
    checked.accept()[0].close()  # the checked directory's socket was connected to
    swapped.setblocking(False)
    with pytest.raises(BlockingIOError):
        swapped.accept()  # the swapped-in one never was
    checked.close()
    swapped.close()


def test_the_client_refuses_a_directory_named_through_a_symlink_or_not_its_users_alone(server, tmp_path):
    directory, env = server
    (tmp_path / "link").symlink_to(directory)
    with pytest.raises(OSError):
        fork_client.connected(str(tmp_path / "link"))  # opened without following it: the link could be swapped
    client, report = start(str(tmp_path / "link"), env, tmp_path, "exit", "6")
    assert client.wait(timeout=60) == 6 and not report["torch_preloaded"]  # started the usual way, not forked
    _listening(tmp_path / "open", b"o" * 64).close()
    (tmp_path / "open").chmod(0o750)
    with pytest.raises(PermissionError, match="is not this user's alone"):
        fork_client.connected(str(tmp_path / "open"))
    if os.geteuid() == 0:  # giving it to another user needs root
        (tmp_path / "open").chmod(0o700)
        os.chown(tmp_path / "open", 65534, 65534)
        with pytest.raises(PermissionError, match="is not this user's alone"):
            fork_client.connected(str(tmp_path / "open"))


def _listening(directory: Path, token: bytes) -> socket.socket:
    """A directory laid out as a fork server's (mode 0700, its token, its socket listening), with no server."""
    directory.mkdir(mode=0o700)
    (directory / TOKEN).write_bytes(token)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(directory / SOCKET))
    listener.listen(8)
    return listener


def test_at_its_fd_limit_the_server_sleeps_while_clients_wait_and_serves_them_once_fds_free(tmp_path):
    """A server out of fds (RLIMIT_NOFILE lowered under it) with clients queued on its socket: over a second it
    takes next to no CPU time (a server that kept watching its readable socket would spin, taking all of it), the
    queued client's request waits unanswered, and once the connections it holds close it answers that request."""
    directory = tmp_path / "forks"
    process = _serve(directory)
    try:
        assert _ask(str(directory), b"{}") == {"refused": "a process without the server's token"}  # serving
        limit, free = _limit_fds(process.pid, spare=4)
        clients = [_connected(directory) for _ in range(free + 8)]  # the server accepts `free`; the rest queue
        waiting = clients[-1]
        waiting.sendall(b"{}")
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{process.pid}/fd")) < limit and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(f"/proc/{process.pid}/fd")) == limit  # every fd it may have is open
        time.sleep(0.3)  # long enough to have tried, and failed, to accept the next
        before = _cpu_seconds(process.pid)
        time.sleep(1)
        assert _cpu_seconds(process.pid) - before < 0.1
        with pytest.raises(BlockingIOError):
            waiting.recv(1 << 16, socket.MSG_DONTWAIT)  # queued, unanswered
        for client in clients[:-1]:
            client.close()
        waiting.settimeout(30)
        assert json.loads(waiting.recv(1 << 16)) == {"refused": "a process without the server's token"}
        waiting.close()
    finally:
        process.terminate()
        process.wait(timeout=30)


def _limit_fds(pid: int, spare: int) -> tuple[int, int]:
    """Lower ``pid``'s fd limit to ``spare`` fds above its highest open one: that limit, and how many fds it can
    still open (the spare ones and any unused below)."""
    time.sleep(0.2)  # the connection of a request just answered closes
    fds = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")]
    limit = max(fds) + 1 + spare
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    return limit, limit - len(fds)


def _connected(directory: Path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(str(directory / SOCKET))
    return client


def _cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has taken, user and system (/proc/PID/stat's utime and stime)."""
    with open(f"/proc/{pid}/stat") as stat_file:
        fields = stat_file.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(env: dict[str, str], cwd: Path) -> dict:
    return {"argv": [sys.executable, "-m", "probe", "2", "exit", "0"], "env": env, "cwd": str(cwd), "fds": [],
            "pgid": 0}


def _token(directory: str) -> bytes:
    return Path(directory, TOKEN).read_bytes()


def _ask(directory: str, message: bytes, fds: list[int] = ()) -> dict:
    """The server's answer to ``message`` (with ``fds``), from a socket whose send buffer takes what it is given."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asking:
        asking.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_REQUEST)
        asking.connect(f"{directory}/{SOCKET}")
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        asking.sendmsg([message], rights)
        return json.loads(asking.recv(1 << 16) or b"{}")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat_file:
        return int(stat_file.read().rpartition(")")[2].split()[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_another_users_process_is_not_forked_even_with_the_token(server):
    _, env = server
    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o777)  # a directory anyone can reach, unlike pytest's
        directory = Path(shared, "forks")
        process = _serve(directory, {**env, "PYTHONPATH": str(ROOT)})
        try:
            os.chmod(directory, 0o755)  # as if anyone could reach its socket and read its token:
            os.chmod(directory / SOCKET, 0o666)  # the server must still refuse
            os.chmod(directory / TOKEN, 0o644)
            assert _ask_as(65534, str(directory), env) == {"refused": "a process of another user (uid 65534)"}
        finally:
            process.terminate()
            process.wait(timeout=30)


def _ask_as(uid: int, directory: str, env: dict[str, str]) -> dict:
    """The server's reply to a request from a process of user ``uid`` (forked, so it runs nothing but this)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asking:
                asking.connect(f"{directory}/{SOCKET}")
                request = {"argv": [sys.executable, "-m", "probe"], "env": env, "cwd": "/", "fds": [], "pgid": 0}
                asking.sendall(_token(directory) + json.dumps(request).encode())
                os.write(write, asking.recv(1 << 16))
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read) as replies:
        return json.loads(replies.read() or "{}")


def test_a_refusal_names_what_differs(tmp_path):
    environment = {"PATH": "/bin", "HOME": "/root"}
    preloaded = Preloaded(environment, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}, (str(ROOT),), (), frozenset({"torch"}))
    request = Request([sys.executable, "-m", "probe"], dict(environment), str(ROOT), [], 0)
    assert refusal(request, preloaded) is None
    per_process = {"HYPERACTOR_MESH_BOOTSTRAP_MODE": "x", "CUDA_VISIBLE_DEVICES": "1", "SHLVL": "2", "PWD": "/"}
    with_env = lambda env: dataclasses.replace(request, env=env)  # noqa: E731
    assert refusal(with_env({**environment, **per_process, "TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}), preloaded) is None
    other = with_env({**environment, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere", "OMP_NUM_THREADS": "1"})
    assert refusal(other, preloaded) == "a different environment (OMP_NUM_THREADS, TORCHINDUCTOR_CACHE_DIR)"
    (tmp_path / "torch").mkdir()  # a PYTHONPATH entry with a torch of its own: a fresh process would import it
    request = with_env({**environment, "PYTHONPATH": str(tmp_path)})
    assert refusal(request, preloaded) == f"{tmp_path}, on one search path only, holds torch"
    another = dataclasses.replace(request, argv=["/usr/bin/python9", "-m", "probe"])
    assert "another Python" in refusal(another, preloaded)
    not_module = dataclasses.replace(request, argv=[sys.executable, "-c", "0"])
    assert "not a '-m module' command" in refusal(not_module, preloaded)


def test_a_directory_that_cannot_be_served_is_one_line_naming_it(server, tmp_path, capsys):
    directory, _ = server
    assert main([directory]) == 2  # the module's server holds it
    served = f"a fork server already serves {directory}; let runs use it, or choose another path"
    assert capsys.readouterr().err == f"error: {served}\n"
    long = str(tmp_path / ("x" * 120))
    assert main([long]) == 2
    too_long = f"{long}/{SOCKET} is longer than a unix socket's path may be; choose a shorter one"
    assert capsys.readouterr().err == f"error: {too_long}\n"
    missing = str(tmp_path / "no-such-dir" / "s")
    assert main([missing]) == 2
    assert "No such file or directory; choose a path in a directory you can write" in capsys.readouterr().err
    (tmp_path / "open").mkdir(mode=0o755)
    assert main([str(tmp_path / "open")]) == 2
    error = capsys.readouterr().err
    assert "open is not this user's alone (owner uid" in error and "mode 0755" in error and error.count("\n") == 1


def test_a_directory_left_behind_by_a_killed_server_is_served_again(tmp_path):
    directory = tmp_path / "forks"
    killed = _serve(directory)
    stale = _token(str(directory))
    killed.kill()  # leaves its socket and token
    killed.wait()
    assert (directory / SOCKET).exists()
    again = _serve(directory)
    try:
        deadline = time.monotonic() + 30
        while not _answered(directory / SOCKET) and time.monotonic() < deadline:
            assert again.poll() is None, "the second server refused the stale directory"
            time.sleep(0.05)
        assert _answered(directory / SOCKET) and _token(str(directory)) != stale
    finally:
        again.terminate()
        assert again.wait(timeout=30) == 0
    assert not directory.exists()  # a stopped server removes its socket, its token and the directory it made


class Where(Actor):
    @endpoint
    def parent(self) -> int:
        return os.getppid()


async def test_a_proc_mesh_started_through_the_session_server_runs_its_actors_and_stops(fork_server):
    procs = spawn_procs(this_host(), 2, ProcStart(((), ()), ()), os.environ[FORK_SERVER_ENV])
    try:
        parents = await procs.spawn("where", Where).parent.call()
        assert [parent for _, parent in parents.items()] == [fork_server.pid] * 2
    finally:
        await procs.stop()


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _answered(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
