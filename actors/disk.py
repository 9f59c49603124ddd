"""Why a write failed, in words a user can act on: the error's name and the space left.

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
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


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
