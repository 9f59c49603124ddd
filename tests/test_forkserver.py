"""The fork server (``mesh/launchers/forkserver.py``) with real processes: a forked process is the module run as
``python -m`` would run it, signals and deaths pass through its client both ways, whatever cannot be forked
faithfully starts the usual way, and a Monarch proc mesh started through it runs actors and stops."""

from __future__ import annotations

import json
import os
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

from mesh.launchers.forkserver import Preloaded, main, refusal
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
    socket_path = tmp_path_factory.mktemp("sock") / "s"
    server_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mesh.launchers.forkserver", str(socket_path)]
    process = subprocess.Popen(command, cwd=ROOT, env=server_env)
    env = {**server_env, **PROC_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{modules}"}
    deadline = time.monotonic() + 30
    while not socket_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield str(socket_path), env
    process.terminate()
    process.wait(timeout=10)


def start(socket_path: str, env: dict[str, str], cwd: Path, *args: str):
    """The probe started through the client, as Monarch starts a process; its report comes back on a pipe."""
    read, write = os.pipe()
    command = [sys.executable, "-m", "probe", str(write), *args]
    client = subprocess.Popen(
        [sys.executable, "-S", str(FORK_CLIENT), socket_path, "--", *command], cwd=cwd, env=env, pass_fds=(write,)
    )
    os.close(write)
    with os.fdopen(read) as reports:
        line = reports.readline()
    return client, json.loads(line) if line else None


def test_a_forked_process_is_the_module_run_with_the_clients_arguments_directory_and_fds(server, tmp_path):
    socket_path, env = server
    client, report = start(socket_path, env, tmp_path, "exit", "3")
    assert client.wait(timeout=60) == 3  # its exit code is the client's
    assert report["torch_preloaded"] and report["pid"] != client.pid  # forked from the server, not started
    assert report["argv"][1:] == ["exit", "3"]  # and its fd (argv[0]) reached it at the same number
    assert report["cwd"] == report["path0"] == str(tmp_path)  # sys.path[0] as `python -m` puts it


def test_signals_reach_the_forked_process_and_its_death_is_the_clients(server, tmp_path):
    socket_path, env = server
    client, report = start(socket_path, env, tmp_path, "wait", "0")
    client.send_signal(signal.SIGTERM)  # Monarch stopping its process
    assert client.wait(timeout=30) == -signal.SIGTERM
    assert not _alive(report["pid"])

    client, report = start(socket_path, env, tmp_path, "wait", "0")
    os.kill(report["pid"], signal.SIGKILL)  # the process dies (a chaos test kills it by its own pid)
    assert client.wait(timeout=30) == -signal.SIGKILL

    client, report = start(socket_path, env, tmp_path, "wait", "0")
    client.kill()  # the client dies: the process must not outlive it
    client.wait(timeout=30)
    assert _gone_within(report["pid"], 10)


def test_the_process_dies_with_its_clients_parent_as_a_monarch_process_dies_with_its_host(server, tmp_path):
    socket_path, env = server
    read, write = os.pipe()
    client = [sys.executable, "-S", str(FORK_CLIENT), socket_path, "--", sys.executable, "-m", "probe", str(write)]
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
    socket_path, env = server
    client, report = start(socket_path, {**env, "PROBE_COLOR": "blue"}, tmp_path, "exit", "0")
    assert client.wait(timeout=60) == 0
    assert report["color"] == "blue" and not report["torch_preloaded"]  # an environment of its own: started

    client, report = start(str(tmp_path / "no-server"), env, tmp_path, "exit", "5")
    assert client.wait(timeout=60) == 5 and not report["torch_preloaded"]  # no server: started


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_another_users_process_is_not_forked_and_the_socket_is_the_owners_alone(server):
    _, env = server
    with tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o777)  # a directory anyone can reach, unlike pytest's
        socket_path = f"{shared}/s"
        command = [sys.executable, "-m", "mesh.launchers.forkserver", socket_path]
        process = subprocess.Popen(command, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(socket_path) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
            os.chmod(socket_path, 0o666)  # as if anyone could reach it: the server must still refuse
            assert _ask_as(65534, socket_path, env) == {"refused": "a process of another user (uid 65534)"}
        finally:
            process.terminate()
            process.wait(timeout=30)


def _ask_as(uid: int, socket_path: str, env: dict[str, str]) -> dict:
    """The server's reply to a request from a process of user ``uid`` (forked, so it runs nothing but this)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asking:
                asking.connect(socket_path)
                request = {"argv": [sys.executable, "-m", "probe"], "env": env, "cwd": "/", "fds": [], "pgid": 0}
                asking.sendall(json.dumps(request).encode())
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
    request = {"argv": [sys.executable, "-m", "probe"], "env": dict(environment), "cwd": str(ROOT)}
    assert refusal(request, preloaded) is None
    per_process = {"HYPERACTOR_MESH_BOOTSTRAP_MODE": "x", "CUDA_VISIBLE_DEVICES": "1", "SHLVL": "2", "PWD": "/"}
    request["env"] = {**environment, **per_process, "TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}  # as torch set it
    assert refusal(request, preloaded) is None
    request["env"] = {**environment, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere", "OMP_NUM_THREADS": "1"}
    assert refusal(request, preloaded) == "a different environment (OMP_NUM_THREADS, TORCHINDUCTOR_CACHE_DIR)"
    (tmp_path / "torch").mkdir()  # a PYTHONPATH entry with a torch of its own: a fresh process would import it
    request["env"] = {**environment, "PYTHONPATH": str(tmp_path)}
    assert refusal(request, preloaded) == f"{tmp_path}, on one search path only, holds torch"
    assert "another Python" in refusal({**request, "argv": ["/usr/bin/python9", "-m", "probe"]}, preloaded)
    assert "not a '-m module' command" in refusal({**request, "argv": [sys.executable, "-c", "0"]}, preloaded)


def test_a_socket_path_that_cannot_be_served_is_one_line_naming_it(server, tmp_path, capsys):
    socket_path, _ = server
    assert main([socket_path]) == 2  # the module's server answers there
    served = f"a fork server already serves {socket_path}; let runs use it, or choose another path"
    assert capsys.readouterr().err == f"error: {served}\n"
    long = str(tmp_path / ("x" * 120))
    assert main([long]) == 2
    too_long = f"{long} is longer than a unix socket's path may be; choose a shorter one"
    assert capsys.readouterr().err == f"error: {too_long}\n"
    missing = str(tmp_path / "no-such-dir" / "s")
    assert main([missing]) == 2
    assert "No such file or directory; choose a path in a directory you can write" in capsys.readouterr().err


def test_a_socket_left_behind_by_a_killed_server_is_served_again(tmp_path):
    path = tmp_path / "s"
    killed = subprocess.Popen([sys.executable, "-m", "mesh.launchers.forkserver", str(path)], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.kill()  # leaves its socket file
    killed.wait()
    assert path.exists()
    again = subprocess.Popen([sys.executable, "-m", "mesh.launchers.forkserver", str(path)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not _answered(path) and time.monotonic() < deadline:
            assert again.poll() is None, "the second server refused the stale socket"
            time.sleep(0.05)
        assert _answered(path)
    finally:
        again.terminate()
        assert again.wait(timeout=30) == 0
    assert not path.exists()  # a stopped server removes its socket


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
