"""``python -m mesh.report RUN_DIR [--no-plot]``: one screen about a run, and its curves in ``RUN_DIR/report.png``.

A run directory holds everything needed to judge a run, spread over files written for other readers
(``metrics.jsonl`` for programs, ``events.jsonl`` for ``mesh.ctl``, ``error.log`` for a traceback). This
reads them all and says, on one screen, what a person asks first: is it live, finished, stopped or failed,
how far it got, whether the reward rose, where a step's time goes, whether anything failed or changed,
and what it saved. It reads only; it starts nothing and needs no torch, so it is quick on a live run.

The state comes from what is in the directory: ``final/`` present is finished; ``control/pid`` naming a
process that is still the run's (``actors.procs.alive_since``) is live (``live?`` when it is on another
host); an ``error.log`` entry for the end of the run is failed; every step trained but no ``final/`` yet is
``finishing?`` (the run exports it after closing its channel, and an export that fails is not in error.log);
anything else stopped (a signal, or a kill). A DiLoCo parent (``replicas/``, see ``mesh/replicas.py``) gets
a row per replica and each replica's curves in ``report.png``.

A live run may be writing a line of ``metrics.jsonl`` as it is read: a last line that is not whole is
left for the next report. A run from an older version lacks some keys: what is missing shows as ``-``. A run
that evaluated its initial weights (``loop.evaluation.at_start``) has a row for step -1 holding that
evaluation alone: it counts as an evaluation ("at start"), never as a step.

Exit codes: 0 the report was printed, also for a run with no finished step yet (it says so: a run that
is starting is not an error); 2 nothing could be reported (the directory is missing, is not a run
directory, or a file in it cannot be read or parsed), one line on stderr naming the cause and the fix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

from actors.procs import alive_since
from mesh.commands import CONTROL, EVENTS
from mesh.interrupts import CHECKPOINT_NAME
from mesh.rundir import ERROR_LOG, METRICS_FILE, REWARD_KEY, draw, pyplot

REPORT_PNG = "report.png"
REPLICAS = "replicas"
WIDTH = 100  # columns of the printed report
EDGE = 0.1  # the share of steps the reward's start and end are averaged over
LAST_CHANGES = 3  # teacher changes listed
STAGES = ("generate", "reward", "teachers", "train", "weight_sync", "reference", "wait_for_batch")
OPTIONAL_STAGES = ("reference",)  # logged only by runs that have one: left out rather than shown as "-"
STOPPED_ENTRY = re.compile(r"^== \S+ \S+ the run stopped")  # runtime's error.log title of the run's end
KL_KEYS = {"train/policy/kl": "KL to the reference", "train/policy/mismatch_k3": "trainer vs sampler (k3)"}
CHANNEL_LOSSES = ("train/policy/loss", "train/distill/loss", "train/preference/loss")


class ReportError(Exception):
    """Nothing can be reported; ``str()`` is one line naming the cause and the fix (exit 2)."""


@dataclass(frozen=True)
class State:
    """How the run stands: ``word`` is live, finished, failed or stopped; ``detail`` says how that is known."""

    word: str
    detail: str


@dataclass
class Run:
    """One run directory, as read."""

    path: Path
    records: list[dict]  # metrics.jsonl, one per step (and step -1's, the initial weights' evaluation)
    events: list[dict]  # events.jsonl
    topology: dict
    checkpoints: list[Path]  # whole ones, oldest first

    @cached_property
    def state(self) -> State:
        return _state(self)

    @property
    def planned(self) -> int | None:
        """The run's loop.steps, when its topology.yaml says."""
        steps = (self.topology.get("loop") or {}).get("steps")
        return steps if isinstance(steps, int) else None

    @property
    def done(self) -> int:
        return self.records[-1]["step"] + 1 if self.records else 0

    @property
    def trained(self) -> list[dict]:
        """The rows of trained steps (without step -1's evaluation of the initial weights)."""
        return [r for r in self.records if r["step"] >= 0]

    def values(self, key: str) -> list[float]:
        """The finite numbers logged under ``key``, in step order (a null, a text or a missing key skipped)."""
        return [r[key] for r in self.records if _number(r.get(key))]

    def median(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.median(values) if values else None

    @property
    def faults(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "fault"]

    @property
    def teacher_changes(self) -> list[dict]:
        """``mesh.ctl``'s commands, applied or rejected (their events carry a verb, a fault's does not)."""
        return [e for e in self.events if "verb" in e]


@dataclass
class Parent:
    """A DiLoCo run's parent directory: its replicas' runs, labelled r<I>."""

    path: Path
    replicas: dict[str, Run]

    @property
    def state(self) -> State:
        """The replicas' states, summed up: live while any is, finished when all are."""
        words = {run.state.word for run in self.replicas.values()}
        if not self.replicas:
            return State("not started", "no replica has made its run directory yet (see replica_<I>.log)")
        for going in ("live", "live?", "finishing?"):
            if going in words:
                return State(going, ", ".join(label for label, run in self.replicas.items() if run.state.word == going))
        if words == {"finished"}:
            return State("finished", "every replica finished")
        failed = [label for label, run in self.replicas.items() if run.state.word == "failed"]
        if failed:
            return State("failed", f"{', '.join(failed)} failed (below)")
        return State("stopped", "no replica is live and not all finished")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        found = load(args.run_dir)
        lines = parent_lines(found) if isinstance(found, Parent) else run_lines(found)
        plotted = _plot(found) if not args.no_plot else None
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if plotted is not None:
        lines.append(plotted)
    try:
        print("\n".join(_fit(line) for line in lines), flush=True)
    except BrokenPipeError:  # piped into head or a pager that stopped reading: it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mesh.report", description="One screen about a run; its curves in RUN_DIR/report.png."
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory python -m mesh.run printed")
    parser.add_argument("--no-plot", action="store_true", help="print only; do not write report.png")
    return parser


# Reading


def load(path: Path) -> Run | Parent:
    """The run (or DiLoCo parent) in ``path``; a ReportError when there is none or it cannot be read."""
    if not path.exists():
        raise ReportError(f"{path} does not exist; give the directory python -m mesh.run printed as 'run directory:'")
    if not path.is_dir():
        raise ReportError(f"{path} is a file, not a run directory; give the directory that holds {METRICS_FILE}")
    if (path / REPLICAS).is_dir():
        runs: dict[str, Run] = {}
        for replica in sorted(p for p in _listed(path / REPLICAS) if p.is_dir()):
            label = _replica_label(replica)
            runs[label if label not in runs else replica.name] = load_run(replica)  # a replica started twice
        return Parent(path, runs)
    if not any((path / name).exists() for name in (METRICS_FILE, "topology.yaml")):
        raise ReportError(
            f"{path} is not a run directory (it has no {METRICS_FILE}, topology.yaml or {REPLICAS}/); give the "
            "directory python -m mesh.run printed as 'run directory:', e.g. runs/tiny-20261121-101500"
        )
    return load_run(path)


def load_run(path: Path) -> Run:
    records = read_jsonl(path / METRICS_FILE)
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("step"), int):
            raise ReportError(f"{path / METRICS_FILE} line {number} has no integer 'step'; {_REPAIR}")
    checkpoints = sorted(
        (p for p in _listed(path / "checkpoints") if CHECKPOINT_NAME.fullmatch(p.name)),
        key=lambda p: int(p.name.removeprefix("step_")),
    )
    return Run(path, records, read_jsonl(path / EVENTS), _topology(path), checkpoints)


_REPAIR = "the file was edited or damaged: repair or delete that line and run the report again"


def read_jsonl(path: Path) -> list[dict]:
    """Every JSON object in ``path`` (none when it is missing). A last line that is not whole is a live
    run's write in progress and is left out; a bad line anywhere else is a ReportError naming it."""
    text = _read(path)
    if text is None:
        return []
    lines = text.split("\n")
    partial = lines.pop()  # "" after a final newline
    records = [_object(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    try:
        tail = json.loads(partial) if partial.strip() else None
    except ValueError:
        tail = None  # being written
    return records + [tail] if isinstance(tail, dict) else records


def _object(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ReportError(f"{path} line {number} is not JSON ({error}); {_REPAIR}") from None
    if not isinstance(record, dict):
        raise ReportError(f"{path} line {number} is not a JSON object; {_REPAIR}")
    return record


def _read(path: Path) -> str | None:
    """The text of ``path``, None when it does not exist; any other failure is a ReportError."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except PermissionError:
        raise ReportError(
            f"cannot read {path}: permission denied; run the report as the run's owner, or ask them for read access"
        ) from None
    except OSError as error:
        cause = error.strerror or str(error)
        raise ReportError(f"cannot read {path}: {cause}; check the file and run the report again") from None


def _listed(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError:
        raise ReportError(f"cannot list {folder}: permission denied; run the report as the run's owner") from None


def _topology(path: Path) -> dict:
    text = _read(path / "topology.yaml")
    try:
        topology = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as error:
        raise ReportError(f"{path / 'topology.yaml'} is not YAML ({str(error).splitlines()[0]}); {_REPAIR}") from None
    return topology if isinstance(topology, dict) else {}


def _replica_label(path: Path) -> str:
    """``r<I>`` from a replica's run directory ``<name>-r<I>-<time>``, else the directory's name."""
    found = re.search(r"-(r\d+)-\d{8}-\d{6}", path.name)
    return found.group(1) if found else path.name


def _state(run: Run) -> State:
    path = run.path
    if (path / "final").is_dir():
        return State("finished", "final/ holds the trained policy")
    live = _process(path)
    if live is not None:
        return live
    ended = _stopped_entry(path)
    if ended is not None:
        return State("failed", ended)
    if run.planned is not None and run.done >= run.planned and run.checkpoints:
        return State(  # the run closes its channel, then exports final/; an export that fails is not in error.log
            "finishing?", "all steps trained, final/ not yet written: exporting it, or the export failed"
        )
    return State("stopped", "not live, no final/ and no failure in error.log: a signal or a kill stopped it")


def _process(path: Path) -> State | None:
    """Live, when control/pid names a process that is still the run's; stopped, when it names one that is gone
    (the run did not close its channel: killed); None when there is no control/pid (the run closed it)."""
    pid_file = path / CONTROL / "pid"
    try:
        owner = json.loads(pid_file.read_text())
        written = pid_file.stat().st_mtime
    except FileNotFoundError:
        return None
    except PermissionError:
        return State("live?", f"{CONTROL}/ is readable by the run's owner only, who can tell whether it is live")
    except ValueError:
        owner = None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or owner["pid"] <= 0 or "host" not in owner:
        raise ReportError(f"{pid_file} is not the run's {{'pid', 'host'}}; {_REPAIR}")
    if owner["host"] != socket.gethostname():
        return State("live?", f"control/pid names process {owner['pid']} on {owner['host']}, not checkable here")
    if alive_since(owner["pid"], written):
        return State("live", f"process {owner['pid']} on {owner['host']}")
    return State("stopped", f"its process {owner['pid']} is gone without closing the run (killed, or the host died)")


def _stopped_entry(path: Path) -> str | None:
    """The cause error.log gives for the run's end (the line after the runtime's 'the run stopped' title)."""
    lines = (_read(path / ERROR_LOG) or "").splitlines()
    titles = [i for i, line in enumerate(lines) if STOPPED_ENTRY.match(line)]
    if not titles:
        return None  # only faults the run absorbed
    cause = lines[titles[-1] + 1] if titles[-1] + 1 < len(lines) else ""
    return f"{cause} (traceback in {ERROR_LOG})"


# The text


def run_lines(run: Run) -> list[str]:
    lines = [_run_line(run.path), f"state     {run.state.word}: {run.state.detail}"]
    if not run.trained:
        evaluated = _eval(run) if run.records else []  # the initial weights', before the first step
        return [*lines, "steps     no step has finished yet", *evaluated, *_saved(run)]
    lines += [_steps(run), _reward(run), *_eval(run), f"samples/s {_fmt(run.median('samples_per_s'), '.1f')} (median)"]
    lines += [_age(run), *_diloco(run), *_stages(run), *_faults(run), *_teachers(run), *_saved(run)]
    return lines


def _steps(run: Run) -> str:
    first = run.trained[0]["step"]
    resumed = f", resumed at step {first}" if first else ""
    warm = sum(1 for r in run.records if r.get("warm_start"))
    warm_note = f"; {warm} warm-start step{'s' * (warm != 1)}" if warm else ""
    took = _fmt(sum(run.values("time/step")) if run.values("time/step") else None, ".1f")
    return f"steps     {run.done} of {_fmt(run.planned, 'd')}{resumed}{warm_note}; {took} s of steps in all"


def _edges(values: list[float]) -> tuple[float, float, int] | None:
    """The mean of the first and of the last ``EDGE`` share of ``values`` (at least one each), and that count."""
    if not values:
        return None
    n = max(1, round(len(values) * EDGE))
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:]), n


def _reward(run: Run) -> str:
    mean, exact = _edges(run.values(REWARD_KEY)), _edges(run.values("reward/exact"))
    if mean is None:
        return "reward    -"
    start, end, n = mean
    line = f"reward    {start:.3f} -> {end:.3f} (mean of the first and last {n} step{'s' * (n != 1)})"
    return line + (f"; exact {exact[0]:.3f} -> {exact[1]:.3f}" if exact else "")


def _eval(run: Run) -> list[str]:
    """The held-out evaluations' best and last reward, and their accuracy where it is logged."""
    reward, accuracy = _best_and_last(run, "eval/reward"), _best_and_last(run, "eval/accuracy")
    lines = [f"eval      {reward or '-'}"]
    return lines + ([f"accuracy  {accuracy} (eval: share exactly right)"] if accuracy else [])


def _best_and_last(run: Run, key: str) -> str | None:
    evals = [r for r in run.records if _number(r.get(key))]
    if not evals:
        return None
    best, last = max(evals, key=lambda r: r[key]), evals[-1]
    return f"best {best[key]:.3f} ({_when(best)}), last {last[key]:.3f} ({_when(last)}), {len(evals)} in all"


def _when(record: dict) -> str:
    return "at start" if record["step"] < 0 else f"step {record['step']}"


def _age(run: Run) -> str:
    means, maxes = run.values("policy_age/mean"), run.values("policy_age/max")
    mean = statistics.fmean(means) if means else None
    return f"policy age mean {_fmt(mean, '.2f')}, max {_fmt(max(maxes) if maxes else None, 'g')} (steps behind)"


def _diloco(run: Run) -> list[str]:
    rounds = run.values("diloco/round")
    if not rounds:
        return []
    sync = _fmt(run.median("diloco/sync_s"), ".2f")
    return [f"diloco    {len(rounds)} rounds, the last {max(rounds):g}; a sync takes {sync} s (median)"]


def _stage_keys(runs: list[Run]) -> list[str]:
    """The stages to show: every one, but a stage only some runs have (a reference) only when one logs it."""
    return [s for s in STAGES if s not in OPTIONAL_STAGES or any(run.values(f"time/{s}") for run in runs)]


def _share(run: Run, stage: str) -> tuple[float | None, float | None]:
    """A stage's median seconds and its share of the median step."""
    seconds, step = run.median(f"time/{stage}"), run.median("time/step")
    return seconds, (seconds / step if seconds is not None and step else None)


OVERLAP = "stages overlap: the next batch is sampled while this one trains, so shares can sum past 100%"


def _stages(run: Run) -> list[str]:
    if not any(run.values(f"time/{stage}") for stage in (*STAGES, "step")):
        return ["time      -"]
    step = _fmt(run.median("time/step"), ".3f")
    lines = [f"time      a step takes {step} s (median); each stage's median and its share of that:"]
    for stage in _stage_keys([run]):
        seconds, share = _share(run, stage)
        lines.append(f"  {stage:<16}{_fmt(seconds, '8.3f')} s {_fmt(share, '5.0%')}")
    return [*lines, f"  {OVERLAP}"]


def _faults(run: Run) -> list[str]:
    faults = run.faults
    restarts, lost = run.values("faults/restarts"), run.values("faults/seconds_lost")
    if not faults and not any(restarts):
        return ["faults    none"]
    counts = f"{len(faults)} ({_fmt(restarts[-1] if restarts else None, 'g')} restarts, "
    counts += f"{_fmt(lost[-1] if lost else None, '.1f')} s lost)"
    return [f"faults    {counts}", *([f"  last: {_fault(faults[-1])}"] if faults else [])]


def _fault(event: dict) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event["time"])) if _number(event.get("time")) else "-"
    return f"{when} {event.get('actor', '-')} in {event.get('endpoint', '-')}: {event.get('cause', '-')}"


def _teachers(run: Run) -> list[str]:
    changes = run.teacher_changes
    if not changes:
        return ["teachers  no changes"]
    shown = changes[-LAST_CHANGES:]
    head = f"teachers  {len(changes)} change{'s' * (len(changes) != 1)}" + (
        f", the last {len(shown)}:" if len(changes) > len(shown) else ":"
    )
    return [head, *(f"  {_change(e)}" for e in shown)]


def _change(event: dict) -> str:
    said = f": {event['message']}" if event.get("status") == "rejected" and event.get("message") else ""
    what = " ".join(str(event.get(key, "-")) for key in ("verb", "name", "status"))
    return f"step {event.get('step', '-')} {what}{said}"


def _saved(run: Run) -> list[str]:
    final = "; final/ (the trained policy)" if (run.path / "final").is_dir() else ""
    return [f"saved     {_checkpoint(run)}{final}"]


def _checkpoint(run: Run) -> str:
    return f"checkpoints/{run.checkpoints[-1].name} ({len(run.checkpoints)} kept)" if run.checkpoints else "none"


# A DiLoCo parent's text


def parent_lines(parent: Parent) -> list[str]:
    state = parent.state
    lines = [_run_line(parent.path), f"state     {state.word}: {state.detail}"]
    if not parent.replicas:
        return lines
    lines.append(f"replicas  {len(parent.replicas)} (DiLoCo), a row each:")
    lines.append(
        f"{'replica':<8}{'state':<10}{'steps':>9}  {'reward start -> end':<20}{'eval best/last':<16}"
        f"{'samples/s':>9}  {'age mean/max':<13}{'rounds':>6}"
    )
    lines += [_replica_row(label, run) for label, run in parent.replicas.items()]
    lines += ["", *_stage_table(parent), ""]
    for label, run in parent.replicas.items():
        lines += _replica_notes(label, run)
    return lines


def _replica_row(label: str, run: Run) -> str:
    reward = _edges(run.values(REWARD_KEY))
    rewards = f"{reward[0]:.3f} -> {reward[1]:.3f}" if reward else "-"
    evals = run.values("eval/reward")
    evaluated = f"{max(evals):.3f} / {evals[-1]:.3f}" if evals else "-"
    means, maxes = run.values("policy_age/mean"), run.values("policy_age/max")
    age = f"{statistics.fmean(means):.2f} / {max(maxes):g}" if means and maxes else "-"
    steps = f"{run.done}/{_fmt(run.planned, 'd')}"
    return (
        f"{label:<8}{run.state.word:<10}{steps:>9}  {rewards:<20}{evaluated:<16}"
        f"{_fmt(run.median('samples_per_s'), '9.1f')}  {age:<13}{len(run.values('diloco/round')):>6}"
    )


SHORT = {"weight_sync": "sync", "wait_for_batch": "wait", "reference": "ref", "generate": "gen"}


def _stage_table(parent: Parent) -> list[str]:
    runs = list(parent.replicas.values())
    stages = _stage_keys(runs)
    lines = ["median s (share of a step)", f"{'':<8}{'step':>7}" + "".join(f"{SHORT.get(s, s):>11}" for s in stages)]
    for label, run in parent.replicas.items():
        cells = [f"{_fmt(seconds, '.3f')} {_fmt(share, '.0%')}" for seconds, share in (_share(run, s) for s in stages)]
        lines.append(f"{label:<8}{_fmt(run.median('time/step'), '7.3f')}" + "".join(f"{c:>11}" for c in cells))
    return [*lines, OVERLAP]


def _replica_notes(label: str, run: Run) -> list[str]:
    changes = len(run.teacher_changes)
    lines = [f"{label:<8}{run.state.word}: {run.state.detail}"]
    lines.append(f"{'':<8}faults {len(run.faults)}, teacher changes {changes}; saved {_checkpoint(run)}")
    if accuracy := _best_and_last(run, "eval/accuracy"):
        lines.append(f"{'':<8}eval accuracy {accuracy}")
    return lines + ([f"{'':<8}last fault: {_fault(run.faults[-1])}"] if run.faults else [])


# report.png


def _plot(found: Run | Parent) -> str:
    """Draw report.png into the run directory; the line saying where it is, or why it was not drawn."""
    runs = found.replicas if isinstance(found, Parent) else {found.path.name: found}
    out = found.path / REPORT_PNG
    if not any(run.records for run in runs.values()):
        return "plot      not drawn: no step has finished yet"
    failed = draw(out, lambda path: plot_runs(runs, path))
    return f"plot      {out}" if failed is None else f"plot      {failed.removeprefix('warning: ')}"


def plot_runs(runs: dict[str, Run], out: Path) -> None:
    """A grid of the runs' curves, one colour per run: reward, loss, KL, entropy, policy age, time by stage."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), dpi=100)
    several = len(runs) > 1
    _reward_panel(axes[0][0], runs)
    loss = {"train/loss": "loss"} | ({} if several else _channel_losses(next(iter(runs.values()))))
    _lines(axes[0][1], "loss", runs, loss)
    _lines(axes[0][2], "KL", runs, KL_KEYS)
    _lines(axes[1][0], "entropy (policy samples)", runs, {"train/policy/entropy": "entropy"})
    _lines(axes[1][1], "policy age (steps behind)", runs, {"policy_age/mean": "mean", "policy_age/max": "max"})
    (_stage_bars if several else _stage_lines)(axes[1][2], runs)
    fig.suptitle(out.parent.name + (f" ({len(runs)} replicas)" if several else ""), fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)


STYLES = ("-", "--", ":", "-.")


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it was logged; a null is NaN, so the line has a gap there."""
    rows = [r for r in run.records if key in r]
    return [r["step"] for r in rows], [r[key] if _number(r[key]) else math.nan for r in rows]


def _lines(ax, title: str, runs: dict[str, Run], keys: dict[str, str]) -> bool:
    """One line per run and logged key (colour: the run, or the key for one run; style: the key, so lines
    that coincide, e.g. a policy age's mean and max, stay apart);
    'not logged' when no run has a value for any. Returns whether anything was drawn."""
    named = len(keys) > 1  # a panel of several keys names the key even when only one was logged
    keys = {key: name for key, name in keys.items() if any(run.values(key) for run in runs.values())}
    for i, (label, run) in enumerate(runs.items()):
        for j, (key, name) in enumerate(keys.items()):
            steps, values = _series(run, key)
            if len(runs) > 1:  # the colour tells the run
                color, legend = f"C{i}", f"{label} {name}" if named else label
            else:
                color, legend = f"C{j}", name
            ax.plot(steps, values, STYLES[j % len(STYLES)], color=color, lw=1.2, label=legend)
    _finish(ax, title, bool(keys))
    return bool(keys)


def _finish(ax, title: str, drawn: bool) -> None:
    ax.set_title(title, fontsize=10)
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    from matplotlib.ticker import MaxNLocator  # loaded with pyplot, which drawing has loaded already

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _reward_panel(ax, runs: dict[str, Run]) -> None:
    """Mean reward, the eval points on it and their accuracy (each run's colour), the DiLoCo rounds and a warm
    start marked."""
    drawn = _lines(ax, "reward", runs, {REWARD_KEY: "mean reward"})
    for i, run in enumerate(runs.values()):
        color = "C1" if len(runs) == 1 else f"C{i}"
        for key, marker, name in (("eval/reward", "o", "eval"), ("eval/accuracy", "s", "eval accuracy")):
            steps, values = _series(run, key)
            if steps:
                ax.plot(steps, values, marker, color=color, ms=5, mfc="white", label=name if i == 0 else None)
        synced = [r for r in run.records if "diloco/round" in r and _number(r.get(REWARD_KEY))]
        ax.plot([r["step"] for r in synced], [r[REWARD_KEY] for r in synced], ".", color=f"C{i}", ms=5)
        warm = [r["step"] for r in run.records if r.get("warm_start")]
        if warm and len(runs) == 1:
            ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="orange", alpha=0.15, label="warm start")
    if any(run.values("diloco/round") for run in runs.values()):
        ax.plot([], [], ".", color="gray", label="after a DiLoCo sync")
    if drawn:
        ax.legend(fontsize=7)


def _channel_losses(run: Run) -> dict[str, str]:
    """Each loss channel's own curve, when more than one channel trains (else it equals the loss)."""
    logged = [key for key in CHANNEL_LOSSES if run.values(key)]
    return {key: key.split("/")[1] for key in logged} if len(logged) > 1 else {}


def _stage_lines(ax, runs: dict[str, Run]) -> None:
    """One run: each stage's seconds per step, and the whole step."""
    (run,) = runs.values()
    drawn = False
    for j, stage in enumerate([*_stage_keys([run]), "step"]):
        steps, values = _series(run, f"time/{stage}")
        if any(math.isfinite(v) for v in values):
            color, style = ("black", "--") if stage == "step" else (f"C{j}", "-")
            ax.plot(steps, values, style, color=color, lw=1.2, label="whole step" if stage == "step" else stage)
            drawn = True
    _finish(ax, "seconds per step, by stage", drawn)


def _stage_bars(ax, runs: dict[str, Run]) -> None:
    """Several runs: each stage's median seconds, a bar per run."""
    stages = [*_stage_keys(list(runs.values())), "step"]
    width = 0.8 / len(runs)
    drawn = False
    for i, (label, run) in enumerate(runs.items()):
        medians = [run.median(f"time/{s}") for s in stages]
        drawn = drawn or any(m is not None for m in medians)
        xs = [k + i * width for k in range(len(stages))]
        ax.bar(xs, [m or 0.0 for m in medians], width, color=f"C{i}", label=label)
    _finish(ax, "median seconds per step, by stage", drawn)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(stages))], [SHORT.get(s, s) for s in stages], fontsize=8)
    ax.set_xlabel("")


# Helpers


def _number(value: object) -> bool:
    """A finite number (JSON's null, text and booleans are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float | int | None, spec: str) -> str:
    """``value`` in ``spec``, or ``-`` (as wide) when it is missing."""
    if value is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width)) if width else "-"
    return format(value, spec)


def _run_line(path: Path) -> str:
    """The run's path, its start cut when too long: its end names the run."""
    shown = str(path)
    return "run       " + (shown if len(shown) <= WIDTH - 10 else "..." + shown[-(WIDTH - 13) :])


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
