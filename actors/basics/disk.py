"""Reading what a run left behind safely, and why a write failed in words a user can act on.

Whoever can write a run directory or a checkpoint can put a named pipe, a device or a link
where a file belongs: a reader that opens it as a file hangs on the pipe, reads /dev/zero
forever or follows the link to another user's file. ``open_regular`` is the one way such
files are opened: never blocking, never following a link unless asked, regular files only,
and ``read_regular``/``lines`` read within a bound.

A full disk is the common cause of a failed checkpoint or log write, and the number
that tells the user what to do (how much is free, and where) is not in the exception.
It is not the only one: a name too long for its filesystem, a file where a directory
should be, a directory one may not write each need another fix (``why_not_written``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)
KINDS = {  # what a path is instead of a regular file, by its stat type
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


class RefusedFile(OSError):
    """A file a reader refuses: not a regular file (a pipe, a device, a link, a directory), or larger than
    that reader's bound. ``str()`` is the reason alone, e.g. ``a named pipe (FIFO), not a regular file``,
    for the caller to put after the path and a colon."""

    def __init__(self, reason: str):
        super().__init__(errno.EINVAL, reason)

    def __str__(self) -> str:
        return self.strerror


def open_regular(path: Path, follow_links: bool = False) -> BinaryIO:
    """``path`` open for reading, when it is a regular file; else ``RefusedFile`` (other failures are the
    usual ``OSError``). It never blocks (a pipe opens at once, then is refused) and, unless ``follow_links``
    (a model directory: the Hugging Face cache is links into its blobs), never follows a link at the end of
    ``path``, so a name in a run directory cannot lead out of it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # O_NOFOLLOW on a link; a socket cannot be opened
            raise RefusedFile(_not_regular(os.lstat(path).st_mode)) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RefusedFile(_not_regular(mode))
    return os.fdopen(fd, "rb")


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (a link to one is not: ``open_regular`` would refuse it)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _not_regular(mode: int) -> str:
    return f"{KINDS.get(stat.S_IFMT(mode), 'not a file')}, not a regular file"


def read_regular(path: Path, limit: int | None = None, follow_links: bool = False) -> bytes:
    """All of the regular file ``path`` (``open_regular``), as long as it was when opened; a file larger than
    ``limit`` bytes is a ``RefusedFile`` saying so, before any of it is read."""
    with open_regular(path, follow_links) as file:
        size = os.fstat(file.fileno()).st_size
        if limit is not None and size > limit:
            raise RefusedFile(f"{size_text(size)}, more than the {size_text(limit)} such a file can be")
        return file.read(size)


def lines(file: BinaryIO, longest: int) -> Iterator[bytes]:
    """The lines of ``file`` (each with its newline, the last one maybe without), one at a time; a line longer
    than ``longest`` bytes is a ``RefusedFile`` naming it, so a file with no newline is never read whole."""
    number = 0
    while line := file.readline(longest + 1):
        number += 1
        if len(line) > longest:
            raise RefusedFile(f"line {number} is longer than {size_text(longest)}, more than any of its lines can be")
        yield line


def errno_of(error: BaseException) -> int | None:
    """The OS error number of ``error``; safetensors' Rust writer only puts it in its message."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = re.search(r"os error (\d+)", str(error))
    return int(found.group(1)) if found else None


def write_cause(error: BaseException, path: Path) -> str:
    """E.g. ``No space left on device (ENOSPC; 12 KiB free on /data)``."""
    code = errno_of(error)
    if code is None:
        return f"{type(error).__name__}: {error}"
    cause = f"{os.strerror(code)} ({errno.errorcode.get(code, code)}"
    existing = next((p for p in (path, *path.parents) if _exists(p)), None)
    if code in DISK_FULL and existing is not None:
        cause += f"; {size_text(shutil.disk_usage(existing).free)} free on {existing}"
    return cause + ")"


def why_not_written(error: BaseException, path: Path, elsewhere: str) -> str:
    """The cause of a failed write under ``path`` and its fix, ``elsewhere`` (e.g. "choose another OUT") being
    the fix that always applies: "free space there" only when the disk is full."""
    code = errno_of(error)
    if code == errno.ENOTDIR:
        blocker = next((p for p in path.parents if _exists(p) and not p.is_dir()), path.parent)
        return f"{blocker} is a file, not a directory, so nothing can be written under it; {elsewhere}"
    if code == errno.ENAMETOOLONG:
        return f"a name in {path} is too long for its filesystem (ENAMETOOLONG); {elsewhere}, with a shorter name"
    if code in DISK_FULL:
        return f"{write_cause(error, path)}; free space there, or {elsewhere}"
    if code in NOT_ALLOWED:
        return f"{write_cause(error, path)}; make that directory writable, or {elsewhere}"
    return f"{write_cause(error, path)}; {elsewhere}"


def _exists(path: Path) -> bool:
    """``path.exists()``, False where even asking fails (a name too long for its filesystem)."""
    try:
        return path.exists()
    except OSError:
        return False


def size_text(count: int) -> str:
    """E.g. ``12.0 KiB``."""
    value, unit = float(count), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
