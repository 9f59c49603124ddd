"""The run's timeline (issue 31, item 3): ``trace.json`` in Chrome's trace-event format and ``timeline.png``,
bounded to the last ``logging.trace.steps`` steps, with every actor call on the track of the process it ran on."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from actors.basics.proc_info import ProcInfo
from mesh.records.logthread import LogThread
from mesh.records.rundir import TIMELINE_FILE, RunDir
from mesh.records.trace import STEP, TRACE_FILE, Tracer, at_step, in_step, plot_timeline
from mesh.run import main
from mesh.runtime import run as runtime
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"
TRAINER = [ProcInfo("host-a", 11), ProcInfo("host-b", 12)]  # a trainer mesh of two processes
GENERATOR = [ProcInfo("host-a", 21)]


def a_step(tracer: Tracer, step: int) -> None:
    """One step's calls, as the controller and the fleet report them (each 10 ms)."""
    now = time.perf_counter()
    with at_step(step):
        tracer.call("generator", "generator", 0, "generate", GENERATOR, now, now + 0.01)
        tracer.call("trainer", "trainer", None, "train_step", TRAINER, now, now + 0.01)
    tracer.span("wait for batch", now, now, step)
    tracer.span("train step", now, now + 0.01, step)


def read_trace(directory: Path) -> list[dict]:
    return json.loads((directory / TRACE_FILE).read_text())["traceEvents"]


def at_once(job) -> None:
    """A tracer's background writes, done in the caller's thread."""
    job()


def named(events: list[dict], kind: str) -> dict:
    """Chrome pid (or (pid, tid)) -> the name its metadata event gives it."""
    ids = (lambda e: (e["pid"], e["tid"])) if kind == "thread_name" else (lambda e: e["pid"])
    return {ids(e): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == kind}


# ----------------------------------------------------------------------------- the tracer alone


def test_the_buffer_keeps_only_the_last_n_steps_whatever_the_run_length(tmp_path):
    tracer = Tracer(2, tmp_path, at_once)
    now = time.perf_counter()
    tracer.call("trainer", "trainer", None, "publish", TRAINER, now, now)  # before the first step: counts with it
    a_step(tracer, 0)
    assert any(s.name == "publish weights" for s in tracer.spans())
    sizes = []
    for step in range(1, 200):
        a_step(tracer, step)
        sizes.append(len(tracer._events))
    assert {s.step for s in tracer.spans()} == {198, 199}
    assert max(sizes) <= 2 * 4 + 1  # two steps of four events (and the call before the first): never more
    tracer.call("generator", "generator", 0, "hold", GENERATOR, now, now)  # outside any step: the newest's
    assert [s.step for s in tracer.spans() if s.name == "load weights (hold)"] == [None]


def test_a_step_collected_ahead_keeps_its_step_until_it_falls_out_of_the_window(tmp_path):
    tracer = Tracer(2, tmp_path, at_once)
    a_step(tracer, 5)  # collected ahead (max_policy_lag 1)
    a_step(tracer, 4)  # its training came after
    a_step(tracer, 6)
    assert {s.step for s in tracer.spans()} == {5, 6}


def test_trace_json_is_chrome_trace_events_one_track_per_actor_per_process(tmp_path):
    tracer = Tracer(20, tmp_path, at_once)
    for step in range(3):
        a_step(tracer, step)
    tracer.close()
    events = read_trace(tmp_path)
    assert all({"ph", "ts", "pid", "tid", "name"} <= e.keys() for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["step"] in (0, 1, 2) for e in complete)
    processes, threads = named(events, "process_name"), named(events, "thread_name")
    assert sorted(processes.values())[1:] == [
        "generator 0 (host-a:21)",
        "trainer 0 (host-a:11)",
        "trainer 1 (host-b:12)",
    ]
    assert sorted(processes.values())[0].startswith("controller 0 (")
    train = [e for e in complete if e["name"] == "train_step"]  # a whole-mesh call: one event per process
    assert sorted(processes[e["pid"]] for e in train) == ["trainer 0 (host-a:11)"] * 3 + ["trainer 1 (host-b:12)"] * 3
    assert {threads[e["pid"], e["tid"]] for e in train} == {"trainer"}
    controller = [e["name"] for e in complete if processes[e["pid"]].startswith("controller")]
    assert controller == [f"{span} {step}" for step in range(3) for span in ("wait for batch", "train step")]


def test_the_file_is_rewritten_every_n_steps_while_the_run_goes_on(tmp_path):
    logging = LogThread()
    tracer = Tracer(2, tmp_path, logging.submit)
    for step in range(3):
        a_step(tracer, step)  # step 2 sends a write of steps 1 and 2 to the logging thread
    assert logging.close() is None
    steps = {e["args"].get("step") for e in read_trace(tmp_path) if e["ph"] == "X"}
    assert steps <= {1, 2} and list(tmp_path.iterdir()) == [tmp_path / TRACE_FILE]  # no temp file left


def test_a_write_that_fails_is_one_warning_never_an_exception(tmp_path, capsys):
    tracer = Tracer(2, tmp_path / "gone", at_once)
    a_step(tracer, 1)  # not a step that writes: close's is the only write
    tracer.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {tmp_path / 'gone' / TRACE_FILE} was not written: ")


def test_the_run_directory_writes_the_trace_and_timeline_only_with_a_tracer(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off, on = RunDir(tmp_path / "off", tensorboard=False), RunDir(tmp_path / "on", tensorboard=False)
    off.close()
    assert not (off.path / TRACE_FILE).exists() and not (off.path / TIMELINE_FILE).exists()
    on.tracer = Tracer(20, on.path, on.background)
    for step in range(4):
        a_step(on.tracer, step)
    assert on.close() is None
    assert (on.path / TRACE_FILE).stat().st_size > 0 and (on.path / TIMELINE_FILE).stat().st_size > 0


def test_no_events_draw_no_timeline(tmp_path):
    plot_timeline([], tmp_path / TIMELINE_FILE)
    assert not (tmp_path / TIMELINE_FILE).exists()


async def test_a_collection_task_has_its_own_step_and_the_caller_keeps_its_own():
    async def step_inside() -> int | None:
        await asyncio.sleep(0)
        return STEP.get()

    with at_step(4):
        collection = asyncio.ensure_future(in_step(5, step_inside()))  # as the scheduler starts one
        assert await collection == 5 and STEP.get() == 4
    assert STEP.get() is None  # after the step: calls outside any step


# ----------------------------------------------------------------------------- a bad setting


@pytest.mark.parametrize("value", ["0", "-1", "x", "1e12", "1.0e+12"])
def test_a_bad_trace_steps_is_refused_with_exit_2(value, capsys):
    assert main([str(TINY), "--dry-run", f"--set=logging.trace.steps={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {TINY}: logging.trace.steps: ") and err.count("\n") == 1 and "Traceback" not in err


def test_trace_null_turns_tracing_off():
    assert load_plan(TINY, ["logging.trace=null"]).topology.logging.trace is None
    assert load_plan(TINY, []).topology.logging.trace.steps == 20


# ----------------------------------------------------------------------------- a real run


def overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


async def test_a_tiny_bounded_async_run_traces_every_call_of_its_last_steps(tmp_path):
    steps, kept = 6, 3
    overrides = [
        f"loop.steps={steps}",
        "loop.max_policy_lag=1",
        "loop.evaluation.every=0",
        "logging.tensorboard=false",
        f"logging.trace.steps={kept}",
        f"logging.root={tmp_path}",
    ]
    run_dir = await runtime.run(load_plan(TINY, overrides), progress=False)
    events = read_trace(run_dir.path)
    processes, threads = named(events, "process_name"), named(events, "thread_name")
    complete = [e for e in events if e["ph"] == "X"]
    procs = json.loads((run_dir.path / runtime.PROCS).read_text())

    def on(mesh: str, name: str) -> list[dict]:
        where = {f"{mesh} {i} ({p['host']}:{p['pid']})" for i, p in enumerate(procs[mesh]["procs"])}
        found = [e for e in complete if e["name"] == name and processes[e["pid"]] in where]
        assert {processes[e["pid"]] for e in found} == where, (mesh, name)  # on every process of the mesh
        return found

    train, generate = on("trainer", "train_step"), on("generator", "generate")
    assert {threads[e["pid"], e["tid"]] for e in train} == {"trainer"}
    waits = [e for e in complete if e["name"].startswith("wait for batch")]
    assert {processes[e["pid"]].split()[0] for e in waits} == {"controller"}
    stepped = [e["args"]["step"] for e in complete if "step" in e["args"]]
    assert set(stepped) == set(range(steps - kept, steps))  # the last N steps only
    assert any(
        overlaps(g, t) for g in generate for t in train if g["args"]["step"] == t["args"]["step"] + 1
    ), "no generation of step k+1 overlaps the training of step k"
    assert (run_dir.path / TIMELINE_FILE).stat().st_size > 0
