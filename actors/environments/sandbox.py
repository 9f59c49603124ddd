"""A sandbox for the Python code a model writes during training (its "python" tool): the code gets compute and a
scratch directory, nothing else of the machine.

The code is untrusted. By accident or by reward hacking, it may loop forever, eat memory, fork without end, fill
the disk, use the network, signal the trainer, read the task's answers or talk to a daemon on the host.
``run_python`` runs each call in a fresh interpreter, ``python -I -S``. It takes nothing from the environment or
from site-packages, so the tool offers the standard library and behaves the same on every machine. The call is
bounded in four ways:

- What it sees. The code's root is a small tmpfs made for the call, holding nothing of the host but what the
  interpreter needs, each at its host path and read-only: the interpreter, its standard library (site-packages
  hidden), the shared libraries they load, and the loader's cache. Around them: a fresh tmpfs at /tmp, its working
  directory; a /dev of null, zero, random and urandom; a /proc of the sandbox's own processes. No host /etc, /home,
  /run, /var, /work or checkout is there, so no file of the run's, no answer file and no unix socket of the host
  (a fork server's, munge's, D-Bus's) can be named, read or connected to: a network namespace cuts TCP, and only a
  root that does not contain a socket hides it.
- Who it is. The code runs unprivileged: where the trainer runs as root, as nobody (uid and gid 65534 on the host),
  with no supplementary groups; elsewhere as the trainer's own uid. Either way it runs in one more user namespace,
  nested inside the sandbox's, where it holds no capability over any of the sandbox's mounts or namespaces, may
  create no other namespace and gains no privilege by exec.
- Namespaces. The new network namespace has only a loopback, which is down, so the code has no network at all. In
  the new PID namespace the code sees only its own processes. When the sandbox's init exits, the kernel kills
  everything the code started, whatever session or group each process moved to. The IPC namespace stops System V
  segments from outliving the call.
- Resources, time and output. Resource limits (setrlimit) on the code's processes: each one's address space
  (``memory_bytes``), CPU seconds (just past the wall clock), the size of one file, open files, and processes and
  threads together (counted in the code's own user namespace). Core dumps are off. The caller kills the sandbox at
  ``timeout_s``. Output is read as it arrives and kept up to ``output_bytes``, so neither a hung program nor a
  chatty one can stall the caller or swell its memory.

Without user namespaces (turned off by a sysctl, or by a container's seccomp profile), the sandbox cannot build its
root or cut the network. ``run_python`` then refuses to run code and raises ``SandboxError``, which names the cause;
``check_sandbox`` makes the same check up front. Memory the kernel holds for the code, such as pipe buffers, is not
counted against ``memory_bytes``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

_TAIL = 1024  # bytes kept from the end of stderr, where a traceback names its exception
_LINE = 200  # the most characters of that line that go into ``ToolResult.failure``

# The child's program: the status pipe's fd, the limits and what of the host its root shows come as arguments, the
# code on stdin. It becomes four processes. The first stays outside: it forks the second into new namespaces and
# maps the second's ids from outside, since only there may it map more than its own uid (nobody's, for the code).
# The second waits. Its child is pid 1 of the new PID namespace: it builds the root, runs the code in a child of its
# own and writes that child's wait status to the status pipe. When pid 1 exits, the kernel kills whatever the code
# left. A setup step that fails writes "setup <error>" instead, before any code runs. The code cannot forge either
# message, since its process closes the pipe first. It is passed with -c rather than run as a module: importing
# asyncio would slow every call.
_RUNNER = r"""
import ctypes, json, os, resource, signal, sys

status, memory, cpu = map(int, sys.argv[1:4])
host = json.loads(sys.argv[4])  # [kind, path, (target)]: each host path the root shows, in the order to make them
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the handler below: the caller's SIGTERM is passed on to pid 1
NOBODY = 65534  # the host uid and gid the code runs as where the trainer is root
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)  # the syscall's number; glibc has no wrapper
ROOT = "/tmp"  # where pid 1 builds the new root, in its own mount namespace, before it moves in
NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 2, 4, 8, 32, 4096, 16384, 1 << 18
RDONLY_ATTRS = 1 | 2 | 4  # struct mount_attr's MOUNT_ATTR_RDONLY | NOSUID | NODEV


def check(result, step):
    if result != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), step)


def write(path, text):
    with open(path, "w") as file:
        file.write(text)


def setup_failed(error):
    os.write(status, f"setup {error}\n".encode())
    os._exit(1)


def namespaces():
    # returns in the second process, in its namespaces; the first waits for it and exits as it does
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready[0])
        os.close(go[1])
        # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC
        check(libc.unshare(0x10000000 | 0x40000000 | 0x20000000 | 0x00020000 | 0x08000000), "unshare")
        os.write(ready[1], b"1")
        if os.read(go[0], 1) != b"1":  # the first process could not map our ids, and said why
            os._exit(1)
        for name in os.listdir("/proc/sys/user"):  # the code's own user namespace, and no other namespace below it
            if name.endswith("_namespaces"):
                write(f"/proc/sys/user/{name}", "1" if name == "max_user_namespaces" else "0")
        write("/proc/sys/kernel/shmmni", "0")  # no System V segments or queues: kernel memory outside the limits
        write("/proc/sys/kernel/msgmni", "0")
        return
    os.close(ready[1])
    os.close(go[0])
    if os.read(ready[0], 1) == b"1":  # otherwise the second failed to unshare, and said why
        try:
            map_ids(pid)
        except OSError as error:
            os.kill(pid, signal.SIGKILL)
            setup_failed(error)
        os.write(go[1], b"1")
    os.waitpid(pid, 0)
    os._exit(0)


def map_ids(pid):
    # uid 0 inside is the trainer's own uid, so pid 1 can read what it binds; where that is root, uid 1 inside is
    # nobody's, and the code becomes it
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        write(f"/proc/{pid}/uid_map", f"0 0 1\n1 {NOBODY} 1")
        write(f"/proc/{pid}/gid_map", f"0 {gid} 1\n1 {NOBODY} 1")
    else:
        write(f"/proc/{pid}/setgroups", "deny")
        write(f"/proc/{pid}/uid_map", f"0 {uid} 1")
        write(f"/proc/{pid}/gid_map", f"0 {gid} 1")


def mount(source, target, kind, flags, options=None):
    check(libc.mount(source, target.encode(), kind, flags, options), f"mount {target}")


def read_only(path, attrs=RDONLY_ATTRS):
    attr = (ctypes.c_uint64 * 4)(attrs, 0, 0, 0)  # struct mount_attr, set
    check(libc.syscall(442, -100, path.encode(), 0x100, attr, 32), f"mount_setattr {path}")  # AT_SYMLINK_NOFOLLOW


def show(kind, path, target=None):
    inside = ROOT + path
    if kind == "dir":
        os.makedirs(inside, exist_ok=True)
    elif kind == "link":
        if not os.path.lexists(inside):
            os.symlink(target, inside)
    elif kind == "cover":  # a directory inside a bound one, hidden under an empty mount (site-packages)
        mount(b"tmpfs", inside, b"tmpfs", 1 | NOSUID | NODEV | NOEXEC, b"size=4k,nr_inodes=1")
    else:  # bind: the host's file or directory at its own path, read-only
        if os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
        else:
            os.close(os.open(inside, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(path.encode(), inside, None, BIND)
        read_only(inside)


def devices():
    os.mkdir(ROOT + "/dev")
    mount(b"tmpfs", ROOT + "/dev", b"tmpfs", NOSUID | NOEXEC, b"size=4k,nr_inodes=16,mode=0755")
    for name in ("null", "zero", "random", "urandom"):
        os.close(os.open(f"{ROOT}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        mount(f"/dev/{name}".encode(), f"{ROOT}/dev/{name}", None, BIND)
        read_only(f"{ROOT}/dev/{name}", 1 | 2)  # read-only and nosuid; still writable, as a device node is
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{ROOT}/dev/{name}")
    read_only(ROOT + "/dev", 1 | 2)


def view():
    for number in (signal.SIGINT, signal.SIGTERM):  # defaults for the code; without handlers, pid 1 ignores
        signal.signal(number, signal.SIG_DFL)  # every signal sent from inside its namespace
    check(libc.prctl(1, signal.SIGKILL), "prctl PR_SET_PDEATHSIG")  # dies with its parent, however that dies
    check(libc.prctl(4, 0), "prctl PR_SET_DUMPABLE")  # so the code cannot trace it
    os.umask(0o022)
    mount(None, "/", None, REC | PRIVATE)  # nothing done here reaches the host's mounts
    mount(b"tmpfs", ROOT, b"tmpfs", NOSUID | NODEV, b"size=1m,nr_inodes=4096,mode=0755")
    for entry in host:
        show(*entry)
    devices()
    for name in ("proc", "tmp"):
        os.mkdir(f"{ROOT}/{name}")
    mount(b"proc", ROOT + "/proc", b"proc", 1 | NOSUID | NODEV | NOEXEC)
    mount(b"tmpfs", ROOT + "/tmp", b"tmpfs", NOSUID | NODEV, b"size=16m,nr_inodes=1024,mode=1777")
    read_only(ROOT)
    if PIVOT_ROOT is None:
        raise OSError(38, f"no pivot_root system call number known for {os.uname().machine}", "pivot_root")
    os.chdir(ROOT)  # pivot_root(".", "."), then detach the old root stacked on the new one
    check(libc.syscall(PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "detach the host's root")  # MNT_DETACH
    os.chdir("/")


def confine():
    os.setpgid(0, 0)  # out of the runner's group: the code's kill(0, ...) reaches only its own processes
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_FSIZE, 2**20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, 16)):
        resource.setrlimit(limit, (value, value))
    if len(open("/proc/self/uid_map").read().splitlines()) > 1:  # nobody's uid is mapped: become it
        os.setgroups([])
        os.setresgid(1, 1, 1)
        os.setresuid(1, 1, 1)
    check(libc.prctl(38, 1, 0, 0, 0), "prctl PR_SET_NO_NEW_PRIVS")
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
    setup_failed(error)
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
    """Raise ``SandboxError`` where this machine cannot run the sandbox. Call it where a tool is set up (an agent
    module's import, say), so that such a machine fails before training rather than at the first tool call. Call it from synchronous code; ``run_python`` raises the
    same error on its own."""
    asyncio.run(run_python("pass"))


async def _spawn(status: int, limits: SandboxLimits) -> asyncio.subprocess.Process:
    """Start the runner in a session of its own, with an empty environment and the status pipe's write end. No
    ``preexec_fn`` is used: it is unsafe in a threaded trainer, and it would force a full fork of the trainer's
    memory."""
    try:
        interpreter, view = await asyncio.to_thread(host_view)  # the first call runs ldd: not on the event loop
        return await asyncio.create_subprocess_exec(
            *(interpreter, "-I", "-S", "-u", "-c", _RUNNER),
            *(str(status), str(limits.memory_bytes), str(int(limits.timeout_s) + 2), view),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={},
            start_new_session=True,
            pass_fds=(status,),
        )
    finally:
        os.close(status)


@functools.cache
def host_view() -> tuple[str, str]:
    """The interpreter the sandbox runs (a virtual environment's base: the sandbox takes nothing from
    site-packages) and, as the runner's JSON argument, what of the host its root shows: that interpreter, its
    standard library with site-packages hidden, the shared libraries they load and the loader's cache, each reached
    through the same symlinks as on the host. Worked out once per process."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    search = subprocess.run([interpreter, "-I", "-S", "-c", "import sys; print(*sys.path, sep=chr(10))"],
                            check=False, capture_output=True, text=True, env={})
    if search.returncode != 0:
        raise SandboxError(f"The Python sandbox cannot start its interpreter {interpreter}: {search.stderr.strip()}")
    search_path = search.stdout.split("\n")
    library_dirs = [path for path in search_path if os.path.isdir(path)]
    modules = sorted(str(path) for directory in library_dirs for path in Path(directory).glob("*.so"))
    shown = [interpreter, *library_dirs, *_shared_libraries([interpreter, *modules])]
    if os.path.exists("/etc/ld.so.cache"):  # so the loader finds a module's libraries where it found them here
        shown.append("/etc/ld.so.cache")
    binds = _outermost(os.path.realpath(path) for path in shown)
    hidden = [Path(directory) / name for directory in binds for name in ("site-packages", "dist-packages")]
    covers = [["cover", str(path)] for path in hidden if path.is_dir()]
    view = [entry for path in shown for entry in _route(path)
            if not _inside(entry[1], binds, strictly=entry[0] != "dir")]  # made by a bind, or bound itself
    return interpreter, json.dumps(_unique(view) + covers)


def _shared_libraries(files: list[str]) -> list[str]:
    """Every shared library the dynamic loader would load for ``files`` (ldd's answer), and libgcc_s, which glibc
    loads only when a thread exits or unwinds."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxError(
            "The Python sandbox cannot find the shared libraries its interpreter loads: ldd is not installed (it "
            "comes with the C library: Debian's libc-bin, Alpine's musl-utils). The sandbox shows the code only what "
            "the interpreter needs, so it must know those files. Install ldd and start the run again."
        )
    listing = subprocess.run([ldd, *files], check=False, capture_output=True, text=True, env={}).stdout
    libraries = sorted(set(re.findall(r"^\s+(?:\S+ => )?(/\S+) \(0x", listing, re.MULTILINE)))
    for library in libraries:
        if Path(library).name.startswith("libc.so"):
            gcc_s = Path(os.path.realpath(library)).with_name("libgcc_s.so.1")
            if gcc_s.exists():
                libraries.append(str(gcc_s))
    return libraries


def _route(path: str) -> list[list[str]]:
    """How ``path`` is reached on the host, as the runner rebuilds it: each symlink on the way (``link``), each
    directory (``dir``), then the file or directory it names (``bind``)."""
    route, parts, here = [], [part for part in path.split("/") if part], "/"
    for _ in range(64):  # symlinks followed at most; the kernel's own limit is 40
        if not parts:
            return route
        part = parts.pop(0)
        if part in (".", ".."):
            here = here if part == "." else os.path.dirname(here)
            continue
        step = os.path.join(here, part)
        if os.path.islink(step):
            target = os.readlink(step)
            route.append(["link", step, target])
            parts = [part for part in target.split("/") if part] + parts
            here = "/" if target.startswith("/") else here
            continue
        if _inside(step, ("/tmp", "/dev", "/proc"), strictly=False):
            raise SandboxError(
                f"The Python sandbox cannot show the code {path}: it lies under {step}, where the sandbox mounts its "
                "own /tmp, /dev or /proc. Run the trainer with a Python installed outside /tmp, /dev and /proc."
            )
        route.append(["dir", step] if parts else ["bind", step])
        here = step
    raise SandboxError(f"The Python sandbox cannot show the code {path}: too many symlinks on the way to it.")


def _outermost(paths) -> list[str]:
    """The paths not inside another of them."""
    unique = sorted(set(paths))
    return [path for path in unique if not _inside(path, unique, strictly=True)]


def _inside(path: str, directories, strictly: bool) -> bool:
    return any((path != directory or not strictly) and (path + "/").startswith(directory.rstrip("/") + "/")
               for directory in directories)


def _unique(entries: list[list[str]]) -> list[list[str]]:
    seen, kept = set(), []
    for entry in entries:
        if entry[1] not in seen:
            seen.add(entry[1])
            kept.append(entry)
    return kept


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
        "mount and IPC namespaces, so that model-written code has no network and sees no file, socket or process of "
        "the host; without them it runs no code rather than run code that can reach the machine. Allow unprivileged user "
        "namespaces: sysctl user.max_user_namespaces above 0, kernel.unprivileged_userns_clone=1 (Debian), "
        "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu), and in a container a seccomp profile that "
        "permits unshare and an unmasked /proc."
    )
