"""The store directory: created exclusively under a random name, checked by every opener, never traversed by a link.

The slots and the manifest live in one directory, normally in ``/dev/shm``, which every
local user can write to. Whoever controls that directory controls the weights a
generator samples with, and, through a planted symbolic link, any file the run's user
can write. So:

- :func:`create_store` makes ``<root>/composer-mesh-<uid>-<32 random hex digits>`` with
  ``mkdir`` (which fails on any existing entry, a link included, instead of reusing it),
  tries a fresh name if one is taken, and leaves it mode 0700 owned by this user. The
  random part comes from :mod:`secrets`: another user cannot guess the name to pre-create
  it. The directory records its creator (pid, start time, host) in ``owner.json``.
- :class:`StoreDir` is the only way into a store: it opens the directory itself with
  ``O_NOFOLLOW`` and checks, on the open descriptor, that it is a directory owned by this
  user with mode exactly 0700 (else ``WeightSyncError`` naming path, owner, mode and the
  fix). Every file inside is created or opened relative to that descriptor, with
  ``O_NOFOLLOW`` (and ``O_EXCL`` to create), and checked to be a regular file owned by
  this user, so no name inside the store is ever resolved through a link.
- :func:`reclaim_dead_stores` removes stores that this user's dead runs left behind (a
  run killed with SIGKILL never reaches its cleanup), and :func:`remove_store` removes one
  store at the end of a run; neither follows a link.

Only the directory's final component is opened without following links: the root
(``/dev/shm`` or the temporary directory) is the caller's choice and trusted like any path the
user typed. Root can still do anything; the checks keep other users out, not root.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

from actors.basics.pids import is_running, start_ticks
from actors.weights.errors import WeightSyncError

PREFIX = "composer-mesh-"
OWNER = "owner.json"
CREATE_ATTEMPTS = 8
# A store without a readable owner record is one whose creator died between mkdir and writing the record (it is
# empty then); one this much older than that moment is reclaimed, a younger one may be in the middle of it.
UNRECORDED_GRACE_S = 60.0
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]{32}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _token() -> str:
    """The unguessable part of a store's name."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class StoreOwner:
    """The process that created a store: its pid, start ticks (so a reused pid is not it) and host."""

    pid: int
    start_ticks: int | None
    host: str

    @classmethod
    def this_process(cls) -> StoreOwner:
        return cls(os.getpid(), start_ticks(os.getpid()), socket.gethostname())

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StoreOwner | None:
        """The record in ``raw``, or None if it is not one."""
        try:
            doc = json.loads(raw)
            owner = cls(doc["pid"], doc["start_ticks"], doc["host"])
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        ticks_ok = owner.start_ticks is None or type(owner.start_ticks) is int
        return owner if type(owner.pid) is int and owner.pid > 0 and ticks_ok and type(owner.host) is str else None

    def is_gone(self) -> bool:
        """Whether the creator is known to have exited (never for another host's process: it cannot be asked)."""
        return self.host == socket.gethostname() and not is_running(self.pid, self.start_ticks)


def create_store(root: str | Path) -> Path:
    """A fresh, empty store directory under ``root``, mode 0700, owned by this user and recording this process.

    Never reuses an existing entry: a name that is taken (by a directory, a file or a
    link, whoever made it) is skipped for a fresh random one.
    """
    root = Path(os.path.abspath(root))
    for _ in range(CREATE_ATTEMPTS):
        path = root / f"{PREFIX}{os.getuid()}-{_token()}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        except FileNotFoundError:
            raise WeightSyncError(
                f"cannot create a weight store: {root} does not exist; create it or pick another root"
            ) from None
        StoreDir._checked(str(path), new=True).close()
        return path
    raise WeightSyncError(
        f"cannot create a weight store under {root}: {CREATE_ATTEMPTS} fresh random names were all taken. Names "
        "come from the secrets module, so something is either creating entries there as fast as they are tried or "
        f"the random source is broken; look at who owns the {PREFIX}* entries in {root}"
    )


def store_path(store: str | Path) -> str:
    """Absolute store path, a ``str`` like ``WeightVersion.store`` so the two compare equal.

    Not resolved: a link at the store's path must reach ``StoreDir``'s ``O_NOFOLLOW``
    open as a link, to be refused, rather than be replaced here by its target.
    """
    return os.path.abspath(store)


class StoreDir:
    """An open, checked store directory: every file operation inside it is relative to its descriptor."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, path: str | Path, *, create: bool = False) -> StoreDir:
        """Open the store at ``path``, refusing a link, a non-directory, another owner or a mode other than 0700.

        ``create``: if nothing is at ``path``, make the directory there (``mkdir``, which
        never reuses an entry: whatever is already there goes through the checks instead).
        """
        path = os.path.abspath(path)
        new = False
        if create:
            try:
                os.mkdir(path, 0o700)
                new = True
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise WeightSyncError(
                    f"cannot create weight store {path}: {os.path.dirname(path)} does not exist; "
                    "create it or give the publisher a path in an existing directory"
                ) from None
        return cls._checked(path, new)

    @classmethod
    def _checked(cls, path: str, new: bool) -> StoreDir:
        """The checked descriptor; ``new``: this process just made the directory, so it fixes the mode
        (``mkdir``'s is cut by the umask) and records itself as the creator."""
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise WeightSyncError(
                f"no weight store at {path}: the trainer has not published (yet) or the run ended and removed it"
            ) from None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise WeightSyncError(_not_a_dir(path)) from None
            raise
        store = cls(path, fd)
        try:
            if new and os.fstat(fd).st_uid == os.getuid():
                os.fchmod(fd, 0o700)
                store.replace(OWNER, StoreOwner.this_process().encode())
            _check_dir(os.fstat(fd), path)
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def unlink(self, *names: str) -> None:
        """Remove entries if present (a link is removed, not followed)."""
        for name in names:
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass

    def create(self, name: str) -> int:
        """A new, empty file ``name`` (mode 0600) open read-write; whatever had that name is removed first."""
        self.unlink(name)
        return self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)

    def open_file(self, name: str, *, writable: bool = False) -> int:
        """Open an existing regular file of this user in the store (a link there is refused)."""
        return self._open(name, os.O_RDWR if writable else os.O_RDONLY)

    def _open(self, name: str, flags: int) -> int:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise WeightSyncError(
                    f"{self.where(name)} is a symbolic link; nothing in a weight store is reached through a link, "
                    "since whoever planted the link chooses its target. Remove the store and rerun: the run makes a "
                    "fresh one"
                ) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise WeightSyncError(
                f"{self.where(name)} is not a regular file owned by {_user(os.getuid())} (it is a "
                f"{_kind(st.st_mode)} owned by {_user(st.st_uid)}); only this user's publisher writes a store. "
                "Remove the store and rerun: the run makes a fresh one"
            )
        return fd

    def read(self, name: str) -> bytes:
        """The whole content of file ``name``."""
        fd = self.open_file(name)
        try:
            parts = []
            while part := os.read(fd, 1 << 20):
                parts.append(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def replace(self, name: str, data: bytes) -> None:
        """Write ``data`` as file ``name`` atomically: readers see the old file or the whole new one."""
        tmp = f"{name}.tmp"
        fd = self.create(tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)


def reclaim_dead_stores(root: str | Path) -> list[Path]:
    """Remove the stores under ``root`` that this user's runs left behind when they died; the paths removed.

    A store is removed only if its name is a store's name for this user's uid, ``lstat``
    shows a real directory (not a link) owned by this user, and either its recorded
    creator is gone (exited, or its pid now belongs to a later process) or it holds no
    readable record and is older than ``UNRECORDED_GRACE_S``. Everything else is left
    alone: other users' stores, live runs' stores, another host's (a shared root), links
    and files that merely look like stores. Call it at start, before creating a store.
    """
    root = Path(os.path.abspath(root))
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    removed = []
    try:
        for name in os.listdir(root_fd):
            match = _NAME.fullmatch(name)
            if match and int(match[1]) == os.getuid() and _abandoned(root_fd, name) and _rmtree(root_fd, name):
                removed.append(root / name)
    finally:
        os.close(root_fd)
    return removed


def remove_store(path: str | Path) -> bool:
    """Delete the store at ``path`` if it is a real directory of this user (a link is left alone); whether it was."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _rmtree(parent_fd, name)
    except FileNotFoundError:
        return False
    finally:
        os.close(parent_fd)


def _abandoned(root_fd: int, name: str) -> bool:
    """Whether the entry ``name`` is this user's store directory and its creator is gone."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False  # links and files are never followed, other users' stores never judged
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return False  # gone meanwhile, or replaced by a link
    store = StoreDir(name, fd)
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            return False
        owner = StoreOwner.decode(store.read(OWNER))
    except (OSError, WeightSyncError):
        owner = None
    finally:
        store.close()
    if owner is None:
        return time.time() - st.st_mtime > UNRECORDED_GRACE_S
    return owner.is_gone()


def _rmtree(dir_fd: int, name: str) -> bool:
    """Remove directory ``name`` under ``dir_fd`` and everything in it, following no link; whether it worked."""
    if not shutil.rmtree.avoids_symlink_attacks:
        raise WeightSyncError("this platform's shutil.rmtree can be made to follow links; refusing to delete stores")
    try:
        shutil.rmtree(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False  # another run reclaimed it first
    return True


def _check_dir(st: os.stat_result, path: str) -> None:
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700:
        return
    raise WeightSyncError(
        f"weight store {path} is owned by {_user(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}; a store must "
        f"be a directory owned by {_user(os.getuid())} (the user of this process) with mode 0700, or another local "
        "user could read, replace or redirect the weights. Someone else created it or loosened its mode: remove it "
        "and rerun; the run creates its store under a fresh random name (actors.weights.create_store)"
    )


def foreign_hands(st: os.stat_result) -> str | None:
    """Who besides this user could change what is in the directory ``st`` describes, in words (its owner,
    or its group or others through the mode), or None when no one can. The weight store asks for more
    (mode exactly 0700, ``_check_dir``); a directory that others may read but not write passes here."""
    if st.st_uid != os.getuid():
        return f"owned by {_user(st.st_uid)}, not by {_user(os.getuid())} (the user of this process)"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"with mode {stat.S_IMODE(st.st_mode):04o}, which lets its group or others write in it"
    return None


def _not_a_dir(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return f"weight store {path} could not be opened as a directory"
    target = f" to {os.readlink(path)}" if stat.S_ISLNK(st.st_mode) else ""
    return (
        f"weight store {path} is a {_kind(st.st_mode)}{target} owned by {_user(st.st_uid)}, not a directory; a "
        "store is never reached through a link, since whoever planted it chooses where the weights go. Remove it "
        "and rerun; the run creates its store under a fresh random name (actors.weights.create_store)"
    )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symbolic link"
    return "directory" if stat.S_ISDIR(mode) else "regular file" if stat.S_ISREG(mode) else "special file"


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
