"""A timeline of every actor call: ``trace.json`` (Chrome trace events, for Perfetto or chrome://tracing)
and ``timeline.png`` (a Gantt chart of the last steps) in the run directory.

The metrics give each step's totals (``time/generate``, ``time/train``); the timeline shows where the
time went and what overlapped: which process was busy or idle, and that a bounded-async run generates
step k+1 while step k trains. Its events:

- every actor call, timed by the fleet (``Fleet.call``): one event on the track of the process that
  answered it (each trainer rank's ``train_step``, sent its share), or on each process of the mesh for a call to
  all of it (the trainer's ``publish``, ``save``); one track per actor per process, named
  ``<mesh> <index> (host:pid)``;
- the controller's own track: ``wait for batch k`` and ``train step k`` (the optimizer step with
  DiLoCo's outer step, as the loop waits for it).

Each event carries its step (``STEP``: the controller sets it while a step trains, and inside each
collection's task), so the step of a batch collected ahead is the step it is for; calls outside any
step (the first publish and push, the last settle) have none. A call that failed or was cancelled is
not in it (the fault is in ``error.log`` and ``events.jsonl``).

Bounded: only the last ``logging.trace.steps`` (N) steps are kept (a call outside any step counts with
the newest step when it came, those before the first with the first), so a 10,000-step run's memory
and file stay those of N steps. The hot path takes two clock readings and appends one tuple; the
dicts are built only when the file is written: every N steps on the run directory's logging thread
(a temp file renamed over the last, so a live run always has a whole one) and at the end. Tracing must never end a run: a
write or a drawing that fails is one warning line on stderr.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from actors.basics.disk import write_cause
from actors.basics.proc_info import ProcInfo, this_proc

T = TypeVar("T")
TRACE_FILE = "trace.json"
CONTROLLER = "controller"
TIMELINE_STEPS = 3  # the steps timeline.png draws: enough to see a step's collection overlap another's training
STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("mesh_trace_step", default=None)

# endpoint -> what it does (the timeline's colours, the events' "cat")
KINDS = {
    "generate": "generate",
    "play": "generate",
    "logprobs_of": "generate",
    "reward": "reward",
    "trace": "teachers",
    "top_k": "teachers",
    "bind": "teachers",
    "drop": "teachers",
    "needs_hints": "teachers",
    "logprobs": "reference",
    "train_step": "train step",
    "publish": "weights",
    "hold": "weights",
    "save": "checkpoint",
    "load": "checkpoint",
    "sync": "diloco sync",
    "wait for batch": "wait for batch",  # the controller's own
    "train step": "train step",
}
# endpoints whose own name does not say what they do
NAMES = {
    "hold": "load weights (hold)",
    "publish": "publish weights",
    "save": "save checkpoint",
    "load": "load checkpoint",
    "sync": "diloco sync",
    "logprobs": "reference logprobs",
    "trace": "teacher traces",
    "top_k": "teacher top_k",
}
COLOURS = {
    "wait for batch": "#d0d0d0",
    "train step": "tab:red",
    "generate": "tab:blue",
    "reward": "tab:olive",
    "teachers": "tab:purple",
    "reference": "tab:brown",
    "weights": "tab:orange",
    "checkpoint": "tab:green",
    "diloco sync": "tab:pink",
    "other": "black",
}

ROLE_ORDER = {role: i for i, role in enumerate([CONTROLLER, "trainer", "generator", "rewarder", "reference"])}
# one buffered event: (window key, step, start, end, endpoint or span name, role, mesh, proc or None for all,
# the mesh's processes when it ran)
_Event = tuple[int | None, int | None, float, float, str, str, str, int | None, list[ProcInfo]]


@dataclass(frozen=True, order=True)
class Track:
    """One row of the timeline: an actor on one process."""

    mesh: str
    index: int
    host: str
    pid: int
    role: str

    @property
    def process(self) -> str:
        return f"{self.mesh} {self.index} ({self.host}:{self.pid})"


@dataclass(frozen=True)
class Span:
    """One event on one track, as the file and the chart show it (built only when they are written)."""

    track: Track
    name: str
    kind: str
    start: float  # seconds since the tracer began
    end: float
    step: int | None


class Tracer:
    def __init__(self, steps: int, directory: Path, background: Callable[[Callable[[], None]], None]):
        """Keep the last ``steps`` steps' events; write them to ``directory``/trace.json every ``steps`` steps,
        each write a job for ``background`` (the run directory's logging thread)."""
        self.steps, self.directory, self.background = steps, directory, background
        self.origin = time.perf_counter()
        self.newest: int | None = None  # the newest step seen
        self._events: deque[_Event] = deque()
        self._controller = [this_proc()]

    def call(
        self, role: str, mesh: str, proc: int | None, endpoint: str, where: list[ProcInfo], start: float, end: float
    ) -> None:
        """One actor call (``proc`` None: to every process of the mesh, ``where``), in the caller's step."""
        self._add(STEP.get(), start, end, endpoint, role, mesh, proc, where)

    def span(self, name: str, start: float, end: float, step: int) -> None:
        """One stretch of the controller's own time in ``step``: ``wait for batch`` or ``train step``."""
        self._add(step, start, end, name, CONTROLLER, CONTROLLER, 0, self._controller)

    def _add(self, step: int | None, *event: Any) -> None:
        if step is not None and (self.newest is None or step > self.newest):
            self._advance(step)
        self._events.append((step if step is not None else self.newest, step, *event))

    def _advance(self, step: int) -> None:
        """``step`` is the newest: the events before the window go, and every N steps (from step 0) the file is
        rewritten."""
        if self.newest is None:  # the calls before the first step count with it
            self._events = deque((step, *event[1:]) for event in self._events)
        self.newest = step
        cutoff = step - self.steps + 1
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()
        if step % self.steps == 0:
            events = list(self._events)  # taken here; the logging thread builds and writes the file
            self.background(lambda: self._write(events, step))

    def spans(self) -> list[Span]:
        """The window's events, each on its process's track (a call to a whole mesh on each of its processes)."""
        return self._spans(list(self._events), self.newest)

    def _spans(self, events: list[_Event], newest: int | None) -> list[Span]:
        cutoff = (newest or 0) - self.steps + 1
        spans = []
        for key, step, start, end, name, role, mesh, proc, where in events:
            if key is not None and key < cutoff:  # behind the window, not yet dropped (a newer event came first)
                continue
            shown, kind = f"{name} {step}" if role == CONTROLLER else NAMES.get(name, name), KINDS.get(name, "other")
            for i in range(len(where)) if proc is None else [proc]:
                track = Track(mesh, i, where[i].host, where[i].pid, role)
                spans.append(Span(track, shown, kind, start - self.origin, end - self.origin, step))
        return spans

    def _write(self, events: list[_Event], newest: int | None) -> None:
        """trace.json of ``events``, whole or not at all (a temp file renamed over the last); never raises."""
        out = self.directory / TRACE_FILE
        partial = out.with_name(f".{TRACE_FILE}.partial")
        try:
            partial.write_text(json.dumps(to_chrome(self._spans(events, newest)), separators=(",", ":")))
            os.replace(partial, out)
        except Exception as error:  # a trace is for reading the run, never a reason to stop it
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            print(f"warning: {out} was not written: {write_cause(error, out)}", file=sys.stderr)

    def close(self) -> None:
        """The run's end (the logging thread done): trace.json once more with every step's events since the last
        write; never raises."""
        self._write(list(self._events), self.newest)

    def plot(self, out: Path) -> None:
        """timeline.png: the last ``TIMELINE_STEPS`` steps."""
        plot_timeline(self.spans(), out)


@contextlib.contextmanager
def at_step(step: int) -> Iterator[None]:
    """The calls made inside belong to ``step`` (the controller's training of it)."""
    token = STEP.set(step)
    try:
        yield
    finally:
        STEP.reset(token)


async def in_step(step: int, work: Awaitable[T]) -> T:
    """``work``, whose calls belong to ``step``: a collection, run as its own task (which copied the
    context of the step that started it, an earlier one)."""
    with at_step(step):
        return await work


def _tracks(spans: list[Span]) -> list[Track]:
    """Every track, in the loop's order: the controller, the trainer's ranks, the generators, then the services."""
    return sorted({s.track for s in spans}, key=lambda t: (ROLE_ORDER.get(t.role, len(ROLE_ORDER)), t))


def to_chrome(spans: list[Span]) -> dict:
    """``spans`` in Chrome's trace-event format: a complete event ("X", microseconds) per span, and the
    metadata events ("M") that name each process ("<mesh> <index> (host:pid)") and thread (the actor's role)."""
    tracks = _tracks(spans)
    pids = {process: i for i, process in enumerate(dict.fromkeys(t.process for t in tracks), start=1)}
    roles = {role: i for i, role in enumerate(dict.fromkeys(t.role for t in tracks), start=1)}
    events = []
    for process, pid in pids.items():
        events.append(_metadata("process_name", pid, 0, {"name": process}))
        events.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
    for track in tracks:
        events.append(_metadata("thread_name", pids[track.process], roles[track.role], {"name": track.role}))
    for s in spans:
        ts, dur = round(s.start * 1e6, 1), round(max(0.0, s.end - s.start) * 1e6, 1)
        ids = {"pid": pids[s.track.process], "tid": roles[s.track.role]}
        events.append({"ph": "X", "name": s.name, "cat": s.kind, "ts": ts, "dur": dur, **ids, "args": _args(s.step)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "ts": 0, "pid": pid, "tid": tid, "args": args}


def _args(step: int | None) -> dict:
    return {} if step is None else {"step": step}


def plot_timeline(spans: list[Span], out: Path, steps: int = TIMELINE_STEPS) -> None:
    """A Gantt chart of the last ``steps`` steps the controller trained, and every call that overlapped them
    (the collections run ahead): a row per track, a bar per span coloured by its kind and labelled with its
    step, time in seconds. Spans that overlap on one track (a generator's requests in flight) share its row
    in lanes. Nothing when there are none (a run that stopped before its first call)."""
    if not spans:
        return
    from matplotlib.patches import Patch

    from mesh.records.figures import pyplot

    plt = pyplot()

    t0, title = _window(spans, steps)
    shown = [replace(s, start=max(s.start, t0)) for s in spans if s.end >= t0]
    tracks = _tracks(shown)
    width = max(s.end for s in shown) - t0 or 1.0
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.55 * len(tracks)), dpi=120)
    for row, track in enumerate(tracks):
        lanes = _lanes([s for s in shown if s.track == track])
        height = 0.8 / len(lanes)
        for lane, lane_spans in enumerate(lanes):
            _draw_lane(ax, lane_spans, t0, width, (row - 0.4 + lane * height, height * 0.9))
    ax.set_yticks(range(len(tracks)), [_label(t) for t in tracks], fontsize=8)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, width)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    kinds = [k for k in COLOURS if any(s.kind == k for s in shown)]
    ax.legend([Patch(color=COLOURS[k]) for k in kinds], kinds, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)


def _window(spans: list[Span], steps: int) -> tuple[float, str]:
    """Where the chart starts (the controller's wait for the first of the last ``steps`` steps), and its title."""
    trained = sorted({s.step for s in spans if s.track.mesh == CONTROLLER and s.step is not None})[-steps:]
    if not trained:
        return min(s.start for s in spans), "every actor call (no step trained)"
    t0 = min(s.start for s in spans if s.track.mesh == CONTROLLER and s.step == trained[0])
    what = f"step {trained[0]}" if len(trained) == 1 else f"steps {trained[0]}-{trained[-1]}"
    return t0, f"{what}: every actor call and the controller's waits, each bar labelled with its step"


def _draw_lane(ax: Any, spans: list[Span], t0: float, width: float, y: tuple[float, float]) -> None:
    """One lane's bars (a sliver at least, so that a short call still shows), each labelled where it fits."""
    bars = [(s.start - t0, max(s.end - s.start, width / 1000)) for s in spans]
    ax.broken_barh(bars, y, facecolors=[COLOURS[s.kind] for s in spans], edgecolor="white", linewidth=0.3)
    for s in spans:
        if s.step is not None and s.end - s.start > width / 50:
            colour = "black" if s.kind == "wait for batch" else "white"
            middle = ((s.start + s.end) / 2 - t0, y[0] + y[1] / 2)
            ax.text(*middle, str(s.step), ha="center", va="center", fontsize=7, color=colour)


def _lanes(spans: list[Span]) -> list[list[Span]]:
    """``spans`` in as few lanes as keep every lane's spans apart (each goes to the first lane free at its start)."""
    lanes: list[list[Span]] = []
    for span in sorted(spans, key=lambda s: s.start):
        free = next((lane for lane in lanes if lane[-1].end <= span.start), None)
        if free is None:
            lanes.append([span])
        else:
            free.append(span)
    return lanes


def _label(track: Track) -> str:
    if track.mesh == CONTROLLER:
        return CONTROLLER
    return f"{track.mesh} {track.index}" if track.role == track.mesh else f"{track.role} ({track.mesh} {track.index})"
