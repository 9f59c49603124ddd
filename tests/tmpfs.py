"""A real small filesystem for disk-full and read-only tests: a tmpfs mounted for one test."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = "filler"


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "2m", read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``path`` for the duration; skip the test where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs a tmpfs mount (root with CAP_SYS_ADMIN): {mounted.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path, leave: int = 0) -> None:
    """Fill the filesystem holding ``path`` until a write fails, then give back ``leave`` bytes."""
    fd = os.open(path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
        try:
            while True:
                os.write(fd, b"\0")
        except OSError:
            pass
        os.ftruncate(fd, max(os.fstat(fd).st_size - leave, 0))
    finally:
        os.close(fd)
