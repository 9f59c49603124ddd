"""The python tool's sandbox against hostile and broken code: each case ends in time with the right result, and this
process (the caller) stays healthy and is left with no sandbox processes behind.

These run the real sandbox, so they need user namespaces. Where the machine has none, they skip, giving
``check_sandbox``'s reason, except the test that the sandbox then refuses to run code."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
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
    "kills its parent": ("import os\nos.kill(os.getppid(), 9)\nprint('alive')", "alive\n", None),
    "kills itself": ("import os\nos.kill(os.getpid(), 9)", "", r"killed by signal 9 \(Killed\)"),
    "huge file": (
        "open('big', 'wb').write(b'x' * 2**24)",
        "Traceback",
        r"exited with 1: OSError: \[Errno 27\] File too",
    ),
    "writes outside its directory": (
        f"open({str(Path(__file__).parent / 'written-by-the-sandbox')!r}, 'w')",
        "Traceback",
        r"exited with 1: OSError: \[Errno 30\] Read-only file system",
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
