"""The python tool's sandbox against hostile and broken code: each case ends in time with the right result, and this
process (the caller) stays healthy and is left with no sandbox processes behind.

These run the real sandbox, so they need user namespaces. Where the machine has none, they skip, giving
``check_sandbox``'s reason, except the test that the sandbox then refuses to run code."""

from __future__ import annotations

import ast
import asyncio
import errno
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

from actors.sandbox import runner, tool
from actors.sandbox.tool import SandboxError, SandboxLimits, ToolResult, check_sandbox, run_python

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
    "the standard library is bound read-only": (
        f"import os\nprint(bool(os.statvfs({os.path.dirname(os.__file__)!r}).f_flag & os.ST_RDONLY))",
        "True\n",
        None,
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


# Families the host opens (vsock reaches the hypervisor's transport, netlink and packet sockets the kernel's own
# surfaces), each with a type it takes, so that only the filter can refuse them with EAFNOSUPPORT
OTHER_FAMILIES = {"AF_VSOCK": (40, socket.SOCK_STREAM), "AF_NETLINK": (16, socket.SOCK_RAW),
                  "AF_PACKET": (17, socket.SOCK_DGRAM), "AF_ALG": (38, socket.SOCK_SEQPACKET)}


@needs_sandbox
@pytest.mark.parametrize("family, kind", OTHER_FAMILIES.values(), ids=OTHER_FAMILIES.keys())
async def test_only_unix_and_inet_sockets(family, kind):
    """The seccomp filter refuses every other family as a kernel without it would; unix and inet sockets open."""
    code = (
        "import socket\nfor family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):\n"
        "    socket.socket(family).close()\nsocket.socketpair()\n"
        f"try:\n    socket.socket({family}, {kind})\nexcept OSError as error:\n    print(error.errno)"
    )
    result, _ = await _run(code)
    assert result.output == f"{errno.EAFNOSUPPORT}\n", result


@needs_sandbox
async def test_io_uring_and_memfds_are_refused_in_every_process_of_the_code():
    """io_uring would run I/O the filter never sees; a memfd holds memory outside RLIMIT_AS. Both fail with ENOSYS,
    in the code's process and in a program it starts (a seccomp filter is inherited)."""
    io_uring_setup = runner.SYSCALLS[os.uname().machine]["io_uring_setup"]
    probe = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.syscall({io_uring_setup}, 1, ctypes.create_string_buffer(120)), ctypes.get_errno())\n"
        "try:\n    os.memfd_create('held')\nexcept OSError as error:\n    print(error.errno)"
    )
    code = f"import subprocess, sys\n{probe}\nsubprocess.run([sys.executable, '-c', {probe!r}])"
    result, _ = await _run(code)
    assert result.output.splitlines() == [f"-1 {errno.ENOSYS}", str(errno.ENOSYS)] * 2, result


@needs_sandbox
async def test_the_code_holds_only_stdin_stdout_and_stderr():
    """No fd of the runner's reaches the code: not the status pipe, not a setup pipe's end."""
    code = "import os\nprint(sorted(int(fd) for fd in os.listdir('/dev/fd') if os.path.lexists(f'/dev/fd/{fd}')))"
    result, _ = await _run(code)  # the listing's own fd is gone by the time each is looked at
    assert result.output == "[0, 1, 2]\n", result


@needs_sandbox
async def test_the_host_name_and_cgroup_are_the_sandboxs_own():
    """Each of the code's cgroups is the root of its namespace, whatever the caller's are."""
    code = "import os, socket\nprint(socket.gethostname(), os.uname().nodename)\n"
    code += "print(open('/proc/self/cgroup').read())"
    result, _ = await _run(code)
    names, *cgroups = filter(None, result.output.splitlines())
    assert names == "sandbox sandbox", result
    assert cgroups and [line.split(":", 2)[2] for line in cgroups] == ["/"] * len(cgroups), result


needs_cgroup = pytest.mark.skipif(tool._cgroup_home() is None, reason="no memory cgroup writable here")


@needs_sandbox
@needs_cgroup
async def test_a_calls_processes_share_its_memory_limit(monkeypatch):
    """Two processes of 100 MiB each stay under a 192 MiB RLIMIT_AS apiece, but not together: the call's cgroup
    kills one. Half as much each runs. Each call's cgroup is gone after it."""
    made, make = [], tool._make_cgroup
    monkeypatch.setattr(tool, "_make_cgroup", lambda memory: made.append(make(memory)) or made[-1])
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=192 * 2**20)
    code = (
        "import os, time\npid = os.fork()\ndata = b'x' * ({} * 2**20)\nif pid == 0:\n    time.sleep(0.5)\n"
        "    os._exit(0)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    )
    over = await run_python(code.format(100), limits)
    assert over.failure == "killed by signal 9 (Killed)" or over.output == "-9\n", over
    under = await run_python(code.format(50), limits)
    assert (under.output, under.failure) == ("0\n", None), under
    assert len(made) == 2 and not any(path is None or os.path.exists(path) for path in made), made


@needs_sandbox
async def test_a_call_runs_where_no_cgroup_can_be_made(monkeypatch):
    """A cgroup is a bound added where one can be made, never a reason for a call to fail."""
    monkeypatch.setattr(tool, "_cgroup_home", lambda: ("/proc", "v1"))  # no directory can be made there
    result, _ = await _run("print(6 * 7)")
    assert (result.output, result.failure) == ("42\n", None), result


def test_the_runner_is_a_module_of_the_standard_library_only():
    """Run by path in an isolated interpreter, it can import nothing else; and not asyncio, which every call would
    pay to import."""
    assert tool.RUNNER == runner.__file__ and Path(tool.RUNNER).is_file()
    tree = ast.parse(Path(tool.RUNNER).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) - {"asyncio"}, imported


def test_an_architecture_without_system_call_numbers_names_itself(monkeypatch):
    monkeypatch.setattr(runner, "SYSCALLS", {})
    with pytest.raises(OSError, match=f"no system call numbers known for {os.uname().machine}"):
        runner.syscall_numbers()


def test_a_missing_system_call_is_named_with_the_kernel():
    """ENOSYS is the kernel's (or a container profile's) answer, not a sign of user namespaces being off."""
    error = "[Errno 38] Function not implemented: 'pivot_root'"
    paragraph = tool._cannot_start({"errno": errno.ENOSYS, "step": "pivot_root", "error": error})
    assert f"Linux {os.uname().release}, has no pivot_root system call" in paragraph
    assert "allow pivot_root there" in paragraph and "max_user_namespaces" not in paragraph


def test_another_failed_step_is_quoted_verbatim():
    error = "[Errno 1] Operation not permitted: 'mount /tmp/proc'"
    paragraph = tool._cannot_start({"errno": errno.EPERM, "step": "mount /tmp/proc", "error": error})
    assert f"its setup failed at mount /tmp/proc: {error} (Linux {os.uname().release}" in paragraph


REFUSED_SETUP = {"errno": 1, "step": "unshare", "error": "[Errno 1] Operation not permitted: 'unshare'"}


@pytest.fixture
def refusing_runner(tmp_path, monkeypatch):
    """A runner that reports a failed setup step, as the real one does where unshare is refused."""
    refusing = tmp_path / "runner.py"
    report = b"setup " + json.dumps(REFUSED_SETUP).encode()
    refusing.write_text(f"import os, sys\nos.write(int(sys.argv[1]), {report!r})")
    monkeypatch.setattr(tool, "RUNNER", str(refusing))


async def test_a_sandbox_that_cannot_start_runs_no_code(refusing_runner):
    """The caller gets SandboxError, naming the cause and the fix, and no result."""
    with pytest.raises(SandboxError, match=r"cannot start on this machine: \[Errno 1\] .*'unshare'.*user namespaces"):
        await run_python("print(1)", LIMITS)


def test_check_sandbox_raises_the_same(refusing_runner):
    with pytest.raises(SandboxError, match="cannot start on this machine"):
        check_sandbox()


async def test_check_sandbox_works_inside_a_running_loop(refusing_runner):
    """Where an agent is built inside the generator's event loop: the check runs its own loop in a thread."""
    with pytest.raises(SandboxError, match="cannot start on this machine"):
        check_sandbox()


@needs_sandbox
async def test_check_sandbox_passes_inside_a_running_loop():
    check_sandbox()
