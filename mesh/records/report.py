"""The report on a run read back (``readers.py``): its lines of text, and its curves drawn in ``report.png``."""

from __future__ import annotations

import math
import re
import statistics
import time
from pathlib import Path

from mesh.records.figures import pyplot
from mesh.records.readers import (
    CHANNEL_LOSSES,
    GAP_KEYS,
    KL_KEYS,
    STAGES,
    Parent,
    Run,
    Series,
    finite_float,
)
from mesh.records.rundir import METRICS_FILE, REWARD_KEY, draw

REPORT_PNG = "report.png"
WIDTH = 100  # columns of the printed report
EDGE = 0.1  # the share of steps the reward's start and end are averaged over
OPTIONAL_STAGES = ("reference",)  # logged only by runs that have one: left out rather than shown as "-"




def run_lines(run: Run) -> list[str]:
    lines = [_run_line(run.path), f"state     {run.state.word}: {run.state.detail}"]
    metrics = run.metrics
    if metrics.first_trained is None:
        evaluated = [*_eval(run), *_gap(run)] if metrics.rows else []  # the initial weights', before the first step
        return [*lines, "steps     no step has finished yet", *evaluated, *_past_plan(run), *_saved(run)]
    lines += [_steps(run), *_past_plan(run), *_sampled(run), _reward(run), *_eval(run), *_gap(run)]
    lines += [f"samples/s {_fmt(run.median('samples_per_s'), '.1f')} (median)", _age(run), *_diloco(run)]
    lines += [*_stages(run), *_faults(run), *_teachers(run), *_saved(run)]
    return lines


def _steps(run: Run) -> str:
    first, warm = run.metrics.first_trained, run.metrics.warm
    resumed = f", resumed at step {first}" if first else ""
    warm_note = f"; {warm} warm-start step{'s' * (warm != 1)}" if warm else ""
    took = run.series("time/step")
    took_text = _fmt(took.total if took.count else None, ".1f")
    return f"steps     {run.done} of {_fmt(run.planned, 'd')}{resumed}{warm_note}; {took_text} s of steps in all"


def _past_plan(run: Run) -> list[str]:
    """A warning when metrics.jsonl has rows of steps the plan does not have: the figures count them."""
    past, planned = run.metrics.past_plan, run.planned
    if not past:
        return []
    return [
        f"  ! {past} row{'s' * (past != 1)} of {METRICS_FILE} past the plan's {planned} steps (the last at step "
        f"{run.metrics.latest});",
        "    another run wrote to this directory, or the file was edited: the figures include them",
    ]


def _sampled(run: Run) -> list[str]:
    """A note when a key has more rows than ``SAMPLE``: its median, start and end and curve use an even sample."""
    stride = max((series.stride for series in run.metrics.series.values()), default=1)
    if stride == 1:
        return []
    return [f"  {run.metrics.rows} rows: medians, the reward's start and end and the curves use every {stride}th step"]


def _edges(series: Series) -> tuple[float, float, str] | None:
    """The mean of the first and of the last ``EDGE`` share of the series' values (at least one each), and what
    that share is, in words."""
    values = series.values
    if not values:
        return None
    n = max(1, round(len(values) * EDGE))
    share = f"{n} step{'s' * (n != 1)}" if series.stride == 1 else f"{EDGE:.0%} of the steps"
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:]), share


def _reward(run: Run) -> str:
    mean, exact = _edges(run.series(REWARD_KEY)), _edges(run.series("reward/exact"))
    if mean is None:
        return "reward    -"
    start, end, share = mean
    line = f"reward    {start:.3f} -> {end:.3f} (mean of the first and last {share})"
    return line + (f"; exact {exact[0]:.3f} -> {exact[1]:.3f}" if exact else "")


def _eval(run: Run) -> list[str]:
    """The held-out evaluations' best and last reward, and their accuracy where it is logged."""
    reward, accuracy = _best_and_last(run, "eval/reward"), _best_and_last(run, "eval/accuracy")
    lines = [f"eval      {reward or '-'}"]
    return lines + ([f"accuracy  {accuracy} (eval: share exactly right)"] if accuracy else [])


def _gap(run: Run) -> list[str]:
    """The gap check before the first step (``loop.gap_check``): the initial policy's share exactly right, and its
    hinted self's, on the problems its self-hinting teacher hints."""
    problems, student, hinted = (_last(run, key) for key in GAP_KEYS)
    if problems is None:
        return []
    if student is None or hinted is None:
        return ["gap       none measured before training: the teacher hinted none of the problems checked"]
    shares = f"the policy with its hint {hinted:.3f}, the student {student:.3f} ({problems:g} problems)"
    return [f"gap       {hinted - student:+.3f} before training: {shares}"]


def _best_and_last(run: Run, key: str) -> str | None:
    evals = run.series(key)
    if not evals.count:
        return None
    (best, at), (last, then) = evals.best, evals.last
    return f"best {best:.3f} ({_when(at)}), last {last:.3f} ({_when(then)}), {evals.count} in all"


def _when(step: int) -> str:
    return "at start" if step < 0 else f"step {step}"


def _mean(run: Run, key: str) -> float | None:
    series = run.series(key)
    return series.total / series.count if series.count else None


def _most(run: Run, key: str) -> float | None:
    best = run.series(key).best
    return best[0] if best else None


def _age(run: Run) -> str:
    mean, most = _mean(run, "policy_age/mean"), _most(run, "policy_age/max")
    return f"policy age mean {_fmt(mean, '.2f')}, max {_fmt(most, 'g')} (steps behind)"


def _diloco(run: Run) -> list[str]:
    rounds = run.series("diloco/round")
    if not rounds.count:
        return []
    sync = _fmt(run.median("diloco/sync_s"), ".2f")
    return [f"diloco    {rounds.count} rounds, the last {rounds.best[0]:g}; a sync takes {sync} s (median)"]


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


def _last(run: Run, key: str) -> float | None:
    last = run.series(key).last
    return last[0] if last else None


def _faults(run: Run) -> list[str]:
    events = run.events
    restarts = _last(run, "faults/restarts")
    if not events.faults and not _most(run, "faults/restarts"):
        return ["faults    none"]
    lost = _fmt(_last(run, "faults/seconds_lost"), ".1f")
    counts = f"{events.faults} ({_fmt(restarts, 'g')} restarts, {lost} s lost)"
    return [f"faults    {counts}", *([f"  last: {_fault(events.last_fault)}"] if events.last_fault else [])]


def _fault(event: dict) -> str:
    when = finite_float(event.get("time"))
    shown = time.strftime("%H:%M:%S", time.localtime(when)) if when is not None and abs(when) < 1e11 else "-"
    return f"{shown} {event.get('actor', '-')} in {event.get('endpoint', '-')}: {event.get('cause', '-')}"


def _teachers(run: Run) -> list[str]:
    count, shown = run.events.changes, list(run.events.last_changes)
    if not count:
        return ["teachers  no changes"]
    head = f"teachers  {count} change{'s' * (count != 1)}"
    head += f", the last {len(shown)}:" if count > len(shown) else ":"
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
    reward = _edges(run.series(REWARD_KEY))
    rewards = f"{reward[0]:.3f} -> {reward[1]:.3f}" if reward else "-"
    best, last = _most(run, "eval/reward"), _last(run, "eval/reward")
    evaluated = f"{best:.3f} / {last:.3f}" if best is not None else "-"
    mean, most = _mean(run, "policy_age/mean"), _most(run, "policy_age/max")
    age = f"{mean:.2f} / {most:g}" if mean is not None and most is not None else "-"
    steps = f"{run.done}/{_fmt(run.planned, 'd')}" + ("!" if run.metrics.past_plan else "")
    return (
        f"{label:<8}{run.state.word:<10}{steps:>9}  {rewards:<20}{evaluated:<16}"
        f"{_fmt(run.median('samples_per_s'), '9.1f')}  {age:<13}{run.series('diloco/round').count:>6}"
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
    events = run.events
    lines = [f"{label:<8}{run.state.word}: {run.state.detail}", *(f"{'':<6}{text}" for text in _past_plan(run))]
    lines.append(f"{'':<8}faults {events.faults}, teacher changes {events.changes}; saved {_checkpoint(run)}")
    if accuracy := _best_and_last(run, "eval/accuracy"):
        lines.append(f"{'':<8}eval accuracy {accuracy}")
    return lines + ([f"{'':<8}last fault: {_fault(events.last_fault)}"] if events.last_fault else [])


# report.png


def plot(found: Run | Parent) -> str:
    """Draw report.png into the run directory; the line saying where it is, or why it was not drawn."""
    runs = found.replicas if isinstance(found, Parent) else {found.path.name: found}
    out = found.path / REPORT_PNG
    if not any(run.metrics.rows for run in runs.values()):
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
    series = run.series(key)
    return series.steps, series.points


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
        reward = dict(zip(*_series(run, REWARD_KEY)))
        synced = [step for step in run.series("diloco/round").steps if math.isfinite(reward.get(step, math.nan))]
        ax.plot(synced, [reward[step] for step in synced], ".", color=f"C{i}", ms=5)
        warm = run.metrics.warm_span
        if warm and len(runs) == 1:
            ax.axvspan(warm[0] - 0.5, warm[1] + 0.5, color="orange", alpha=0.15, label="warm start")
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


def fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."

