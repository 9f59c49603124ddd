"""Prompts from a data set on local disk, read with Hugging Face ``datasets``.

``task: {name: dataset, dataset: {path, split, prompt, answer}, eval_dataset: {...},
system_prompt: ...}``. ``path`` is a JSON Lines file (``.jsonl``/``.json``), a parquet
file, a directory written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``, or a
directory of such files named by split (``train.jsonl``, ``test-00000-of-00001.parquet``,
also under ``data/``, the Hub's layout). Nothing is downloaded. A task that reads worked
solutions (``math``'s ``solution``) names their column with a parameter of its own, and
``eval_dataset`` reads that column as it reads the prompt and answer columns.

The topology check reads no data (it must not import ``datasets``): it finds the files and,
where a header is cheap to read (a JSON line, a saved data set's ``dataset_info.json``),
the columns. The rows load on the first ``problems`` call, in the process that asks for
prompts; a parquet file's columns are checked then.

Prompt order is a pure function of ``(seed, step)``: step s takes the rows at positions
``s*count .. (s+1)*count`` of an endless stream made of one seeded permutation of the data
per epoch, so a resumed run sees the prompts the uninterrupted run would have. Negative
steps (the held-out evaluation asks for step -1) draw the same way from ``eval_dataset``,
or from the training rows when no ``eval_dataset`` is given (then it is not held out).
"""

from __future__ import annotations

import codecs
import json
import os
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from actors.tasks import Problem

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes: a DatasetDict, a Dataset
# The character tokenizer of a tiny model (model.init) needs every character a prompt can hold
# before any row is read: printable ASCII; anything else reads as <unk>.
PRINTABLE = "\n" + "".join(chr(c) for c in range(32, 127))
# What task.dataset and task.eval_dataset may set; a solution column is the task's own parameter (``columns``).
KEYS = ("path", "split", "prompt", "answer")
# The topology check reads at most this much of a data file (a record's columns, a saved data set's
# header): a file of any size, or one long line, is checked in the time of reading a few MB.
HEADER_BYTES = 4 * 2**20


class DatasetError(ValueError):
    """A data set that cannot be read as configured; ``str()`` names the cause and the fix."""


@dataclass(frozen=True)
class DatasetSource:
    """Where the rows come from: ``path``, which ``split`` of it (None: its only one), and the
    columns holding each row's ``prompt``, reference ``answer`` and worked ``solution`` (None: none read)."""

    path: str
    split: str | None = None
    prompt: str = "prompt"
    answer: str = "answer"
    solution: str | None = None

    @classmethod
    def of(cls, value: Any, key: str, defaults: Mapping[str, str | None]) -> DatasetSource:
        """From the task's ``key``: a mapping of ``KEYS`` (those left out, and the solution column, from
        ``defaults``), or a path alone."""
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, Mapping):
            raise DatasetError(f"task.{key} must be a mapping such as {{path: data/train.jsonl, prompt: question}}")
        if unknown := sorted(set(value) - set(KEYS)):
            raise DatasetError(f"task.{key}: unknown key {unknown[0]!r}; keys are {', '.join(KEYS)}")
        for name, text in value.items():
            if not isinstance(text, str) or not text:
                raise DatasetError(f"task.{key}.{name} must be a non-empty string, got {text!r}")
        if "path" not in {**defaults, **value}:
            raise DatasetError(f"task.{key} needs a path: a JSON Lines or parquet file, or a data set directory")
        source = cls(**{**defaults, **value})
        source.check()  # fails now, with the reason, for a path that cannot be read
        return source

    @property
    def where(self) -> str:
        return self.path if self.split is None else f"{self.path} (split {self.split!r})"

    def files(self) -> tuple[str, list[Path]]:
        """The format (``json``, ``parquet`` or ``disk``) and what to load."""
        path = Path(self.path).expanduser()
        if path.is_file():
            if self.split is not None:
                raise DatasetError(
                    f"{self.path} is one file, so it is one split; remove split: {self.split!r}, or point path at "
                    "a directory holding a file per split"
                )
            return _file_format(path), [path]
        if not path.is_dir():
            raise DatasetError(
                f"no data set at {self.path} (relative paths start where the run starts, {Path.cwd()}); give a "
                "JSON Lines or parquet file, or a directory written by save_to_disk or holding a file per split"
            )
        if any((path / marker).is_file() for marker in SAVED_MARKERS):
            return "disk", [path]
        return self._split_files(path)

    def _split_files(self, directory: Path) -> tuple[str, list[Path]]:
        """The files of one split in a directory of data files (``<split>.jsonl``, ``<split>-*.parquet``)."""
        found: dict[str, list[Path]] = {}
        for place in (directory, directory / "data"):
            for file in sorted(place.glob("*")) if place.is_dir() else []:
                if file.suffix in FILE_FORMATS:
                    found.setdefault(file.name.removesuffix(file.suffix).split("-")[0], []).append(file)
        if not found:
            raise DatasetError(
                f"{self.path} holds no data set: neither save_to_disk's files nor data files (.jsonl, .json, "
                ".parquet) named by split; point path at one"
            )
        split = self.split if self.split is not None else _only(found, self.path)
        if split not in found:
            raise DatasetError(f"{self.path} has no split {split!r}; its splits are {', '.join(sorted(found))}")
        formats = {FILE_FORMATS[file.suffix] for file in found[split]}
        if len(formats) > 1:
            raise DatasetError(f"split {split!r} of {self.path} mixes formats ({', '.join(sorted(formats))}); keep one")
        return formats.pop(), found[split]

    def check(self) -> None:
        """Raise for a missing path or split, and for a missing column where the columns are cheap to
        read (a JSON line, a saved data set's header; a parquet file's wait for ``load``)."""
        kind, found = self.files()
        if kind == "json":
            self._require(_json_columns(found[0]))
        elif kind == "disk":
            self._require(_saved_columns(found[0], self.split))

    def _require(self, names: list[str]) -> None:
        roles = {"prompt": self.prompt, "answer": self.answer, "solution": self.solution}
        for role, column in roles.items():
            if column is not None and column not in names:
                fix = (
                    "Set task.solution: to one of them, or leave it out to hint and trace the answer alone"
                    if role == "solution"
                    else f"Set the data set's {role}: to one of them"
                )
                raise DatasetError(
                    f"{self.where} has no column {column!r} for the {role}; its columns are {', '.join(names)}. {fix}"
                )

    def load(self) -> list[tuple[str, str, str | None]]:
        """Every row's (prompt, answer, solution), read with ``datasets`` offline, into a throwaway cache
        (the rows live in memory; nothing is left on disk, and concurrent runs share no lock). The
        solution is None when no column is named, its surrounding white space stripped otherwise."""
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import datasets

        datasets.disable_progress_bars()
        kind, found = self.files()
        with tempfile.TemporaryDirectory(prefix="datasets-") as cache_dir:
            try:
                if kind == "disk":
                    data = datasets.load_from_disk(str(found[0]), keep_in_memory=True)
                    if isinstance(data, datasets.DatasetDict):
                        data = data[self.split if self.split is not None else _only(data, self.path)]
                else:
                    files = [str(file) for file in found]
                    data = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)
            except Exception as error:  # datasets raises many kinds for a malformed file
                raise DatasetError(
                    f"cannot read {self.where} as {kind} ({type(error).__name__}: {error}); check the file"
                ) from None
            self._require(list(data.column_names))
            prompts, answers = list(data[self.prompt]), list(data[self.answer])
            solutions = list(data[self.solution]) if self.solution is not None else [None] * len(prompts)
        if not prompts:
            raise DatasetError(f"{self.where} holds no rows; point the task at a data set with some")
        self._texts("prompt", prompts)
        if self.solution is not None:
            solutions = [s.strip() if isinstance(s, str) else s for s in solutions]
            self._texts("solution", solutions)
        return [(p, "" if a is None else str(a), s) for p, a, s in zip(prompts, answers, solutions)]

    def _texts(self, role: str, values: list) -> None:
        """Refuse the first of a column's ``values`` that is not a text with something in it."""
        for number, value in enumerate(values):
            if not isinstance(value, str) or not value:
                raise DatasetError(f"{self.where}: row {number} has {role} {value!r}, not a text; fix that row")


@dataclass
class DatasetTask:
    """Prompts from ``dataset``; a completion scores 1 when it equals the answer (both stripped of
    surrounding white space), else 0. ``system_prompt`` goes into every problem. ``eval_dataset``
    takes what it leaves out from ``dataset``: the columns, and the path with its split."""

    COLUMNS = {"prompt": "prompt", "answer": "answer"}  # a data set's columns unless it names others

    dataset: DatasetSource | Mapping | str
    eval_dataset: DatasetSource | Mapping | str | None = None
    system_prompt: str | None = None
    _rows: dict[str, list[tuple[str, str, str | None]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, DatasetSource):
            self.dataset = DatasetSource.of(self.dataset, "dataset", self.columns())
        if self.eval_dataset is not None and not isinstance(self.eval_dataset, DatasetSource):
            train = self.dataset
            same = {"prompt": train.prompt, "answer": train.answer, "solution": train.solution}
            if isinstance(self.eval_dataset, Mapping) and "path" not in self.eval_dataset:  # the same path
                same |= {"path": train.path, "split": train.split}  # and split; a new path takes no split of the old
            self.eval_dataset = DatasetSource.of(self.eval_dataset, "eval_dataset", same)
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise DatasetError(f"task.system_prompt must be a text, got {self.system_prompt!r}")

    @property
    def alphabet(self) -> str:
        return PRINTABLE

    def columns(self) -> dict[str, str | None]:
        """The columns rows are read from where ``task.dataset`` names none (a subclass adds its own)."""
        return dict(self.COLUMNS)

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        stream = "eval" if step < 0 else "train"
        rows = self._load(stream)
        start = (step if step >= 0 else -step - 1) * count
        key = f"{type(self).__name__}/{stream}/{seed}"
        picked = [rows[_permutation(key, epoch, len(rows))[at]] for epoch, at in _positions(start, count, len(rows))]
        return [Problem(p, self.reference(a), self.system_prompt, solution=s) for p, a, s in picked]

    def reference(self, answer: str) -> str:
        """The answer a problem carries, from the data set's answer column."""
        return answer.strip()

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    def _load(self, stream: str) -> list[tuple[str, str, str | None]]:
        if stream not in self._rows:
            source = self.eval_dataset if stream == "eval" and self.eval_dataset is not None else self.dataset
            self._rows[stream] = source.load()
        return self._rows[stream]


def _positions(start: int, count: int, size: int) -> list[tuple[int, int]]:
    return [divmod(i, size) for i in range(start, start + count)]


@cache
def _permutation(key: str, epoch: int, size: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"{key}/{epoch}").shuffle(order)
    return tuple(order)


def _file_format(path: Path) -> str:
    if path.suffix not in FILE_FORMATS:
        raise DatasetError(
            f"{path} is neither JSON Lines (.jsonl, .json) nor parquet (.parquet); convert it, or save a data set "
            "with save_to_disk and point path at its directory"
        )
    return FILE_FORMATS[path.suffix]


def _only(splits: Mapping, path: str) -> str:
    if len(splits) != 1:
        raise DatasetError(f"{path} holds splits {', '.join(sorted(splits))}; name one with split:")
    return next(iter(splits))


def _json_columns(path: Path) -> list[str]:
    """The keys of the first record: the first line of JSON Lines, or the first element of a JSON
    list, read from the file's first ``HEADER_BYTES`` (whatever the file's size)."""
    try:
        head, cut = _head(path)
        record = _first_record(head)
    except OSError as error:
        raise DatasetError(f"cannot read {path} ({error.strerror}); check the path and its permissions") from None
    except ValueError as error:
        if cut and not isinstance(error, UnicodeDecodeError):
            raise DatasetError(
                f"{path}: no whole record in its first {HEADER_BYTES // 2**20} MB (a prompt row is far shorter), so "
                "it is not JSON Lines of prompts; write one JSON object per line"
            ) from None
        raise DatasetError(f"cannot read {path} as JSON Lines ({error}); write one JSON object per line") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{path}: the first record is a {type(record).__name__}, not a JSON object with columns")
    return list(record)


def _first_record(head: str) -> Any:
    """The first JSON value of ``head``: a JSON list's first element, else the first non-blank line's
    value (a line cut short by the end of ``head`` does not parse)."""
    text = head.lstrip()
    if text.startswith("["):
        return json.JSONDecoder().raw_decode(text[1:].lstrip())[0]
    return json.loads(text.partition("\n")[0])


def _head(path: Path) -> tuple[str, bool]:
    """The file's first ``HEADER_BYTES`` as UTF-8 (a character cut at the end is left out), and whether
    the file goes on past them."""
    with path.open("rb") as file:
        data = file.read(HEADER_BYTES + 1)
    return codecs.getincrementaldecoder("utf-8")().decode(data[:HEADER_BYTES]), len(data) > HEADER_BYTES


def _saved_columns(directory: Path, split: str | None) -> list[str]:
    """The features a saved data set declares in ``dataset_info.json`` (a DatasetDict: the split's)."""
    if (directory / "dataset_dict.json").is_file():
        splits = _read_json(directory / "dataset_dict.json").get("splits") or []
        split = split if split is not None else _only(dict.fromkeys(splits), str(directory))
        if split not in splits:
            raise DatasetError(f"{directory} has no split {split!r}; its splits are {', '.join(sorted(splits))}")
        directory = directory / split
    elif split is not None:
        raise DatasetError(f"{directory} holds one saved split; remove split: {split!r}")
    features = _read_json(directory / "dataset_info.json").get("features")
    if not isinstance(features, dict):
        raise DatasetError(f"{directory}/dataset_info.json declares no features; save the data set again")
    return list(features)


def _read_json(path: Path) -> dict:
    try:
        head, cut = _head(path)
        data = json.loads(head)
    except (OSError, ValueError) as error:
        if isinstance(error, ValueError) and cut:
            error = f"larger than {HEADER_BYTES // 2**20} MB, but it is a header of a few kB"
        raise DatasetError(f"cannot read {path} ({error}); save the data set again with save_to_disk") from None
    return data if isinstance(data, dict) else {}
