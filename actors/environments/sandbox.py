"""A sandbox for the Python code a model writes during training (its "python" tool), so the code cannot hurt the run.

The code is untrusted. By accident or by reward hacking, it may loop forever, eat memory, fork without end, fill
the disk, use the network or signal the trainer. ``run_python`` runs each call in a fresh interpreter, ``python -I
-S``. It takes nothing from the environment or from site-packages, so the tool offers the standard library and
behaves the same on every machine. The call is bounded in three ways:

- Resource limits (setrlimit) on the code's processes: each one's address space (``memory_bytes``), CPU seconds
  (just past the wall clock), the size of one file, open files, and processes and threads together. Core dumps
  are off. The kernel exempts root from the process limit, so where the trainer runs as root the code gets
  nobody's real uid. Its effective uid stays root's, because the interpreter's own files may be readable by root
  only.
- Namespaces. The new network namespace has only a loopback, which is down, so the code has no network at all. In
  the new PID namespace the code sees only its own processes. When the sandbox's init exits, the kernel kills
  everything the code started, whatever session or group each process moved to. The mount namespace makes the
  whole file system read-only and gives the code a fresh small tmpfs at /tmp as its working directory, plus a
  /proc that lists only the sandbox's processes. The IPC namespace stops System V segments from outliving the
  call. The code runs in one more user namespace, nested inside the sandbox's. There it holds no capability over
  any of this, and it may create no other namespace.
- Time and output. The caller kills the sandbox at ``timeout_s``. Output is read as it arrives and kept up to
  ``output_bytes``, so neither a hung program nor a chatty one can stall the caller or swell its memory.

Without user namespaces (turned off by a sysctl, or by a container's seccomp profile), the sandbox cannot cut the
network. ``run_python`` then refuses to run code and raises ``SandboxError``, which names the cause.
``check_sandbox`` makes the same check when a run starts.

The sandbox bounds the code; it does not hide the machine. The code can read what the trainer can read, though it
cannot write it. Memory the kernel holds for the code, such as pipe buffers, is not counted against
``memory_bytes``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass

_TAIL = 1024  # bytes kept from the end of stderr, where a traceback names its exception
_LINE = 200  # the most characters of that line that go into ``ToolResult.failure``

# The child's program: the status pipe's fd and the limits come as arguments, the code on stdin. It becomes three
# processes. The first makes the namespaces and waits. Its child is pid 1 of the new PID namespace: it mounts the
# file system view, runs the code in a child of its own and writes that child's wait status to the status pipe.
# When pid 1 exits, the kernel kills whatever the code left. A setup step that fails writes "setup <error>"
# instead, before any code runs. The code cannot forge either message, since its process closes the pipe first.
# It is passed with -c rather than run as a module: importing asyncio would slow every call.
_RUNNER = r"""
import ctypes, os, resource, signal, sys

status, memory, cpu = map(int, sys.argv[1:])
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the handler below: the caller's SIGTERM is passed on to pid 1


def check(result, step):
    if result != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), step)


def write(path, text):
    with open(path, "w") as file:
        file.write(text)


def namespaces():
    if os.getuid() == 0:  # the kernel exempts a real uid of root from RLIMIT_NPROC
        check(libc.setresuid(65534, 0, 0), "setresuid to nobody's real uid")
    uid, gid = os.geteuid(), os.getegid()
    # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC
    check(libc.unshare(0x10000000 | 0x40000000 | 0x20000000 | 0x00020000 | 0x08000000), "unshare")
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"0 {uid} 1")
    write("/proc/self/gid_map", f"0 {gid} 1")
    for name in os.listdir("/proc/sys/user"):  # the code's own user namespace, and no other namespace below these
        if name.endswith("_namespaces"):
            write(f"/proc/sys/user/{name}", "1" if name == "max_user_namespaces" else "0")
    write("/proc/sys/kernel/shmmni", "0")  # no System V segments or queues: kernel memory outside the limits
    write("/proc/sys/kernel/msgmni", "0")


def view():
    for number in (signal.SIGINT, signal.SIGTERM):  # defaults for the code; without handlers, pid 1 ignores
        signal.signal(number, signal.SIG_DFL)  # every signal sent from inside its namespace
    check(libc.prctl(1, signal.SIGKILL), "prctl PR_SET_PDEATHSIG")  # dies with its parent, however that dies
    check(libc.prctl(4, 0), "prctl PR_SET_DUMPABLE")  # so the code cannot trace it
    read_only = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: MOUNT_ATTR_RDONLY
    check(libc.syscall(442, -100, b"/", 0x8000, read_only, 32), "mount_setattr / read-only")  # AT_RECURSIVE
    check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=16m,nr_inodes=1024"), "mount tmpfs /tmp")  # nosuid nodev
    check(libc.mount(b"proc", b"/proc", b"proc", 15, None), "mount proc /proc")  # read-only nosuid nodev noexec


def confine():
    os.setpgid(0, 0)  # out of the runner's group: the code's kill(0, ...) reaches only its own processes
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_FSIZE, 2**20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, 16)):
        resource.setrlimit(limit, (value, value))
    check(libc.unshare(0x10000000), "unshare the code's user namespace")  # drops every capability over the sandbox
    os.chdir("/tmp")


code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
try:
    namespaces()
    pid = os.fork()
    if pid:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))  # forced, from outside its namespace
        os.waitpid(pid, 0)
        os._exit(0)
    view()
    child = os.fork()
    if child:
        os.write(status, b"%d" % os.waitpid(child, 0)[1])
        os._exit(0)
    confine()
except OSError as error:
    os.write(status, f"setup {error}\n".encode())
    os._exit(1)
os.close(status)
namespace = {"__name__": "__main__"}
try:
    exec(compile(code, "<python>", "exec"), namespace)
except SystemExit:
    raise
except BaseException as error:
    namespace.clear()  # free what the code held, so that even a MemoryError can be reported
    import linecache, traceback

    linecache.cache["<python>"] = (len(code), None, code.splitlines(True), "<python>")  # show the code's lines
    traceback.print_exception(error.with_traceback(error.__traceback__.tb_next))  # without this runner's frame
    sys.exit(1)
"""


class SandboxError(RuntimeError):
    """This machine cannot run the sandbox; no code was run."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. The memory limit applies to each of the code's processes."""

    timeout_s: float = 5.0  # wall clock for the whole call
    memory_bytes: int = 256 * 2**20  # address space of each of the code's processes (RLIMIT_AS)
    output_bytes: int = 16 * 2**10  # stdout then stderr kept; the rest is cut, saying so


@dataclass(frozen=True)
class ToolResult:
    """What the model sees. ``failure`` is None when the code ran to its end (or exited 0); otherwise it is one
    short line saying how the code ended: "timed out after 5 s", "exited with 1: NameError: name 'x' is not
    defined", "killed by signal 9 (Killed)"."""

    output: str  # what the code printed, stdout then stderr, cut to the limit
    failure: str | None


@dataclass(frozen=True)
class _Stream:
    """One output stream, read to its end: its first bytes, its size and its last bytes."""

    head: bytes
    size: int
    tail: bytes


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    """Run ``code`` in a fresh sandbox (see the module docstring) and say what it printed and how it ended. Whatever
    the code does, this returns within about ``timeout_s``. It raises ``SandboxError`` only when the sandbox itself
    cannot start."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        process = await _spawn(write_end, limits)
        stdout, stderr, timed_out = await _supervise(process, code, limits)
        report = _report(read_end)
    finally:
        os.close(read_end)
    if report.startswith("setup "):
        raise SandboxError(_cannot_start(report.splitlines()[0].removeprefix("setup ")))
    return ToolResult(_output(stdout, stderr, limits.output_bytes), _failure(report, timed_out, stderr, limits))


def check_sandbox() -> None:
    """Raise ``SandboxError`` where this machine cannot run the sandbox. A run calls this at its start, so that it
    fails before training rather than at the first tool call. Call it from synchronous code; ``run_python`` raises the
    same error on its own."""
    asyncio.run(run_python("pass"))


async def _spawn(status: int, limits: SandboxLimits) -> asyncio.subprocess.Process:
    """Start the runner in a session of its own, with an empty environment and the status pipe's write end. No
    ``preexec_fn`` is used: it is unsafe in a threaded trainer, and it would force a full fork of the trainer's
    memory."""
    try:
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-I", "-S", "-u", "-c", _RUNNER),
            *(str(status), str(limits.memory_bytes), str(int(limits.timeout_s) + 2)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={},
            start_new_session=True,
            pass_fds=(status,),
        )
    finally:
        os.close(status)


async def _supervise(
    process: asyncio.subprocess.Process, code: str, limits: SandboxLimits
) -> tuple[_Stream, _Stream, bool]:
    """Feed the code in and read both streams until the runner ends or ``timeout_s`` passes; then, or if the caller
    is cancelled, end the sandbox."""
    streams = asyncio.gather(_read(process.stdout, limits.output_bytes), _read(process.stderr, limits.output_bytes))
    timed_out = False
    try:
        await asyncio.wait_for(_feed(process, code), limits.timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        if process.returncode is None:
            await _end(process)
        stdout, stderr = await streams
    return stdout, stderr, timed_out


async def _end(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the runner's group. The runner answers by SIGKILLing pid 1, and the kernel then kills every process
    the code started (SIGKILL, which none can ignore). The runner stays to reap pid 1. Killed together with the
    runner, pid 1 would be left to whatever adopts orphans, which under a trainer that is its container's pid 1
    means a zombie per timeout. If the sandbox is still there a second later (the SIGTERM came mid-start), SIGKILL
    the group."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), 1.0)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


async def _feed(process: asyncio.subprocess.Process, code: str) -> None:
    """Hand the code over on stdin, close stdin (so reads from it get end of file), and wait for the runner."""
    process.stdin.write(code.encode("utf-8", "surrogatepass"))
    with suppress(ConnectionError):  # the runner died before reading; the missing status says so
        await process.stdin.drain()
    process.stdin.close()
    await process.wait()


async def _read(stream: asyncio.StreamReader, keep: int) -> _Stream:
    """Read a stream to its end. Keep its first ``keep`` bytes and its last ``_TAIL`` bytes, and count the rest,
    so that no output is held unbounded. The stream is drained rather than left to fill, so a chatty program that
    ends in time is not reported as timed out."""
    head, size, tail = b"", 0, b""
    while chunk := await stream.read(2**16):
        size += len(chunk)
        head += chunk[: keep - len(head)]
        tail = (tail + chunk)[-_TAIL:]
    return _Stream(head, size, tail)


def _report(status: int) -> str:
    """What the runner wrote to the status pipe: empty if it was killed first. This never waits, because after the
    SIGKILL of ``_end`` pid 1 may still be exiting with its end of the pipe open (the code's process closed its copy
    at the start)."""
    try:
        return os.read(status, 4096).decode()
    except BlockingIOError:
        return ""


def _output(stdout: _Stream, stderr: _Stream, keep: int) -> str:
    text = (stdout.head + stderr.head)[:keep].decode(errors="replace")
    if stdout.size + stderr.size > keep:
        text += f"\n[output cut at {keep / 2**10:g} KiB]"
    return text


def _failure(report: str, timed_out: bool, stderr: _Stream, limits: SandboxLimits) -> str | None:
    if not report:
        return f"timed out after {limits.timeout_s:g} s" if timed_out else "the sandbox ended before the code did"
    code = os.waitstatus_to_exitcode(int(report))
    if code < 0:
        return f"killed by signal {-code} ({signal.strsignal(-code)})"
    if code == 0:
        return None
    # A traceback's last unindented line names its exception. The header is skipped because the code's other
    # processes, killed when its main one ends, may be cut off right after it.
    header = "Traceback (most recent call last):"
    lines = [line for line in stderr.tail.decode(errors="replace").splitlines() if line[:1].strip() and line != header]
    last = lines[-1][:_LINE] if lines else ""
    if last.startswith("MemoryError"):
        return f"exceeded its {limits.memory_bytes / 2**20:g} MiB memory limit (MemoryError)"
    return f"exited with {code}: {last}" if last else f"exited with {code}"


def _cannot_start(error: str) -> str:
    return (
        f"The Python sandbox cannot start on this machine: {error}. It runs each call in new user, network, PID, "
        "mount and IPC namespaces, so that model-written code has no network and cannot touch the run's files or "
        "processes; without them it runs no code rather than run code with the network. Allow unprivileged user "
        "namespaces: sysctl user.max_user_namespaces above 0, kernel.unprivileged_userns_clone=1 (Debian), "
        "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu), and in a container a seccomp profile that "
        "permits unshare and an unmasked /proc."
    )
