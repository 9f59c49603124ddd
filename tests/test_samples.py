"""The rollout recorder: samples.jsonl (``logging.samples``), written on the run directory's logging thread."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
import yaml
from tiny_runs import SHORT as TINY_SHORT
from tiny_runs import TINY
from tmpfs import tmpfs

from mesh.records.logthread import LogThread
from mesh.records.rundir import RunDir, RunDirError, read_metrics
from mesh.records.sinks import SAMPLE_COLUMNS
from mesh.runtime.run import run
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError, load_topology

SHORT = [*TINY_SHORT, "loop.evaluation.every=0"]


def tiny_plan(root: Path, *overrides: str):
    return load_plan(TINY, [*SHORT, f"logging.root={root}", *overrides])


def by_step(records: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for record in records:
        steps.setdefault(record["step"], []).append(record)
    return steps


# ----------------------------------------------------------------------------- real runs


async def test_a_run_records_the_first_rows_of_every_nth_step_with_what_scored_them(tmp_path):
    run_dir = await run(tiny_plan(tmp_path, "logging.samples.every=2", "logging.samples.per_step=6"), progress=False)
    records = read_metrics(run_dir.samples_file)
    steps = by_step(records)
    assert sorted(steps) == [0, 2] and all(len(rows) == 6 for rows in steps.values())
    for record in records:
        assert set(record) == set(SAMPLE_COLUMNS) | {"reward_parts", "hint"}  # no token ids unless full
        assert record["age"] == record["step"] - record["version"] and 0 <= record["age"] <= 1
        assert record["completion_tokens"] > 0 and record["prompt_tokens"] == len(record["prompt"])  # chars
        assert record["reward"] == pytest.approx(sum(record["reward_parts"].values()))
        assert record["prompt"].endswith("=") and record["answer"] == record["prompt"][:-1][::-1]  # reverse
    first = steps[0]  # warm start: the oracle's trace is the fifth row of the first group, the fifth of four samples
    assert [r["kind"] for r in first] == ["sample"] * 4 + ["warm_start"] + ["sample"]
    assert first[4]["teacher"] == "oracle" and first[4]["completion"] == first[4]["answer"]
    assert [r["group"] for r in first] == [0] * 5 + [1]
    group = [r["advantage"] for r in first[:5]]  # group-relative: they sum to 0 over the group's trained rows
    assert sum(group) == pytest.approx(0.0, abs=1e-5)
    assert all(r["kind"] == "sample" and r["teacher"] is None for r in steps[2])  # the warm start is over


@pytest.mark.slow
async def test_a_full_recording_holds_every_row_of_every_step_with_its_tokens(tmp_path):
    run_dir = await run(tiny_plan(tmp_path, "logging.samples.full=true"), progress=False)
    steps = by_step(read_metrics(run_dir.samples_file))
    assert sorted(steps) == [0, 1, 2]
    assert [len(rows) for rows in steps.values()] == [3 * 5, 3 * 4, 3 * 4]  # step 0: an oracle trace per group
    metrics = {r["step"]: r for r in read_metrics(run_dir.metrics_file)}
    for step, rows in steps.items():
        assert [(r["row"], r["rows"]) for r in rows] == [(i, len(rows)) for i in range(len(rows))]  # each in place
        samples = [r for r in rows if r["kind"] == "sample"]
        assert sum(r["reward"] for r in samples) / len(samples) == pytest.approx(metrics[step]["reward/mean"])
        for r in rows:
            trajectory = r["trajectory"]
            assert len(trajectory["completion_ids"]) == len(trajectory["logprobs"]) == r["completion_tokens"]
            assert trajectory["text"] == r["completion"] and r["problem"]["prompt"] == r["prompt"]
            assert all(lp <= 0 for lp in trajectory["logprobs"]) and r["distill"] is None


@pytest.mark.slow
async def test_samples_null_records_nothing(tmp_path):
    run_dir = await run(tiny_plan(tmp_path, "loop.steps=1", "logging.samples=null"), progress=False)
    assert read_metrics(run_dir.metrics_file) and not run_dir.samples_file.exists()


# ----------------------------------------------------------------------------- the section


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["logging.samples.every=0"], "logging.samples.every: Input should be greater than or equal to 1"),
        (["logging.samples.per_step=-3"], "logging.samples.per_step: Input should be greater than or equal to 1"),
        (["logging.samples.per_step=all"], "logging.samples.per_step: Input should be a valid integer"),
        (["logging.samples.full=true", "logging.samples.every=1", "logging.samples.per_step=5"], "remove it"),
        (["logging.samples.every=1e400"], "logging.samples.every"),
        (["logging.samples.ful=true"], "unknown key 'ful' at logging.samples.ful"),
        (
            ["logging.samples.full=true", "logging.samples.every=2"],
            "full records every row of every step (what --retrain trains on), so every cannot bound it; remove it",
        ),
        (
            ["logging.samples={full: true, every: 2, per_step: 9}"],
            "so every and per_step cannot bound it; remove them, or drop full",
        ),
    ],
)
def test_bad_samples_settings_are_refused_at_load(overrides, expected):
    with pytest.raises(TopologyError, match="logging.samples") as refused:
        load_topology(TINY, overrides)
    assert expected in str(refused.value)


def test_a_full_recording_reads_back_from_its_resolved_topology(tmp_path):
    samples = load_topology(TINY, ["logging.samples.full=true"]).logging.samples
    assert (samples.every, samples.per_step, samples.full) == (1, None, True)
    resolved = tmp_path / "topology.yaml"  # as the run directory keeps it, every default written out
    resolved.write_text(yaml.safe_dump(load_topology(TINY, ["logging.samples.full=true"]).model_dump(mode="json")))
    assert load_topology(resolved).logging.samples == samples
    assert load_topology(TINY, ["logging.samples.per_step=null"]).logging.samples.per_step is None  # every row


# ----------------------------------------------------------------------------- the logging thread


def test_the_logging_thread_runs_jobs_in_order_and_raises_a_failure_at_the_next_submit():
    thread, done = LogThread(), []
    for i in range(50):
        thread.submit(lambda i=i: done.append(i))
    thread.drain()
    assert done == list(range(50))

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    thread.submit(fail)
    thread.submit(lambda: done.append("skipped"))  # after a failure, nothing more is written
    with pytest.raises(OSError, match="No space left"):
        thread.drain()
    thread.submit(lambda: done.append("after"))  # the error was read: writing goes on
    assert thread.close() is None and done[-1] == "after" and "skipped" not in done


def test_the_logging_thread_keeps_a_failure_nobody_read_for_close():
    thread = LogThread()
    thread.submit(lambda: 1 / 0)
    assert isinstance(thread.close(), ZeroDivisionError)


def test_recording_does_not_wait_for_the_write(tmp_path):
    run_dir = RunDir.create(tmp_path, "tiny", {}, tensorboard=False)
    release = threading.Event()
    run_dir.record(0, lambda: (release.wait(5), [{"step": 0, "prompt": "ab="}])[1])
    assert not run_dir.samples_file.exists()  # the loop went on; the row is built on the logging thread
    release.set()
    run_dir.close()
    assert read_metrics(run_dir.samples_file) == [{"step": 0, "prompt": "ab="}]


def test_rewind_drops_the_samples_of_the_steps_trained_again(tmp_path):
    run_dir = RunDir.create(tmp_path, "tiny", {}, tensorboard=False)
    for step in range(4):
        run_dir.log(step, {"reward/mean": 0.5})
        run_dir.record(step, lambda step=step: [{"step": step, "row": i} for i in range(2)])
    run_dir.rewind(2)
    assert [r["step"] for r in read_metrics(run_dir.samples_file)] == [0, 0, 1, 1]
    run_dir.close()


def test_a_full_disk_stops_the_run_at_the_next_recorded_step_and_keeps_whole_lines(tmp_path):
    with tmpfs(tmp_path / "disk", size="64k") as disk:
        run_dir = RunDir.create(disk, "tiny", {}, tensorboard=False)
        big = [{"step": 0, "completion": "x" * 100_000}]
        run_dir.record(0, lambda: [{"step": 0, "completion": "fits"}])
        run_dir.record(1, lambda: big)
        with pytest.raises(RunDirError) as stopped:
            run_dir._logging.drain()
            run_dir.record(2, lambda: [])
        message = str(stopped.value)
        assert message.startswith(f"the samples of step 1 could not be written to {run_dir.samples_file}: ")
        assert "free space there or point --run-root" in message and "with --resume" in message
        assert [json.loads(line) for line in run_dir.samples_file.read_text().splitlines()] == [
            {"step": 0, "completion": "fits"}
        ]
        run_dir.close()
