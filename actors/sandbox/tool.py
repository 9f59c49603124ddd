"""A sandbox for the Python code a model writes during training (its "python" tool): the code gets compute and a
scratch directory, nothing else of the machine.

The code is untrusted. By accident or by reward hacking, it may loop forever, eat memory, fork without end, fill
the disk, use the network, signal the trainer, read the task's answers, talk to a daemon on the host or probe the
kernel. ``run_python`` runs each call in a fresh interpreter, ``python -I -S``. It takes nothing from the environment
or from site-packages, so the tool offers the standard library and behaves the same on every machine. The sandbox is
built by a program of its own, ``runner.py`` beside this module, which that interpreter runs by path. The
call is bounded in five ways:

- What it sees. The code's root is a small tmpfs made for the call, holding nothing of the host but what the
  interpreter needs, each at its host path and read-only: the interpreter, its standard library (site-packages
  hidden), the shared libraries they load, and the loader's cache. Around them: a fresh tmpfs at /tmp, its working
  directory; a /dev of null, zero, random and urandom; a /proc of the sandbox's own processes. No host /etc, /home,
  /run, /var, /work or checkout is there, so no file of the run's, no answer file and no unix socket of the host
  (a fork server's, munge's, D-Bus's) can be named, read or connected to: a network namespace cuts TCP, and only a
  root that does not contain a socket hides it. The code's process holds no fd but stdin, stdout and stderr.
- Who it is. The code runs unprivileged: where the trainer runs as root, as nobody (uid and gid 65534 on the host),
  with no supplementary groups; elsewhere as the trainer's own uid. Either way it runs in one more user namespace,
  nested inside the sandbox's, where it holds no capability over any of the sandbox's mounts or namespaces, may
  create no other namespace and gains no privilege by exec.
- What it may ask of the kernel. A seccomp filter, inherited by every process the code starts, lets sockets of the
  unix and inet families only be made (a vsock would reach the hypervisor, netlink and packet sockets the kernel's
  own surfaces: EAFNOSUPPORT), refuses io_uring, memfds and a few kernel surfaces no computation needs (ENOSYS;
  ``REFUSED`` in the runner says which and why), and kills a process that makes a system call of another
  architecture.
- Namespaces. The new network namespace has only a loopback, which is down, so the code has no network at all. In
  the new PID namespace the code sees only its own processes. When the sandbox's init exits, the kernel kills
  everything the code started, whatever session or group each process moved to. The IPC namespace stops System V
  segments from outliving the call. The UTS and cgroup namespaces show the code a host name of its own,
  "sandbox", and its cgroups as roots: nothing of the host's name or cgroup tree.
- Resources, time and output. Resource limits (setrlimit) on the code's processes: each one's address space
  (``memory_bytes``), CPU seconds (just past the wall clock), the size of one file, open files, and processes and
  threads together (counted in the code's own user namespace). Where this process can make a memory cgroup (cgroup
  v2 whose own cgroup hands the memory controller down, or a writable cgroup v1 memory hierarchy), each call gets
  one, removed after it, that holds all its processes to ``memory_bytes`` together, without swap: where they go
  past it, the kernel kills the largest. Elsewhere a call holds at most ``memory_bytes`` in each of its processes
  (16 at once), and its /tmp up to 16 MiB. Core dumps are off. The caller kills the sandbox at ``timeout_s``.
  Output is read as it arrives and kept up to ``output_bytes``, so neither a hung program nor a chatty one can
  stall the caller or swell its memory.

The sandbox needs Linux 4.6 or later with unprivileged user namespaces and seccomp filters. Where it cannot start
(user namespaces turned off by a sysctl or by a container's seccomp profile, a system call the kernel lacks),
``run_python`` refuses to run code and raises ``SandboxError``, whose paragraph names the step that failed and the
fix for that error on this kernel; ``check_sandbox`` makes the same check up front. Without a cgroup, memory the
kernel holds for the code, such as pipe buffers, is not counted against ``memory_bytes``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

_TAIL = 1024  # bytes kept from the end of stderr, where a traceback names its exception
_LINE = 200  # the most characters of that line that go into ``ToolResult.failure``

RUNNER = str(Path(__file__).with_name("runner.py"))  # the program that builds the sandbox and runs the code
_CGROUP_WAIT_S = 1.0  # how long a call's cgroup may stay busy after its runner ended (its processes still exiting)
_CGROUP_FILES = {  # the files that set a call cgroup's memory limit and its swap's, by cgroup version
    "v2": ("memory.max", "memory.swap.max"),
    "v1": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
}


class SandboxError(RuntimeError):
    """This machine cannot run the sandbox; no code was run."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. The memory limit applies to each of the code's processes, and where a memory cgroup
    is available, to all of the call's processes together."""

    timeout_s: float = 5.0  # wall clock for the whole call
    memory_bytes: int = 256 * 2**20  # each process's address space (RLIMIT_AS); all of them together, in a cgroup
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
    cgroup = _make_cgroup(limits.memory_bytes)
    try:
        process = await _spawn(write_end, limits)
        stdout, stderr, timed_out = await _supervise(process, code, limits, cgroup)
        report = _report(read_end)
    finally:
        os.close(read_end)
        if cgroup is not None:
            await _remove_cgroup(cgroup)
    if report.startswith("setup "):
        raise SandboxError(_cannot_start(json.loads(report.splitlines()[0].removeprefix("setup "))))
    return ToolResult(_output(stdout, stderr, limits.output_bytes), _failure(report, timed_out, stderr, limits))


def check_sandbox() -> None:
    """Raise ``SandboxError`` where this machine cannot run the sandbox. Call it where a tool is set up (an agent
    module's import, say), so that such a machine fails at the run's start rather than at each tool call;
    ``run_python`` raises the same error on its own. It runs one call in a thread with a loop of its own, so it
    works from synchronous code and from inside a running event loop alike (which it blocks for that call)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(run_python("pass"))).result()


async def _spawn(status: int, limits: SandboxLimits) -> asyncio.subprocess.Process:
    """Start the runner in a session of its own, with an empty environment and the status pipe's write end. No
    ``preexec_fn`` is used: it is unsafe in a threaded trainer, and it would force a full fork of the trainer's
    memory."""
    try:
        interpreter, view = await asyncio.to_thread(host_view)  # the first call runs ldd: not on the event loop
        return await asyncio.create_subprocess_exec(
            *(interpreter, "-I", "-S", "-u", RUNNER),
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


def _make_cgroup(memory: int) -> str | None:
    """A memory cgroup of its own for one call, limited to ``memory`` with no swap, so that all the call's processes
    count together; None where this process can make none (``_cgroup_home``)."""
    home = _cgroup_home()
    if home is None:
        return None
    directory, version = home
    path = os.path.join(directory, f"sandbox-{os.urandom(8).hex()}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    memory_file, swap_file = _CGROUP_FILES[version]
    try:
        Path(path, memory_file).write_text(str(memory))
        if os.path.exists(f"{path}/{swap_file}"):  # swap is accounted: the call gets none
            Path(path, swap_file).write_text("0" if version == "v2" else str(memory))  # v1 counts memory and swap
    except OSError:
        with suppress(OSError):
            os.rmdir(path)
        return None
    return path


async def _remove_cgroup(path: str) -> None:
    """Remove a call's cgroup once its last process has exited: the processes of a sandbox killed with the group
    may take a moment to go. One still busy after ``_CGROUP_WAIT_S`` (a process stuck in the kernel) is left behind
    rather than hold up the caller."""
    for _ in range(int(_CGROUP_WAIT_S / 0.01)):
        try:
            os.rmdir(path)
            return
        except OSError as error:
            if error.errno != errno.EBUSY:
                return
        await asyncio.sleep(0.01)


@functools.cache
def _cgroup_home() -> tuple[str, str] | None:
    """The cgroup under which this process may make a memory cgroup per call, and its version: its own cgroup, in
    cgroup v2 where that hands the memory controller down to its children (``cgroup.subtree_control``), else in
    the cgroup v1 memory hierarchy where that is writable. None elsewhere (cgroup v2 not delegated to this user, a
    container's read-only cgroup file system): the per-process limits alone then bound memory."""
    with suppress(OSError, ValueError):  # ValueError: a /proc file in a shape not known here
        ours = _own_cgroups()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        for version, controller in (("v2", ""), ("v1", "memory")):
            directory = _cgroup_directory(mounts, version, ours.get(controller))
            if directory is None or not os.access(directory, os.W_OK):
                continue
            if version == "v1" or "memory" in Path(directory, "cgroup.subtree_control").read_text().split():
                return directory, version
    return None


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup in each hierarchy, by controller: "" names cgroup v2's (/proc/self/cgroup)."""
    ours = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        ours.update((controller, path) for controller in controllers.split(","))
    return ours


def _cgroup_directory(mounts: list[str], version: str, path: str | None) -> str | None:
    """Where the cgroup ``path`` of a hierarchy is mounted (/proc/self/mountinfo: mount root, mount point, then
    after "-" the type and options); None where that hierarchy is not mounted or the cgroup is outside the mount."""
    for line in mounts if path is not None else ():
        fields = line.split()
        kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
        if (kind, version) == ("cgroup2", "v2") or (kind == "cgroup" and version == "v1" and "memory" in options):
            root, point = fields[3], fields[4]
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return point + path[len(root.rstrip("/")):]
    return None


async def _supervise(
    process: asyncio.subprocess.Process, code: str, limits: SandboxLimits, cgroup: str | None
) -> tuple[_Stream, _Stream, bool]:
    """Feed the code in and read both streams until the runner ends or ``timeout_s`` passes; then, or if the caller
    is cancelled, end the sandbox."""
    streams = asyncio.gather(_read(process.stdout, limits.output_bytes), _read(process.stderr, limits.output_bytes))
    timed_out = False
    try:
        await asyncio.wait_for(_feed(process, code, cgroup), limits.timeout_s)
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


async def _feed(process: asyncio.subprocess.Process, code: str, cgroup: str | None) -> None:
    """Move the runner into the call's cgroup, if any, then hand the code over on stdin, close stdin (so reads from
    it get end of file), and wait for the runner. The runner forks only once it has the code, so every process of
    the call starts in the cgroup. The move waits out the kernel's RCU grace period (about 10 ms), in a thread and
    while the runner's interpreter starts. A move refused leaves the call to its per-process limits, as where no
    cgroup can be made."""
    if cgroup is not None and process.returncode is None:  # not a pid that may be another process's by now
        with suppress(OSError):
            await asyncio.to_thread(Path(cgroup, "cgroup.procs").write_text, str(process.pid))
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


def _cannot_start(failed: dict) -> str:
    """The paragraph for a setup step that failed (the runner's report: its errno, its step, named by its system
    call first, and the error as Python wrote it), naming the fix for that error on this kernel."""
    number, step, error, release = failed["errno"], failed["step"] or "", failed["error"], os.uname().release
    start = "The Python sandbox cannot start on this machine"
    if step == "unshare" and number in (errno.EPERM, errno.ENOSPC, errno.EINVAL):
        return (
            f"{start}: {error}. It runs each call in new user, network, PID, mount, IPC, UTS and cgroup namespaces, "
            "so that model-written code has no network and sees no file, socket, process, host name or cgroup of the "
            "host; without them it runs no code rather than run code that can reach the machine. Allow unprivileged "
            "user namespaces: sysctl user.max_user_namespaces above 0, kernel.unprivileged_userns_clone=1 (Debian), "
            "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu), and in a container a seccomp profile that "
            f"permits unshare and an unmasked /proc. EINVAL can also mean a kernel (this one is {release}) built "
            "without one of those namespaces, or older than 4.6, which has no cgroup namespaces."
        )
    if number == errno.ENOSYS and step:
        call = step.split()[0]
        return (
            f"{start}: the kernel, Linux {release}, has no {call} system call ({error}), and the sandbox needs it to "
            f"build the code's view of the machine or to confine the code ({step}). Run the trainer on a kernel that "
            "has it (Linux 4.6 or later, with user, network, PID, mount, IPC, UTS and cgroup namespaces and "
            f"seccomp filters); in a container, whose seccomp profile may answer ENOSYS for a call it refuses, allow "
            f"{call} there."
        )
    return (
        f"{start}: its setup failed at {step or 'a step'}: {error} (Linux {release}, {os.uname().machine}). The "
        "sandbox builds the code's root in new namespaces and confines the code with resource limits and a seccomp "
        "filter, and runs no code unless every step succeeds. A step refused with EPERM after unshare succeeded "
        "usually means the new user namespace got no capabilities (Ubuntu's "
        "kernel.apparmor_restrict_unprivileged_userns=1, or a container's seccomp or AppArmor profile refusing mount, "
        "pivot_root or seccomp): allow them, or run the trainer where they are allowed; otherwise report this step "
        "and error."
    )
