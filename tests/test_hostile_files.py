"""What a run directory or a checkpoint holds in place of a file: a named pipe, a link to /dev/zero or out of
the directory, a line that never ends, a number no process has. Before, a pipe or /dev/zero hung
``mesh.export``, ``--resume --dry-run`` (checksumming), ``mesh.report`` and ``mesh.ctl``; a huge pid, a byte
that is not UTF-8 or a line nested past Python's stack ended in a traceback. Every reader now opens regular
files only (``actors.basics.disk.open_regular``), without following a link, reads within a bound, and refuses the
rest in one paragraph. Each case runs under an alarm: a reader that waits fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_runs import TINY

from actors.basics.disk import RefusedFile, lines, open_regular, read_regular
from actors.inner_loops.checkpoint import CheckpointError, checkpoint_state, save_checkpoint
from actors.models.safetensors_header import header_shapes
from mesh import ctl, export, report
from mesh.records import readers
from mesh.records.layout import MAX_PID
from mesh.run import dry_run

HANG_S = 20  # each of these answers in well under a second; an open or read that waits is what fails


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    def hung(signum, frame):
        raise AssertionError(f"still waiting after {HANG_S} s: a reader blocked on what is not a regular file")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def link(path: Path, target: str | Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    return path


INSTEAD = {  # what a hostile writer puts where a file belongs, and how the refusal names it
    "a named pipe": (fifo, "a named pipe (FIFO), not a regular file"),
    "a link to /dev/zero": (lambda path: link(path, "/dev/zero"), "a symbolic link, not a regular file"),
    "a link out of the directory": (lambda path: link(path, "/etc/hostname"), "a symbolic link, not a regular file"),
}


# ----------------------------------------------------------------------------- the helper


def test_the_helper_opens_regular_files_only_and_reads_within_its_bound(tmp_path):
    (tmp_path / "file").write_bytes(b"a\nbb\n" + b"c" * 10)
    assert read_regular(tmp_path / "file") == b"a\nbb\n" + b"c" * 10
    with pytest.raises(RefusedFile, match="15 B, more than the 14 B such a file can be"):
        read_regular(tmp_path / "file", 14)
    with open_regular(tmp_path / "file") as file, pytest.raises(RefusedFile, match="line 3 is longer than 9 B"):
        assert list(lines(file, 9))[:2] == [b"a\n", b"bb\n"]
    assert read_regular(link(tmp_path / "to-file", tmp_path / "file"), follow_links=True).startswith(b"a\n")
    (tmp_path / "folder").mkdir()
    cases = {name: make(tmp_path / f"instead-{i}") for i, (name, (make, _)) in enumerate(INSTEAD.items())}
    cases["a directory"] = tmp_path / "folder"
    for name, path in cases.items():
        with pytest.raises(RefusedFile, match="not a regular file"):
            read_regular(path)
    with pytest.raises(RefusedFile, match="a character device, not a regular file"):  # a link is followed when asked
        read_regular(cases["a link to /dev/zero"], follow_links=True)


def test_a_safetensors_header_is_read_from_a_regular_file_only(tmp_path):
    """``--resume`` and ``mesh.export`` check a checkpoint's tensors (and a base's) by their safetensors headers."""
    with pytest.raises(ValueError, match=r"a named pipe \(FIFO\), not a regular file"):
        header_shapes(fifo(tmp_path / "model.safetensors"))


# ----------------------------------------------------------------------------- checkpoints: export, resume


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A small checkpoint as ``save_checkpoint`` writes it (no policy: every case is refused before one is read)."""
    directory = tmp_path / "run" / "checkpoints" / "step_000001"
    optimizer = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    save_checkpoint(directory, {"w": torch.ones(4)}, optimizer, {"step": 1, "version": 1})
    return directory


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json", "checksums.json"])
@pytest.mark.parametrize("instead", INSTEAD)
def test_a_checkpoint_file_that_is_not_one_is_refused_by_export_and_resume(checkpoint, tmp_path, capsys, name, instead):
    make, said = INSTEAD[instead]
    make(checkpoint / name)
    with pytest.raises(CheckpointError) as caught:
        checkpoint_state(checkpoint)
    assert "\n" not in str(caught.value) and "resume from another checkpoint" in str(caught.value)
    assert f"{said}" in str(caught.value)
    assert export.main([str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "export another checkpoint" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert dry_run(str(TINY), [], str(checkpoint)) == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint {checkpoint}")


@pytest.mark.parametrize("listed", ["../../../etc/hostname", "/dev/zero", ".."])
def test_checksums_json_naming_a_file_outside_the_checkpoint_is_refused(checkpoint, listed):
    manifest = json.loads((checkpoint / "checksums.json").read_text())
    manifest["files"][listed] = "0" * 32
    (checkpoint / "checksums.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"names '{listed}', not a file of the checkpoint directory"):
        checkpoint_state(checkpoint)


# ----------------------------------------------------------------------------- mesh.report


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory with a topology, two steps of metrics, an event and an error.log entry."""
    run = tmp_path / "tiny-20261127-000000"
    (run / "control").mkdir(parents=True)
    (run / "topology.yaml").write_text("name: tiny\nloop: {steps: 2}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(2)))
    (run / "events.jsonl").write_text(json.dumps({"event": "fault", "actor": "generator", "time": 1.0}) + "\n")
    (run / "error.log").write_text("== 2026-11-27 02:14:30 fault: generator in generate\nProcessExited: died\n")
    return run


def refused_report(capsys, run: Path) -> str:
    assert report.main([str(run), "--no-plot"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl", "error.log", "topology.yaml", "control/pid"])
@pytest.mark.parametrize("instead", INSTEAD)
def test_a_run_file_that_is_not_one_is_refused_by_the_report(run_dir, capsys, name, instead):
    make, said = INSTEAD[instead]
    make(run_dir / name)
    err = refused_report(capsys, run_dir)
    assert f"cannot read {run_dir / name}: {said}, which a run never writes there; remove" in err


@pytest.mark.parametrize(
    "line, said",
    [
        (b'{"step": 2, "reward/mean": "\xff\xfe"}', None),  # not UTF-8 inside a text: shown replaced, not refused
        (b"[" * 100_000 + b"]" * 100_000, "line 3 is not JSON (nested too deeply)"),
        (b'{"step": 2, "' + b"x" * (readers.LONGEST_LINE + 1) + b'": 1}', "line 3 is longer than 1.0 MiB"),
        (b'{"step": 2, "samples_per_s": 1' + b"0" * 400 + b"}", None),  # a number past a float's range: skipped
    ],
)
def test_a_hostile_metrics_line_is_one_line_or_shown_harmlessly(run_dir, capsys, line, said):
    with (run_dir / "metrics.jsonl").open("ab") as file:
        file.write(line + b"\n")
    if said is None:
        assert report.main([str(run_dir), "--no-plot"]) == 0
        assert "steps     3 of 2" in capsys.readouterr().out
    else:
        assert said in refused_report(capsys, run_dir)


@pytest.mark.parametrize("pid", ["1" + "0" * 30, "1" + "0" * 5000, str(MAX_PID + 1), "0", "-1", "true", '"1"'])
def test_a_pid_no_process_can_have_is_one_paragraph_for_report_and_ctl(run_dir, capsys, pid):
    (run_dir / "control" / "pid").write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}"}}')
    (run_dir / "control" / "token").write_text("secret\n")
    assert f"{run_dir / 'control' / 'pid'} is not the run's {{'pid', 'host'}}" in refused_report(capsys, run_dir)
    assert ctl.main([str(run_dir), "teachers", "unbind", "big", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"a process id from 1 to {MAX_PID}" in err


# ----------------------------------------------------------------------------- mesh.ctl


@pytest.mark.parametrize("name", ["control/token", "control/pid", "teachers.json"])
@pytest.mark.parametrize("instead", INSTEAD)
def test_a_control_file_that_is_not_one_is_refused_by_ctl(run_dir, capsys, name, instead):
    (run_dir / "control" / "token").write_text("secret\n")
    (run_dir / "control" / "pid").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    (run_dir / "teachers.json").write_text("{}\n")
    make, said = INSTEAD[instead]
    make(run_dir / name)
    verb = ["list"] if name == "teachers.json" else ["unbind", "big", "--timeout", "1"]
    assert ctl.main([str(run_dir), "teachers", *verb]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and said in err


@pytest.mark.parametrize("text", ["[1, 2]", '{"big": "not a binding"}', "[" * 100_000, "\xff"])
def test_a_damaged_teachers_json_is_one_paragraph(run_dir, capsys, text):
    (run_dir / "teachers.json").write_bytes(text.encode("latin-1"))
    assert ctl.main([str(run_dir), "teachers", "list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'teachers.json'} is not the run's record of its teachers")


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_report_or_ctl_is_one_line_and_130(run_dir, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler: KeyboardInterrupt, as from a terminal
        raise AssertionError("SIGINT did not arrive")

    monkeypatch.setattr(report, "load", interrupted)
    assert report.main([str(run_dir)]) == 130
    assert capsys.readouterr().err == "stopped: SIGINT; the report was not printed\n"
    monkeypatch.setattr(ctl, "send", interrupted)
    assert ctl.main([str(run_dir), "teachers", "unbind", "big"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("stopped: SIGINT; a command the run had not taken yet was withdrawn") and err.count("\n") == 1
