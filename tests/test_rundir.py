"""The run directory: made atomically, a bad --run-root is one line and exit 2 before anything
is spawned, and a full disk fails with its own message, never a second one from reward.png."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tmpfs import fill, tmpfs

from mesh.records import rundir
from mesh.records.rundir import RunDir, RunDirError, read_metrics
from mesh.run import main

TINY = Path(__file__).resolve().parent.parent / "topologies" / "tiny.yaml"


def test_runs_started_in_the_same_second_get_distinct_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "strftime", lambda _: "20260101-000000")
    start, made = threading.Barrier(8), []

    def create(i: int) -> None:
        start.wait()
        made.append(RunDir.create(tmp_path, "tiny", {"run": i}, tensorboard=False).path)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(p.name for p in made) == ["tiny-20260101-000000"] + [f"tiny-20260101-000000-{i}" for i in range(1, 8)]
    assert sorted(yaml.safe_load((p / "topology.yaml").read_text())["run"] for p in made) == list(range(8))


def test_missing_parents_of_the_run_root_are_made(tmp_path):
    run = RunDir.create(tmp_path / "a" / "b", "tiny", {}, tensorboard=False)
    assert run.path.parent == tmp_path / "a" / "b" and (run.path / "topology.yaml").is_file()


def run_root_error(capsys, run_root: Path) -> str:
    """``mesh.run``'s one-line error for a run of tiny.yaml under ``run_root`` (not a dry run); exit 2."""
    assert main([str(TINY), "--run-root", str(run_root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_run_root_that_cannot_hold_runs_exits_2_in_one_line(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert f"the run root {a_file} is a file, not a directory; point --run-root" in run_root_error(capsys, a_file)
    err = run_root_error(capsys, a_file / "runs")
    assert f"cannot create {a_file / 'runs'}: {a_file} is a file, not a directory" in err
    long = tmp_path / ("x" * 300)
    assert f"cannot create {long}: the name is too long for its filesystem" in run_root_error(capsys, long)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_read_only_run_root_exits_2_in_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", size="1m", read_only=True) as root:
        err = run_root_error(capsys, root / "runs")
    assert f"cannot create {root / 'runs'}: Read-only file system (EROFS)" in err
    assert "point --run-root (or the topology's logging.root) at a directory you can write" in err


def test_metrics_reach_jsonl_and_tensorboard(tmp_path):
    run = RunDir.create(tmp_path, "tiny", {}, tensorboard=True)
    run.log(0, {"reward/mean": 0.25, "note": "text", "loss": float("nan")})
    run.log(1, {"reward/mean": 0.5, "warm_start": True})
    assert [r["reward/mean"] for r in read_metrics(run.metrics_file)] == [0.25, 0.5]
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.25), (1, 0.5)]
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "warm_start"]
    assert run.close() is None and (run.path / "reward.png").stat().st_size > 0


def test_a_full_disk_fails_with_its_own_error_and_close_adds_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "disk") as disk:
        run = RunDir.create(disk, "tiny", {}, tensorboard=True)
        run.log(0, {"reward/mean": 0.25})
        fill(disk)
        with pytest.raises(RunDirError) as caught:
            try:
                run.log(1, {"reward/mean": 0.5, "padding": "x" * 5000})
            finally:
                warning = run.close()  # as the runtime's ``finally`` does: it must not replace the error
        message = str(caught.value)
        assert f"the metrics of step 1 could not be written to {run.metrics_file}" in message
        assert "No space left on device (ENOSPC; 0 B free on" in message and "then go on from the last" in message
        assert warning.startswith(f"warning: {run.path / 'reward.png'} was not drawn: No space left on device")
        assert capsys.readouterr().err == warning + "\n"
        assert not (run.path / "reward.png").exists()
        assert [r["step"] for r in read_metrics(run.metrics_file)] == [0]  # no half line left behind
        events = EventAccumulator(str(run.path / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("reward/mean")] == [0]


def test_a_run_directory_that_cannot_be_written_is_one_clear_error_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        (disk / "runs").mkdir()
        fill(disk)
        with pytest.raises(RunDirError, match="No space left on device.*free space there or point --run-root"):
            RunDir.create(disk / "runs", "tiny", {"name": "tiny"}, tensorboard=True)
        assert list((disk / "runs").iterdir()) == []


SHORT_BOUND = 1 << 20  # above the 100 000-deep line below


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda path: os.mkfifo(path), "named pipe"),
        (lambda path: path.symlink_to("/dev/zero"), "symbolic link"),
        (lambda path: path.write_bytes(b'{"step": 0}\n[1, 2]\n'), "the line at byte 12 is not a JSON object"),
        (lambda path: path.write_bytes(b"[" * 100_000 + b"\n"), "the line at byte 0 is not a JSON object"),
        (lambda path: path.write_bytes(b"1" * (SHORT_BOUND + 2)), "longer than"),
    ],
)
def test_a_rewind_refuses_a_metrics_file_the_run_did_not_write(tmp_path, monkeypatch, damage, said):
    monkeypatch.setattr(rundir, "LONGEST_ROW", SHORT_BOUND)  # the real bound is 256 MiB: not written for a test
    run = RunDir.create(tmp_path, "tiny", {}, tensorboard=False)
    damage(run.metrics_file)
    with pytest.raises(RunDirError, match=said) as refused:
        run.rewind(1)
    assert str(run.metrics_file) in str(refused.value) and "restore it from a copy" in str(refused.value)


def test_a_rewind_keeps_earlier_rows_and_drops_a_line_cut_by_a_kill(tmp_path):
    run = RunDir.create(tmp_path, "tiny", {}, tensorboard=False)
    run.metrics_file.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
    assert run.rewind(1) == [{"step": 1}]
    assert read_metrics(run.metrics_file) == [{"step": 0}]
