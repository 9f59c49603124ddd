"""``python -m mesh.report``: one screen about a real run's directory (its numbers as in metrics.jsonl),
report.png drawn, every state told from the directory, and every directory it cannot report on one
line with exit 2."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import finished_tiny_run

from mesh.records import readers
from mesh.records.report import OVERLAP, REPORT_PNG, WIDTH
from mesh.report import main

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
SHORT = [
    f"loop.steps={STEPS}",
    "loop.prompts_per_step=4",
    "loop.group_size=4",
    "loop.warm_start.steps=1",
    "loop.evaluation.every=4",
    "loop.evaluation.prompts=8",
    "checkpointing.every=5",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The run directory of a 10-step run of tiny.yaml, run to its end."""
    return finished_tiny_run(tmp_path_factory.mktemp("runs"), SHORT)


@pytest.fixture
def copied(finished, tmp_path) -> Path:
    """A copy of the finished run's text files and checkpoints' names, without final/: a run that stopped."""
    run = tmp_path / "tiny-20261127-000000"
    run.mkdir()
    for name in ("metrics.jsonl", "topology.yaml", "plan.yaml"):
        shutil.copy(finished / name, run / name)
    for checkpoint in (finished / "checkpoints").iterdir():
        (run / "checkpoints" / checkpoint.name).mkdir(parents=True)
    return run


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def report(capsys, run: Path, *flags: str) -> list[str]:
    """The printed lines of a report that succeeds, each checked to fit the screen."""
    assert main([str(run), *flags]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and all(len(line) <= WIDTH for line in lines), [line for line in lines if len(line) > WIDTH]
    return lines


def line(lines: list[str], start: str) -> str:
    (found,) = [text for text in lines if text.startswith(start)]
    return found


def refused(capsys, run: Path | str) -> str:
    """The one line of a report that cannot be made: exit 2, nothing on stdout."""
    assert main([str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    return struct.unpack(">II", data[16:24])


def test_a_finished_run_on_one_screen_with_its_numbers(finished, capsys):
    lines = report(capsys, finished)
    rows = metrics(finished)
    assert len(lines) <= 40
    assert lines[0].startswith("run       ") and lines[0].endswith(finished.name)
    assert line(lines, "state").startswith("state     finished: final/")
    assert line(lines, "steps").startswith(f"steps     {STEPS} of {STEPS}; 1 warm-start step; ")
    first, last = rows[0]["reward/mean"], rows[-1]["reward/mean"]  # 10% of 10 steps: one step each
    assert line(lines, "reward").startswith(f"reward    {first:.3f} -> {last:.3f} (mean of the first and last 1 step)")
    evals = [r for r in rows if r.get("eval/reward") is not None]
    assert [r["step"] for r in evals] == [3, 7, 9]
    best = max(evals, key=lambda r: r["eval/reward"])
    assert line(lines, "eval") == (
        f"eval      best {best['eval/reward']:.3f} (step {best['step']}), "
        f"last {evals[-1]['eval/reward']:.3f} (step 9), 3 in all"
    )
    samples = statistics.median(r["samples_per_s"] for r in rows)
    assert line(lines, "samples/s") == f"samples/s {samples:.1f} (median)"
    step = statistics.median(r["time/step"] for r in rows)
    for stage in ("generate", "reward", "teachers", "train", "weight_sync", "wait_for_batch"):
        seconds = statistics.median(r[f"time/{stage}"] for r in rows)
        assert line(lines, f"  {stage} ").split() == [stage, f"{seconds:.3f}", "s", f"{seconds / step:.0%}"]
    assert not any(text.startswith("  reference") for text in lines)  # tiny.yaml has no reference
    assert f"  {OVERLAP}" in lines
    age = statistics.fmean(r["policy_age/mean"] for r in rows)
    assert line(lines, "policy age") == f"policy age mean {age:.2f}, max 1 (steps behind)"
    assert line(lines, "faults") == "faults    none" and line(lines, "teachers") == "teachers  no changes"
    assert line(lines, "saved") == "saved     checkpoints/step_000010 (2 kept); final/ (the trained policy)"
    assert lines[-1] == f"plot      {finished / REPORT_PNG}"
    assert png_size(finished / REPORT_PNG) == (1300, 700)


def test_no_plot_writes_nothing_and_the_command_loads_no_torch(finished, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run", ignore=shutil.ignore_patterns(REPORT_PNG)))
    code = "import sys\nfrom mesh.report import main\n"
    code += f"assert main([{str(run)!r}, '--no-plot']) == 0\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1] == "False", result.stderr
    assert not any(text.startswith("plot") for text in lines) and not (run / REPORT_PNG).exists()
    command = [sys.executable, "-m", "mesh.report", str(tmp_path / "nowhere")]
    result = subprocess.run(command, capture_output=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stderr.count(b"\n") == 1 and result.stdout == b""
    command[-1:] = [str(run), "--no-plot"]
    reader_gone = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()  # as head does once it has its lines, long before the report is printed
    assert reader_gone.stderr.read() == b"" and reader_gone.wait(timeout=120) == 0


def test_what_is_not_a_run_directory_is_one_line_and_exit_2(tmp_path, capsys):
    err = refused(capsys, tmp_path / "nowhere")
    assert "nowhere does not exist; give the directory python -m mesh.run printed" in err
    (tmp_path / "a-file").write_text("")
    assert "a-file is a file, not a run directory" in refused(capsys, tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    err = refused(capsys, tmp_path / "empty")
    assert "empty is not a run directory (it has no metrics.jsonl, topology.yaml or replicas/)" in err


def test_a_last_line_being_written_is_left_out_and_a_bad_line_elsewhere_is_named(copied, capsys):
    whole = (copied / "metrics.jsonl").read_text()
    (copied / "metrics.jsonl").write_text(whole + '{"step": 10, "reward/mean": 0.9, "time/st')
    lines = report(capsys, copied, "--no-plot")
    assert line(lines, "steps").startswith(f"steps     {STEPS} of {STEPS};")
    assert line(lines, "state") == (  # every step trained, no final/: being exported, or the export failed
        "state     finishing?: all steps trained, no final/ yet: exporting it, or a kill stopped the export"
    )
    assert line(lines, "saved") == "saved     checkpoints/step_000010 (2 kept)"
    broken = whole.splitlines()
    broken[2] = broken[2][:40]
    (copied / "metrics.jsonl").write_text("\n".join(broken) + "\n")
    err = refused(capsys, copied)
    assert f"{copied / 'metrics.jsonl'} line 3 is not JSON (" in err and "repair or delete that line" in err
    (copied / "metrics.jsonl").write_text(whole + "[1, 2]\n")
    assert f"line {STEPS + 1} is not a JSON object" in refused(capsys, copied)
    (copied / "metrics.jsonl").write_text('{"reward/mean": 0.5}\n')
    assert "line 1 has no integer 'step'" in refused(capsys, copied)


def test_a_run_of_an_older_version_shows_what_it_has_and_dashes(tmp_path, capsys):
    run = tmp_path / ("deep" * 20) / "old-20250101-000000"
    run.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": 0.1 * s, "train/loss": 1.0 - 0.1 * s, "time/generate": 0.2} for s in range(4)]
    for s, seconds in enumerate([0.5, 0.5, 0.5, None]):  # a step's time that was not finite: null
        rows[s]["time/step"] = seconds
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = report(capsys, run)
    assert len(lines[0]) == WIDTH and lines[0].startswith("run       ...")  # a long path keeps its end
    assert lines[0].endswith("deep/old-20250101-000000")
    assert line(lines, "steps") == "steps     4 of -; 1.5 s of steps in all"  # no topology.yaml: no loop.steps
    assert line(lines, "reward") == "reward    0.000 -> 0.300 (mean of the first and last 1 step)"
    assert line(lines, "eval") == "eval      -" and line(lines, "samples/s") == "samples/s - (median)"
    assert line(lines, "policy age") == "policy age mean -, max - (steps behind)"
    assert line(lines, "time").startswith("time      a step takes 0.500 s (median)")
    assert line(lines, "  generate").split() == ["generate", "0.200", "s", "40%"]
    assert line(lines, "  teachers").split() == ["teachers", "-", "s", "-"]  # logged only by later versions
    assert line(lines, "saved") == "saved     none"
    png_size(run / REPORT_PNG)  # the panels with no data say "not logged"


def test_a_live_run_before_its_first_step(tmp_path, capsys):
    run = tmp_path / "tiny-20261127-000000"
    (run / "control").mkdir(parents=True)
    (run / "topology.yaml").write_text("name: tiny\nloop: {steps: 250}\n")
    (run / "control" / "pid").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    lines = report(capsys, run)
    assert lines[1] == f"state     live: process {os.getpid()} on {socket.gethostname()}"
    assert "steps     no step has finished yet" in lines
    assert lines[-1] == "plot      not drawn: no step has finished yet"
    assert not (run / REPORT_PNG).exists()


def test_the_gap_check_before_the_first_step_is_reported_and_is_not_a_step(copied, capsys):
    trained = (copied / "metrics.jsonl").read_text()
    checked = {"step": -1, "gap/problems": 16, "gap/student": 0.125, "gap/hinted": 0.375}
    (copied / "metrics.jsonl").write_text(json.dumps(checked) + "\n" + trained)
    lines = report(capsys, copied, "--no-plot")
    assert line(lines, "gap") == (
        "gap       +0.250 before training: the policy with its hint 0.375, the student 0.125 (16 problems)"
    )
    assert line(lines, "steps").startswith(f"steps     {STEPS} of {STEPS}; 1 warm-start step; ")  # not resumed at -1
    (copied / "metrics.jsonl").write_text(json.dumps({"step": -1, "gap/problems": 0}) + "\n")
    lines = report(capsys, copied, "--no-plot")
    assert "steps     no step has finished yet" in lines
    assert line(lines, "gap") == "gap       none measured before training: the teacher hinted none of the problems checked"


def test_a_killed_run_and_a_failed_one_are_told_apart(copied, capsys):
    rows = (copied / "metrics.jsonl").read_text().splitlines(keepends=True)
    (copied / "metrics.jsonl").write_text("".join(rows[:6]))  # stopped at step 6 of 10
    gone = subprocess.Popen(["true"])
    gone.wait()
    (copied / "control").mkdir()
    (copied / "control" / "pid").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    lines = report(capsys, copied, "--no-plot")
    said = f"its process {gone.pid} is gone without closing the run (killed, or the host died)"
    assert lines[1] == f"state     stopped: {said}"
    (copied / "control" / "pid").write_text("{}")
    assert f"{copied / 'control' / 'pid'} is not the run's {{'pid', 'host'}}" in refused(capsys, copied)
    (copied / "control" / "pid").unlink()
    absorbed = "== 2026-11-27 02:14:30 fault: generator in generate\nProcessExited: died\ntraceback\n"
    (copied / "error.log").write_text(absorbed)
    lines = report(capsys, copied, "--no-plot")  # a fault the run absorbed is not its end
    said = "not live, no final/ and no failure in error.log: a signal or a kill stopped it"
    assert lines[1] == f"state     stopped: {said}"
    ended = "== 2026-11-27 02:15:00 the run stopped at step 9\nValueError: boom\ntraceback\n"
    (copied / "error.log").write_text(absorbed + ended)
    assert report(capsys, copied, "--no-plot")[1] == "state     failed: ValueError: boom (traceback in error.log)"


def test_faults_and_teacher_changes_come_from_events_jsonl(copied, capsys):
    rows = metrics(copied)
    rows[-1] |= {"faults/restarts": 2, "faults/seconds_lost": 3.25}
    (copied / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fault = {"event": "fault", "actor": "generator", "endpoint": "generate", "restart": 1, "seconds": 1.5}
    changes = [
        {"step": s, "time": 1.0, "verb": "bind", "name": f"t{s}", "spec": {"kind": "task_oracle"}, "status": "applied"}
        for s in (2, 4, 6)
    ]
    changes.append({"step": 8, "time": 1.0, "verb": "unbind", "name": "t9", "status": "rejected", "message": "no t9"})
    events = [fault | {"time": 1795745670.0, "cause": "ProcessExited: first"}, *changes[:2]]
    events += [fault | {"time": 1795745671.0, "cause": "ProcessExited: second"}, *changes[2:]]
    (copied / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = report(capsys, copied, "--no-plot")
    at = lines.index("faults    2 (2 restarts, 3.2 s lost)")
    assert lines[at + 1].startswith("  last: ")
    assert lines[at + 1].endswith("generator in generate: ProcessExited: second")
    at = lines.index("teachers  4 changes, the last 3:")
    shown = ["  step 4 bind t4 applied", "  step 6 bind t6 applied", "  step 8 unbind t9 rejected: no t9"]
    assert lines[at + 1 : at + 4] == shown


def test_a_diloco_parent_has_a_row_per_replica_and_their_curves(finished, tmp_path, capsys):
    parent = tmp_path / "tiny_diloco-20261127-000000"
    replicas = parent / "replicas"
    for i, steps in enumerate((STEPS, 6)):  # replica 1 stopped at step 6
        run = Path(shutil.copytree(finished, replicas / f"tiny_diloco-r{i}-20261127-00000{i}", ignore=_big))
        rows = metrics(run)[:steps]
        for r in rows:
            r["reward/mean"] += 0.1 * i
            if r["step"] % 2:
                r |= {"diloco/round": r["step"] // 2 + 1, "diloco/sync_s": 0.5}
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (parent / f"replica_{i}.log").write_text("")
    shutil.rmtree(replicas / "tiny_diloco-r1-20261127-000001" / "final")
    lines = report(capsys, parent)
    assert lines[0] == f"run       {parent}"
    assert lines[1] == "state     stopped: no replica is live and not all finished"
    assert lines[2] == "replicas  2 (DiLoCo), a row each:"
    rows = metrics(finished)
    for i, (state, steps, rounds) in enumerate([("finished", STEPS, 5), ("stopped", 6, 3)]):
        start, end = rows[0]["reward/mean"] + 0.1 * i, rows[steps - 1]["reward/mean"] + 0.1 * i
        row = line(lines, f"r{i}      {state} ").split()
        assert row[2:6] == [f"{steps}/{STEPS}", f"{start:.3f}", "->", f"{end:.3f}"] and row[-1] == str(rounds)
    assert OVERLAP in lines and len(lines) <= 40
    assert png_size(parent / REPORT_PNG) == (1300, 700)


def test_a_diloco_parent_before_its_replicas_made_their_directories(tmp_path, capsys):
    (tmp_path / "replicas").mkdir()
    lines = report(capsys, tmp_path)
    assert lines[1] == "state     not started: no replica has made its run directory yet (see replica_<I>.log)"


def test_a_file_that_cannot_be_read_is_one_line(copied, capsys):
    (copied / "events.jsonl").mkdir()
    assert f"cannot read {copied / 'events.jsonl'}: a directory, not a regular file" in refused(capsys, copied)


def test_a_file_of_another_user_is_one_line(copied, capsys, monkeypatch):
    """What a mode 0600 metrics.jsonl of another user raises (chmod would not stop root, who runs CI's containers)."""
    metrics_file, opened = copied / "metrics.jsonl", readers.open_regular

    def denied(path: Path):
        if path == metrics_file:
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path)

    monkeypatch.setattr(readers, "open_regular", denied)
    err = refused(capsys, copied)
    assert f"cannot read {metrics_file}: permission denied; run the report as the run's owner" in err


def _big(folder: str, names: list[str]) -> list[str]:
    """What a copy of a run leaves out: the weights (checkpoints keep their directories) and the report."""
    return [name for name in names if name.endswith((".safetensors", ".png")) or name == "tensorboard"]


def test_a_long_metrics_file_is_read_in_bounded_memory_and_steps_past_the_plan_are_flagged(tmp_path, capsys):
    """Two and a half times ``SAMPLE`` rows, the plan 100 steps: every count and sum exact, each key's points an
    even sample of at most ``SAMPLE``, and the rows past step 99 flagged (before: "steps 10240 of 100", unflagged,
    and every row held in memory as a dict)."""
    run = tmp_path / "tiny-20261127-000000"
    run.mkdir()
    (run / "topology.yaml").write_text("name: tiny\nloop: {steps: 100}\n")
    rows = 5 * readers.SAMPLE // 2
    with (run / "metrics.jsonl").open("w") as file:
        for s in range(rows):
            file.write(json.dumps({"step": s, "reward/mean": s / rows, "time/step": 0.5, "eval/reward": s % 7}) + "\n")
    lines = report(capsys, run, "--no-plot")
    assert line(lines, "steps") == f"steps     {rows} of 100; {0.5 * rows:.1f} s of steps in all"
    at = lines.index(line(lines, "  ! "))
    assert lines[at : at + 2] == [
        f"  ! {rows - 100} rows of metrics.jsonl past the plan's 100 steps (the last at step {rows - 1});",
        "    another run wrote to this directory, or the file was edited: the figures include them",
    ]
    assert lines[at + 2] == f"  {rows} rows: medians, the reward's start and end and the curves use every 4th step"
    last = f"last {(rows - 1) % 7:.3f} (step {rows - 1})"
    assert line(lines, "eval") == f"eval      best 6.000 (step 6), {last}, {rows} in all"  # exact, not sampled
    assert line(lines, "reward").startswith("reward    0.050 -> 0.950 (mean of the first and last 10% of the steps)")
    loaded = readers.load_run(run)
    assert all(len(series.steps) <= readers.SAMPLE for series in loaded.metrics.series.values())
    assert loaded.series("reward/mean").steps[:3] == [0, 4, 8]  # an even sample: every 4th row
