"""A teacher binding's config, and the static checks of the registered kinds (no torch, no model).

The checks run wherever a binding is named (the topology check, ``mesh.ctl``, the
controller) and look only at the config and the file system; whatever needs the
binding's code (a model, a server, a user's class) is checked by the TeacherPool,
which alone loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from actors import registry
from actors.basics.urls import check_url
from actors.models.source import ModelSource

HF_TEACHER_KEY = "hf teacher path"

Use = Literal["distill", "replay"]
TeacherWeights = Literal["live", "ema", "frozen"]
Hint = Literal["task", "answer", "sibling"]
USES = ("distill", "replay")
WHAT_A_USE_NEEDS = {
    "distill": "gives no top-k at the student's tokens, so it cannot be used for distill",
    "replay": "writes no traces, so it cannot be used for replay",
}


@dataclass(frozen=True)
class BindingConfig:
    """One teacher binding, as a topology or ``mesh.ctl teachers bind`` gives it.

    - ``kind``: a registered teacher (``actors/registry.py``) or ``package.module:Class``,
      a class implementing ``actors.teachers.bindings.Binding`` (loaded only in the TeacherPool).
    - ``use``: what the loop does with it: ``distill`` (its top-k at the student's tokens,
      channel 2; at most one binding at a time) and/or ``replay`` (its traces become
      preference pairs, channel 3). A binding with no use can still be the warm-start teacher.
    - ``path``: ``hf``: the model (a directory or a GGUF file, ``actors/models/source.py``); ``replay``: the JSONL
      file of traces.
    - ``url``/``model``: ``openai``: the server's base URL (``http://host:port/v1``) and model name.
    - ``top_k``: scoring teachers keep this many logprobs per token (capped at the vocabulary).
    - ``token_map``: ``none`` (refuse a tokenizer that differs from the student's) or
      ``by_string`` (match token ids by their strings).
    - ``weights`` (``self_hint``): whose weights score: ``live`` (the version that sampled the batch),
      ``ema`` (an exponential moving average of the versions; it starts at the first version it sees,
      so a resumed run's starts at the resumed policy) or ``frozen`` (the policy's starting weights,
      ``model.path``, for the whole run). A live teacher follows its own drift; OPSD recommends a
      frozen one, SDPO offers the EMA.
    - ``ema_rate`` (``weights: ema``): each new version's share of the average.
    - ``hint`` (teachers that read one): what a wrong sample's teacher reads after the question:
      ``task`` (the task's feedback: the math task's worked solution where it has ``solution``, else
      the answer), ``answer`` (the reference answer alone) or ``sibling`` (a correct completion of the
      same group, SDPO's demonstration; a wrong sample with no correct sibling is not distilled).
      A correct sample is never distilled.
    """

    kind: str
    use: tuple[Use, ...] = ()
    path: str | None = None
    url: str | None = None
    model: str | None = None
    top_k: int = 20
    token_map: Literal["none", "by_string"] = "none"
    weights: TeacherWeights = "live"
    ema_rate: float = 0.05
    hint: Hint = "task"

    def __post_init__(self) -> None:
        object.__setattr__(self, "use", (self.use,) if isinstance(self.use, str) else tuple(self.use))
        if not isinstance(self.kind, str):
            raise ValueError(f"kind must be a registered teacher or 'package.module:Class', got {self.kind!r}")
        backend = registry.resolve("teacher", self.kind)
        for use in self.use:
            if use not in USES:
                raise ValueError(f"unknown use {use!r} for a {self.kind} teacher; choose from {list(USES)}")
            if backend is not None and use not in backend.uses:
                raise ValueError(f"a {self.kind} teacher {WHAT_A_USE_NEEDS[use]}")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.token_map not in ("none", "by_string"):
            raise ValueError(f"unknown token_map {self.token_map!r}; choose 'none' or 'by_string'")
        if self.weights not in ("live", "ema", "frozen"):
            raise ValueError(f"unknown weights {self.weights!r}; choose 'live', 'ema' or 'frozen'")
        if not 0.0 < self.ema_rate <= 1.0:
            raise ValueError(f"ema_rate is each new version's share of the average, in (0, 1]; got {self.ema_rate}")
        if self.ema_rate != BindingConfig.ema_rate and self.weights != "ema":
            raise ValueError(f"ema_rate sets an EMA teacher's pace, but this teacher's weights are {self.weights!r}")
        if self.hint not in ("task", "answer", "sibling"):
            raise ValueError(f"unknown hint {self.hint!r}; choose 'task', 'answer' or 'sibling'")
        if backend is not None and self.kind != "self_hint" and (self.weights, self.hint) != ("live", "task"):
            raise ValueError(
                f"weights and hint choose a self_hint teacher's weights and context; a {self.kind} teacher has its "
                "own weights and reads no hint, so leave them out"
            )
        if (check := registry.static_check("teacher", self.kind)) is not None:
            check(self)


def require(cfg: BindingConfig, *fields: str) -> None:
    """The config fields a kind cannot do without."""
    missing = [f for f in fields if getattr(cfg, f) is None]
    if missing:
        raise ValueError(
            f"a {cfg.kind} teacher needs {', '.join(missing)} (e.g. {{kind: {cfg.kind}, {missing[0]}: ...}})"
        )


def check_hf(cfg: BindingConfig) -> None:
    require(cfg, "path")
    ModelSource.of(cfg.path, HF_TEACHER_KEY)


def check_self_hint(cfg: BindingConfig) -> None:
    if cfg.path is not None:
        raise ValueError("a self_hint teacher is the policy itself, so it takes no path; use kind: hf for a model")


def check_replay(cfg: BindingConfig) -> None:
    require(cfg, "path")
    if not Path(cfg.path).expanduser().is_file():
        raise ValueError(f"replay teacher path {cfg.path!r} is not a file; give a JSONL file of recorded traces")


def check_openai(cfg: BindingConfig) -> None:
    require(cfg, "url", "model")
    try:
        check_url(cfg.url, ("http", "https"))
    except ValueError as error:
        raise ValueError(
            f"openai teacher url {cfg.url!r} is not an http(s) URL ({error}); give the server's API base, "
            "e.g. http://localhost:8000/v1"
        ) from None
