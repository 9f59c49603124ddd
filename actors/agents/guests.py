"""Who an agent's episode runs as, and what of the machine it sees: a guest of the generator, never one of its own.

Processes of one user can read each other's memory (``/proc/<pid>/mem``), open each other's fds
(``/proc/<pid>/fd/N``) and signal each other. An agent that ran as the generator's user could so read its siblings'
keys, write into its host's pipes and kill its host. Where the generator can switch users (it runs as root, as in
most containers), each episode therefore runs as a user of its own::

    agent host (root, not dumpable) ──fork──▶ episode: its own mount namespace, then a guest uid of the pool
                                               ├── no capabilities, no new privileges, not dumpable
                                               ├── a private /tmp (its HOME) and /dev/shm, empty at its start
                                               └── of the host's files: what other users may read; directories on
                                                   its Python path that others may not enter are shown as a
                                                   tmpfs holding only the entries on that path

A guest uid comes from a pool of ``GUEST_UIDS`` uids far above any real user's, each taken under a lock file of its
own (``GUEST_LOCKS``), so concurrent runs on one host never share one. Its processes and threads together are
bounded by ``GUEST_PROCESSES`` (RLIMIT_NPROC counts per uid). A uid goes back to the pool once no process of it is
left: every one descends from its episode's process, and once that has ended, from the agent host (a subreaper),
which kills them; a uid whose host died holding it has every process killed at once (``kill(-1)`` as the uid,
double-forked and ``setsid`` ones included) before its next use.

Where the generator cannot switch users (it is not root), agents run as the run's own user: the generator, the
agent host and each episode are not dumpable (so their memory and fds are closed to a sibling that has not
exec'd them), and every process an episode starts still ends with it (the host and each episode are subreapers), but
an agent can signal its host (which is then restarted, failing the episodes it held) and its siblings, and it reads
whatever the run's user can. ``Isolation.guarantees`` says which of these holds, and the run says it at its start.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import resource
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

GUEST_LOCKS = "/run/composer-mesh/guests"  # root's alone: one lock file per guest uid in use
GUEST_UIDS = 4096  # uids in the pool: a host runs at most this many episodes at once, all runs together
FIRST_GUEST_UID = 2_100_000_000  # far above real users' and container runtimes' subordinate ranges
NOBODY = 65534  # where a user namespace maps only 65536 uids, the pool ends below nobody's
GUEST_PROCESSES = 1024  # processes and threads of one episode together
PRIVATE_TMP = ("/tmp", "size=1g")  # each episode's own /tmp, its HOME too
PRIVATE_SHM = ("/dev/shm", "size=256m")
GUEST_HOME = {"HOME": "/tmp", "TMPDIR": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache"}  # its private /tmp
_CAP_SETGID, _CAP_SETUID, _CAP_SYS_ADMIN, _CAP_KILL = 6, 7, 21, 5
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 4, 38, 36
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 24, 28
_SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED, _SECBIT_NO_SETUID_FIXUP_LOCKED = 1, 2, 8
_CAPABILITY_VERSION_3 = 0x20080522
# Landlock's system calls have one number on every architecture; scopes came with its ABI 6 (Linux 6.12)
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF, _LANDLOCK_CREATE_RULESET_VERSION = 444, 446, 1
_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, _LANDLOCK_SCOPE_SIGNAL, _LANDLOCK_SCOPES_ABI = 1, 2, 6
_LANDLOCK_FIX = "a kernel with Landlock ABI 6 (Linux 6.12 and up, Landlock enabled) closes them"
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


class GuestError(RuntimeError):
    """An episode could not be made a guest; its message names the cause and the fix."""


def prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}): {os.strerror(ctypes.get_errno())}")


def not_dumpable() -> None:
    """This process's memory and fds closed to every process without CAP_SYS_PTRACE, its own user's included."""
    prctl(_PR_SET_DUMPABLE, 0)


def subreaper() -> None:
    """Orphans of this process's descendants become its children, not init's: nothing leaves the tree it heads."""
    prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class Cover:
    """A host directory an episode sees as an empty tmpfs holding only ``shown``, the host's entries of that name
    (bound): the other entries are hidden. ``options`` are the tmpfs's (its mode, its size)."""

    directory: str
    options: str
    shown: tuple[str, ...] = ()


@dataclass(frozen=True)
class Isolation:
    """How this host's episodes run: ``own_users`` (each a guest uid, where this process may switch users) and
    ``covers``, the view each gets of the machine (with ``own_users`` only)."""

    own_users: bool
    covers: tuple[Cover, ...] = ()
    first_uid: int = FIRST_GUEST_UID  # the pool's
    scoped: bool = False  # Landlock scopes each episode's signals and abstract unix sockets to itself
    shared_because: str = ""  # why episodes run as the run's user, when they do
    fix: str = ""  # and how to give them users of their own

    def guarantees(self) -> str:
        """What holds for the agents, in a paragraph the run says at its start."""
        scope = (
            "nor signal a process or connect to an abstract unix socket (Monarch's channels among them) outside its "
            "episode" if self.scoped else
            f"but abstract unix sockets (Monarch's channels among them) are open to it: {_LANDLOCK_FIX}"
        )
        if self.own_users:
            last = self.first_uid + GUEST_UIDS - 1
            return (
                f"agents run each episode as a user of its own (uids {self.first_uid}-{last}), with no capabilities "
                "and no new privileges, a private /tmp and /dev/shm, and of the host's files only what other users may "
                "read and its Python path: no agent can read or signal the generator, its agent host or a sibling "
                f"episode, {scope}, and every process an episode starts ends with it"
            )
        signals = (
            "cannot signal a process or connect to an abstract unix socket outside its episode" if self.scoped else
            "can signal its agent host (which is then restarted, failing the episodes it held) and its siblings, and "
            f"connect to abstract unix sockets (Monarch's channels among them): {_LANDLOCK_FIX}"
        )
        return (
            f"{self.shared_because}, so agents run as the run's own user (uid {os.geteuid()}), without capabilities: "
            "an agent cannot read the generator's or the agent host's memory or pipes (neither is dumpable), it "
            f"{signals}, every process an episode starts ends with it, and it reads every file the run's user can. "
            f"{self.fix} (docs/environments-and-agents.md, 'What an agent can reach')"
        )


def isolation(search_path: list[str]) -> Isolation:
    """This process's isolation of its episodes, showing each the directories of ``search_path`` (sys.path)."""
    scoped = landlock_abi() >= _LANDLOCK_SCOPES_ABI
    if os.geteuid() != 0:
        return _shared(scoped, f"the generator runs as uid {os.geteuid()}, not root",
                       "Run the generators as root (a container's root will do) to give each episode a user of its own")
    if not _has_capabilities(_CAP_SETGID, _CAP_SETUID, _CAP_SYS_ADMIN, _CAP_KILL):
        return _shared(scoped, "the generator runs as root without CAP_SETUID, CAP_SETGID, CAP_SYS_ADMIN and CAP_KILL",
                       "Grant the generators' container those capabilities to give each episode a user of its own")
    first = _guest_range()
    if first is None:
        return _shared(scoped, f"the generator's user namespace maps too few uids for a pool of {GUEST_UIDS} guests",
                       f"Map uids {FIRST_GUEST_UID}-{FIRST_GUEST_UID + GUEST_UIDS - 1} (or all of 0-65535) into the "
                       "generators' user namespace to give each episode a user of its own")
    return Isolation(True, tuple(covers([sys.executable, *search_path])), first, scoped)


def _shared(scoped: bool, reason: str, fix: str) -> Isolation:
    return Isolation(False, scoped=scoped, shared_because=reason, fix=fix)


def _has_capabilities(*bits: int) -> bool:
    effective = _effective_capabilities()
    return all(effective >> bit & 1 for bit in bits)


def _guest_range() -> int | None:
    """The pool's first uid: ``FIRST_GUEST_UID`` where this user namespace maps it, else the top of the 65536 uids
    most maps hold (a rootless container's), else None."""
    extents = []
    for line in Path("/proc/self/uid_map").read_text().splitlines():
        inside, _, count = map(int, line.split())
        extents.append((inside, inside + count))
    for first in (FIRST_GUEST_UID, NOBODY - GUEST_UIDS):
        if any(start <= first and first + GUEST_UIDS <= end for start, end in extents):
            return first
    return None


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def covers(needed: list[str]) -> list[Cover]:
    """What an episode's view covers: a private /tmp and /dev/shm, and each directory on the way to a ``needed``
    path that other users may not enter, showing only the entries on those ways; shallowest first, as mounted."""
    private = [Cover(path, f"mode=1777,{options}") for path, options in (PRIVATE_TMP, PRIVATE_SHM)
               if os.path.isdir(path)]
    shown: dict[str, set[str]] = {cover.directory: set() for cover in private}
    for path in {os.path.realpath(p) for p in needed if p and os.path.exists(p)}:
        for directory, entry in _ways(path):
            if directory in shown or not os.stat(directory).st_mode & stat.S_IXOTH:
                shown.setdefault(directory, set()).add(entry)
    options = {cover.directory: cover.options for cover in private}
    ordered = sorted(shown, key=lambda d: (d.count("/"), d))
    return [Cover(d, options.get(d, "mode=0711,size=64k"), tuple(sorted(shown[d]))) for d in ordered]


def _ways(path: str) -> list[tuple[str, str]]:
    """Each directory above ``path`` with the entry under it on the way to ``path``."""
    parts = [part for part in path.split("/") if part]
    return [("/" + "/".join(parts[:i]), parts[i]) for i in range(len(parts))]


def enter_view(view: tuple[Cover, ...]) -> None:
    """In an episode's process, still root: a mount namespace of its own with ``view``'s covers mounted."""
    _check(_libc.unshare(_CLONE_NEWNS), "unshare a mount namespace")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here reaches the host
    for cover in view:
        host = os.open(cover.directory, os.O_PATH | os.O_DIRECTORY)  # the host's entries, under the tmpfs to come
        try:
            _mount("tmpfs", cover.directory, "tmpfs", _MS_NOSUID | _MS_NODEV, cover.options)
            for entry in cover.shown:
                source, target = f"/proc/self/fd/{host}/{entry}", f"{cover.directory}/{entry}"
                if os.path.isdir(source):
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
                _mount(source, target, None, _MS_BIND | _MS_REC)
        finally:
            os.close(host)


def _mount(source: str | None, target: str, kind: str | None, flags: int, options: str | None = None) -> None:
    encoded = [None if s is None else s.encode() for s in (source, target, kind, options)]
    _check(_libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]), f"mount {target}")


def _check(result: int, step: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{step}: {os.strerror(error)}")


def become(uid: int) -> None:
    """In an episode's process, still root: the guest ``uid`` (and the gid of that number), no supplementary groups,
    every capability dropped (the kernel drops them as the last uid 0 goes), its processes bounded."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (GUEST_PROCESSES, GUEST_PROCESSES))
    os.setresuid(uid, uid, uid)


def no_new_privileges() -> None:
    prctl(_PR_SET_NO_NEW_PRIVS, 1)


def landlock_abi() -> int:
    """The Landlock ABI this kernel offers (0: none, or turned off)."""
    version = _libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    return max(version, 0)


def scope_to_episode() -> None:
    """Landlock: from now on this process and its descendants may signal only processes of their own domain (the
    episode's) and connect only to abstract unix sockets made in it. Needs no new privileges first."""
    ruleset = (ctypes.c_uint64 * 3)(0, 0, _LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | _LANDLOCK_SCOPE_SIGNAL)
    fd = _libc.syscall(_LANDLOCK_CREATE_RULESET, ruleset, ctypes.sizeof(ruleset), 0)
    if fd < 0:
        _check(-1, "landlock_create_ruleset")
    try:
        _check(_libc.syscall(_LANDLOCK_RESTRICT_SELF, fd, 0), "landlock_restrict_self")
    finally:
        os.close(fd)


def drop_capabilities() -> None:
    """Every capability gone for good, where a process still holds some (root in a user namespace that maps too few
    uids for guests): the bounding set emptied, root's exec-time capabilities turned off and locked, and the
    process's own sets cleared. A no-op for a process that holds none."""
    if not _effective_capabilities():
        return
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for bit in range(last + 1):
        prctl(_PR_CAPBSET_DROP, bit)
    prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED | _SECBIT_NO_SETUID_FIXUP_LOCKED)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    empty = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, for capabilities 0-31 and 32-63
    _check(_libc.capset(header, empty), "capset")


class GuestUsers:
    """The pool of guest uids, shared by every run on this host through lock files: ``take`` one for an episode,
    ``give_back`` it once no process of it is left."""

    def __init__(self, first_uid: int, directory: str = GUEST_LOCKS):
        self.first_uid, self.directory = first_uid, directory
        _private_directory(directory)
        self.held: dict[int, int] = {}  # uid -> its lock file's fd

    def take(self) -> tuple[int, bool]:
        """A free guest uid, locked for this host, and whether a process of it may be left (its last holder died
        holding it): kill them (``kill(-1)`` as the uid) before its episode starts."""
        start = random.randrange(GUEST_UIDS)  # concurrent hosts start their search apart
        for offset in range(GUEST_UIDS):
            uid = self.first_uid + (start + offset) % GUEST_UIDS
            if uid in self.held:
                continue
            lock = os.open(f"{self.directory}/{uid}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock)
                continue
            dirty = os.pread(lock, 1, 0) == b"1"
            os.pwrite(lock, b"1", 0)  # held: cleared when given back clean
            self.held[uid] = lock
            return uid, dirty
        raise GuestError(
            f"all {GUEST_UIDS} guest uids of this host ({self.first_uid} and up) are in use by running episodes; "
            "run fewer episodes at once on this host"
        )

    def left_dirty(self) -> list[int]:
        """The uids no host holds whose last holder died holding them, taken (clean each, then ``give_back``)."""
        taken = []
        for name in os.listdir(self.directory):
            if not name.isdigit() or int(name) in self.held:
                continue
            lock = os.open(f"{self.directory}/{name}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock)
                continue
            if os.pread(lock, 1, 0) == b"1":
                self.held[int(name)] = lock
                taken.append(int(name))
            else:
                os.close(lock)
        return taken

    def give_back(self, uid: int) -> None:
        """``uid`` back to the pool; call it only once no process of it is left."""
        lock = self.held.pop(uid)
        os.pwrite(lock, b"0", 0)
        os.close(lock)  # its lock goes with it


def _private_directory(path: str) -> None:
    """``path`` made if missing, and checked to be a directory root alone may write (another user who could would
    choose which uids guests get)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    for directory in (path, os.path.dirname(path)):
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            what = f"owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o}"
            raise GuestError(
                f"{directory} holds the locks of the agents' guest uids, so only root may write it, but it is "
                f"{what if stat.S_ISDIR(info.st_mode) else 'not a directory'}; remove it (the run makes it again)"
            )
