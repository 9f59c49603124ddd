"""The python tool's sandbox against hostile and broken code: each case ends in time with the right result, and this
process (the caller) stays healthy and is left with no sandbox processes behind.

These run the real sandbox, so they need user namespaces. Where the machine has none, they skip, giving
``check_sandbox``'s reason, except the test that the sandbox then refuses to run code."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import pytest

from actors.environments import sandbox
from actors.environments.sandbox import SandboxError, SandboxLimits, ToolResult, check_sandbox, run_python

LIMITS = SandboxLimits(timeout_s=1.0, memory_bytes=128 * 2**20)


def _unavailable() -> str | None:
    try:
        check_sandbox()
    except SandboxError as error:
        return str(error)
    return None


UNAVAILABLE = _unavailable()
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def _sandboxed_pids() -> list[int]:
    """Processes in a PID namespace other than ours: only a sandbox makes those here."""
    ours, found = os.readlink("/proc/self/ns/pid"), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ours:
                found.append(int(pid))
        except OSError:  # gone, or not ours to look at
            pass
    return found


async def _run(code: str) -> tuple[ToolResult, float]:
    start = time.monotonic()
    result = await run_python(code, LIMITS)
    elapsed = time.monotonic() - start
    assert elapsed < LIMITS.timeout_s + 1, f"took {elapsed:.1f} s"
    assert _sandboxed_pids() == [], "the sandbox left processes behind"
    return result, elapsed


# (code, what its output starts with, a regular expression its failure matches, or None for no failure)
CASES = {
    "prints": ("print(6 * 7)", "42\n", None),
    "sees its own processes only": (
        "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getcwd(), os.listdir('.'))",
        "[1, 2] /tmp []\n",
        None,
    ),
    "busy loop": ("while True:\n    pass", "", r"timed out after 1 s"),
    "sleep": ("import time\nprint('started')\ntime.sleep(100)", "started\n", r"timed out after 1 s"),
    "allocates at once": ("x = bytearray(10**10)", "Traceback", r"exceeded its 128 MiB memory limit \(MemoryError\)"),
    "grows": (
        "x = []\nwhile True:\n    x.append(bytearray(2**20))",
        "Traceback",
        r"exceeded its 128 MiB memory limit \(MemoryError\)",
    ),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "", r"exited with 1: BlockingIOError: .*Resource"),
    "leaves a child running": (
        "import os, time\nif os.fork() == 0:\n    time.sleep(100)\nprint('done')",
        "done\n",
        None,
    ),
    "kills its parent": (  # refused where the code is nobody; where it is the trainer's uid, pid 1 ignores it
        "import contextlib, os\nwith contextlib.suppress(PermissionError):\n    os.kill(os.getppid(), 9)\nprint(1)",
        "1\n",
        None,
    ),
    "kills itself": ("import os\nos.kill(os.getpid(), 9)", "", r"killed by signal 9 \(Killed\)"),
    "huge file": (
        "open('big', 'wb').write(b'x' * 2**24)",
        "Traceback",
        r"exited with 1: OSError: \[Errno 27\] File too",
    ),
    "writes outside its directory": (
        "open('/written-by-the-sandbox', 'w')",
        "Traceback",
        r"exited with 1: OSError: \[Errno 30\] Read-only file system",
    ),
    "writes the standard library": (
        f"open({os.__file__!r}, 'a')",
        "Traceback",
        r"exited with 1: PermissionError: \[Errno 13\] Permission denied",
    ),
    "uses the standard library": (
        (
            "import sqlite3, ssl, subprocess, sys, threading\n"
            "thread = threading.Thread(target=print, args=('thread',))\nthread.start()\nthread.join()\n"
            "print(sqlite3.connect(':memory:').execute('select 6 * 7').fetchone()[0])\n"
            "print(subprocess.run([sys.executable, '-c', 'print(1 + 1)'], capture_output=True, text=True).stdout)"
        ),
        "thread\n42\n2\n\n",
        None,
    ),
    "reads stdin": ("input()", "Traceback", r"exited with 1: EOFError: EOF when reading a line"),
    "syntax error": ("print(", '  File "<python>", line 1', r"exited with 1: SyntaxError: '\(' was never closed"),
    "name error": ("x", "Traceback", r"exited with 1: NameError: name 'x' is not defined"),
    "exits 3": ("import sys\nsys.exit(3)", "", r"exited with 3$"),
}


@needs_sandbox
@pytest.mark.parametrize("code, output, failure", CASES.values(), ids=CASES.keys())
async def test_code_ends_with_the_right_result(code, output, failure):
    result, _ = await _run(code)
    assert result.output.startswith(output), result.output
    if failure is None:
        assert result.failure is None, result
    else:
        assert result.failure is not None and re.match(failure, result.failure), result


@needs_sandbox
async def test_no_network_not_even_to_this_machine():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result, _ = await _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nobody connected
            server.accept()
    assert result.failure == "exited with 1: OSError: [Errno 101] Network is unreachable", result


@needs_sandbox
async def test_output_is_cut_to_the_limit_and_says_so():
    result, _ = await _run("for _ in range(1000):\n    print('x' * 10**5)")  # 100 MB, read and dropped
    assert result.failure is None
    assert result.output == "x" * LIMITS.output_bytes + "\n[output cut at 16 KiB]"


@needs_sandbox
async def test_calls_run_at_once():
    codes = [f"import time\ntime.sleep(0.3)\nprint({i})" for i in range(8)]
    start = time.monotonic()
    results = await asyncio.gather(*(run_python(code, LIMITS) for code in codes))
    assert [result.output for result in results] == [f"{i}\n" for i in range(8)]
    assert all(result.failure is None for result in results)
    assert time.monotonic() - start < LIMITS.timeout_s + 1
    assert _sandboxed_pids() == []


@needs_sandbox
async def test_a_cancelled_call_kills_its_sandbox():
    call = asyncio.ensure_future(run_python("import time\ntime.sleep(100)", LIMITS))
    await asyncio.sleep(0.3)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert _sandboxed_pids() == []


# The host as a hostile model would probe it: each of these must fail from inside, while it works from out here.
REPO = Path(__file__).resolve().parents[1]
ANSWERS = REPO / "actors" / "tasks" / "data" / "arithmetic" / "test.jsonl"
DEVICES = ("/dev/kmsg", "/dev/console", "/dev/tty1", "/dev/kvm", "/dev/fuse", "/dev/loop0")


@pytest.fixture
def outside_tmp():
    """A directory on the host outside /tmp (the sandbox has a /tmp of its own, so a path under the host's would
    prove nothing)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else REPO) as path:
        yield Path(path)


def _probe(opens: str) -> str:
    """Code that tries ``opens`` (an expression) and prints what became of it."""
    return f"try:\n    {opens}\n    print('reached')\nexcept OSError as error:\n    print(type(error).__name__)"


@needs_sandbox
async def test_the_task_answers_are_not_there(outside_tmp):
    copy = outside_tmp / "test.jsonl"
    shutil.copy(ANSWERS, copy)
    for path in (ANSWERS, copy):
        assert path.read_text()  # readable out here
        result, _ = await _run(_probe(f"print(open({str(path)!r}).read())"))
        assert result.output == "FileNotFoundError\n", (path, result)


@needs_sandbox
async def test_no_unix_socket_of_the_host(outside_tmp):
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(outside_tmp / "daemon.sock"))
        server.listen()
        for address in (str(outside_tmp / "daemon.sock"), "/run/munge/munge.socket.2", "/run/dbus/system_bus_socket"):
            code = f"import socket\n{_probe(f'socket.socket(socket.AF_UNIX).connect({address!r})')}"
            result, _ = await _run(code)
            assert result.output == "FileNotFoundError\n", (address, result)


@needs_sandbox
async def test_no_fork_server_reachable(outside_tmp):
    """A fork server runs what it is asked to, outside any sandbox: its socket must not be nameable from inside."""
    directory = outside_tmp / "forks"
    path = directory / "socket"
    command = (sys.executable, "-m", "mesh.launchers.forkserver", str(directory))
    server = await asyncio.create_subprocess_exec(*command, cwd=REPO)
    try:
        while not path.exists():
            assert server.returncode is None, "the fork server did not start"
            await asyncio.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.connect(str(path))  # reachable out here
        connect = f"socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect({str(path)!r})"
        code = f"import socket\n{_probe(connect)}"
        result, _ = await _run(code)
        assert result.output == "FileNotFoundError\n", result
    finally:
        server.terminate()
        await server.wait()


@needs_sandbox
@pytest.mark.parametrize("device", DEVICES)
async def test_no_host_device(device):
    result, _ = await _run(f"import os\n{_probe(f'os.open({device!r}, os.O_WRONLY)')}")
    assert result.output == "FileNotFoundError\n", result


@needs_sandbox
async def test_the_root_holds_only_the_interpreter_scratch_and_devices():
    code = "import json, os\nprint(json.dumps([sorted(os.listdir(path)) for path in ('/', '/dev', '/etc')]))"
    result, _ = await _run(code)
    top, devices, etc = json.loads(result.output)
    interpreter = {sys.base_prefix, os.path.realpath(sys._base_executable), "/usr", "/lib", "/lib64"}
    assert set(top) <= {"dev", "etc", "proc", "tmp"} | {Path(path).parts[1] for path in interpreter}, top
    assert devices == ["fd", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert etc == ["ld.so.cache"]


@needs_sandbox
async def test_the_code_runs_unprivileged():
    """Inside, neither uid is root's and the code holds no capability: it can neither unmount what hides the host
    nor make itself another namespace. Out here, where the trainer is root, its processes are nobody's."""
    code = (
        "import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(os.getuid(), os.geteuid())\n"
        f"print(libc.umount2({os.path.dirname(os.__file__).encode()!r}, 2), libc.unshare(0x10000000))\n"
        "import sys\nsys.stdout.flush()\ntime.sleep(3)"
    )
    call = asyncio.ensure_future(run_python(code, SandboxLimits(timeout_s=2.0)))
    uids = await _host_uids_of_the_code(call)
    result = await call
    assert result.output.splitlines() == ["65534 65534", "-1 -1"], result
    if os.geteuid() == 0:
        assert uids == {"65534"}, uids
    else:
        assert uids == {str(os.geteuid())}, uids


async def _host_uids_of_the_code(call: asyncio.Future) -> set[str]:
    """The host uids (real, effective, saved, file system) of the sandbox's pid 2, the code's process."""
    for _ in range(100):
        await asyncio.sleep(0.02)
        for pid in _sandboxed_pids():
            with suppress(OSError):
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                if fields["NSpid"].split()[-1] == "2":
                    return set(fields["Uid"].split())
    raise AssertionError(f"no code process seen; the call ended with {call.result() if call.done() else None}")


REFUSING = "import os, sys\nos.write(int(sys.argv[1]), b'setup [Errno 1] Operation not permitted: \\'unshare\\'')"


async def test_a_sandbox_that_cannot_start_runs_no_code(monkeypatch):
    """A runner that reports a failed setup step, as the real one does where unshare is refused: the caller gets
    SandboxError, naming the cause and the fix, and no result."""
    monkeypatch.setattr(sandbox, "_RUNNER", REFUSING)
    with pytest.raises(SandboxError, match=r"cannot start on this machine: \[Errno 1\] .*'unshare'.*user namespaces"):
        await run_python("print(1)", LIMITS)


def test_check_sandbox_raises_the_same(monkeypatch):
    monkeypatch.setattr(sandbox, "_RUNNER", REFUSING)
    with pytest.raises(SandboxError, match="cannot start on this machine"):
        check_sandbox()
