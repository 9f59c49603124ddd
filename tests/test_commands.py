"""The control channel between a live run and ``python -m mesh.ctl``, on real files and real processes.

``FakeRun`` stands in for the controller loop (integrated elsewhere): on a thread of this
process, it takes the pending commands at each "step boundary", applies them to a dict
of teachers and answers them, exactly as the loop does through ``pending()`` and
``answer()``. Clients are ``send()`` calls or real ``python -m mesh.ctl`` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import pytest

from mesh.ctl import main
from mesh.records.layout import ControlError
from mesh.supervision.commands import Command, ControlChannel, read_teachers, send

ROOT = Path(__file__).resolve().parents[1]


class FakeRun:
    """A run that applies teacher commands at step boundaries; it rejects a bind whose ``path`` does not exist,
    as the real run does when it cannot load the teacher."""

    def __init__(self, run_path: Path, answer: bool = True):
        self.channel = ControlChannel.create(run_path)
        self.answers = answer
        self.step = 0
        self.teachers: dict[str, dict] = {"oracle": {"spec": {"kind": "task_oracle"}, "bound_at_step": 0}}
        self.received: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self) -> Self:
        self.channel.write_teachers(self.teachers)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.channel.close()

    def loop(self) -> None:
        while not self.stop.wait(0.01):
            self.step += 1
            for command in self.channel.pending():
                self.received.append(command.args)
                if self.answers:
                    self.apply(command)

    def apply(self, command: Command) -> None:
        name, step = command.args["name"], self.step + 1
        if command.verb == "unbind":
            self.teachers.pop(name)
            message = f"unbound teacher {name!r}; it applies from step {step}"
        elif "path" in command.args["spec"] and not Path(command.args["spec"]["path"]).exists():
            return self.channel.answer(command, False, f"cannot load {name!r}; the old binding stays", step)
        else:
            self.teachers[name] = {"spec": command.args["spec"], "bound_at_step": step}
            message = f"bound teacher {name!r} ({command.args['spec']['kind']}); it applies from step {step}"
        self.channel.write_teachers(self.teachers)
        self.channel.answer(command, True, message, step)


def events(run_path: Path) -> list[dict]:
    return [json.loads(line) for line in (run_path / "events.jsonl").read_text().splitlines()]


def requests(run_path: Path) -> list[Path]:
    return list((run_path / "control" / "requests").iterdir())


def ctl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m mesh.ctl ARGS`` as its own process, importing this checkout from any working directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "mesh.ctl", *args], check=False, capture_output=True, text=True, cwd=cwd, env=env
    )


def test_only_the_owner_can_enter_the_channel(tmp_path):
    channel = ControlChannel.create(tmp_path)
    control = tmp_path / "control"
    assert stat.S_IMODE(control.stat().st_mode) == 0o700
    assert stat.S_IMODE((control / "requests").stat().st_mode) == 0o700
    assert stat.S_IMODE((control / "replies").stat().st_mode) == 0o700
    assert stat.S_IMODE((control / "token").stat().st_mode) == 0o600
    assert (control / "token").read_text().strip() == channel.token and len(channel.token) == 32
    assert json.loads((control / "pid").read_text())["pid"] == os.getpid()


def test_bind_and_unbind_round_trip(tmp_path):
    with FakeRun(tmp_path) as run:
        bound = send(tmp_path, "bind", {"name": "big", "spec": {"kind": "task_oracle"}}, timeout=10)
        assert bound["ok"], bound
        assert bound["message"] == f"bound teacher 'big' (task_oracle); it applies from step {bound['step']}"
        assert read_teachers(tmp_path)["big"] == {"spec": {"kind": "task_oracle"}, "bound_at_step": bound["step"]}
        unbound = send(tmp_path, "unbind", {"name": "big"}, timeout=10)
        assert unbound["ok"] and unbound["step"] > bound["step"]
        assert "big" not in read_teachers(tmp_path) and "oracle" in run.teachers
    assert [(e["verb"], e["name"], e["status"], e["step"]) for e in events(tmp_path)] == [
        ("bind", "big", "applied", bound["step"]),
        ("unbind", "big", "applied", unbound["step"]),
    ]
    assert events(tmp_path)[0]["spec"] == {"kind": "task_oracle"} and "spec" not in events(tmp_path)[1]
    assert requests(tmp_path) == [] and list((tmp_path / "control" / "replies").iterdir()) == []


def test_a_rejected_bind_keeps_the_old_binding_and_is_recorded(tmp_path):
    with FakeRun(tmp_path):
        spec = {"kind": "task_oracle", "path": str(tmp_path / "missing")}
        reply = send(tmp_path, "bind", {"name": "oracle", "spec": spec}, timeout=10)
    assert not reply["ok"] and reply["message"] == "cannot load 'oracle'; the old binding stays"
    assert read_teachers(tmp_path)["oracle"]["spec"] == {"kind": "task_oracle"}
    (event,) = events(tmp_path)
    assert event["status"] == "rejected" and event["step"] == reply["step"] and event["spec"] == spec
    assert event["message"] == reply["message"] and isinstance(event["time"], float)


def test_a_request_with_the_wrong_token_is_refused_not_applied(tmp_path):
    channel = ControlChannel.create(tmp_path)
    forged = {"id": "f00d", "verb": "unbind", "args": {"name": "oracle"}, "token": "0" * 32}
    (tmp_path / "control" / "requests" / "1-f00d.json").write_text(json.dumps(forged))
    (tmp_path / "control" / "requests" / "2-junk.json").write_text("{not json")
    assert channel.pending() == []
    forged_reply = json.loads((tmp_path / "control" / "replies" / "f00d.json").read_text())
    assert not forged_reply["ok"] and "token does not match" in forged_reply["message"]
    junk_reply = json.loads((tmp_path / "control" / "replies" / "junk.json").read_text())
    assert not junk_reply["ok"] and "not JSON" in junk_reply["message"]
    assert requests(tmp_path) == [] and not (tmp_path / "events.jsonl").exists()


def test_commands_arrive_in_the_order_sent(tmp_path):
    channel = ControlChannel.create(tmp_path)
    replies: list[dict] = []
    senders = [
        threading.Thread(target=lambda n=n: replies.append(send(tmp_path, "unbind", {"name": n}, 10))) for n in "abc"
    ]
    for count, sender in enumerate(senders, 1):
        sender.start()
        while len(requests(tmp_path)) < count:  # each is written before the next is sent
            time.sleep(0.01)
    commands = channel.pending()
    assert [command.args["name"] for command in commands] == ["a", "b", "c"]
    for command in commands:
        channel.answer(command, True, "done", 1)
    for sender in senders:
        sender.join()
    assert sorted(reply["id"] for reply in replies) == sorted(command.id for command in commands)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file; the test as another user covers root")
def test_a_client_that_cannot_read_the_token_is_told_only_the_owner_can_send(tmp_path):
    ControlChannel.create(tmp_path)
    (tmp_path / "control" / "token").chmod(0o000)
    with pytest.raises(ControlError, match="only the run's owner can send commands"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (nobody)")
def test_another_user_cannot_send_commands():
    run_path = Path(tempfile.mkdtemp()) / "run"  # pytest's own tmp_path is closed to other users; this is not
    try:
        run_path.mkdir(mode=0o755)
        run_path.parent.chmod(0o755)
        ControlChannel.create(run_path)
        os.seteuid(65534)
        try:
            with pytest.raises(ControlError, match="only the run's owner can send commands"):
                send(run_path, "unbind", {"name": "oracle"}, timeout=1)
            with pytest.raises(PermissionError):  # nor can it drop a request in by hand
                (run_path / "control" / "requests" / "1-x.json").write_text("{}")
        finally:
            os.seteuid(0)
    finally:
        shutil.rmtree(run_path.parent)


def test_a_run_that_died_without_closing_is_reported_ended(tmp_path):
    crash = (
        "from pathlib import Path; from mesh.supervision.commands import ControlChannel; "
        f"ControlChannel.create(Path({str(tmp_path)!r}))"
    )
    subprocess.run([sys.executable, "-c", crash], check=True, cwd=ROOT)
    with pytest.raises(ControlError, match=r"has ended: its process \d+ is gone"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=5)
    assert requests(tmp_path) == []


def test_a_closed_run_is_reported_ended(tmp_path):
    ControlChannel.create(tmp_path).close()
    with pytest.raises(ControlError, match="has ended .*nothing to change"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=5)


def test_a_live_process_that_reused_the_runs_pid_is_not_the_run(tmp_path):
    ControlChannel.create(tmp_path)
    os.utime(tmp_path / "control" / "pid", (1_000_000, 1_000_000))  # written long before this process started
    with pytest.raises(ControlError, match="has ended: its process"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=5)


def test_a_run_ending_while_the_client_waits_is_reported_at_once(tmp_path):
    channel = ControlChannel.create(tmp_path)
    threading.Timer(0.2, channel.close).start()
    start = time.monotonic()
    with pytest.raises(ControlError, match="has ended"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=30)
    assert time.monotonic() - start < 5 and requests(tmp_path) == []


def test_a_command_not_picked_up_in_time_is_withdrawn(tmp_path):
    channel = ControlChannel.create(tmp_path)
    with pytest.raises(ControlError, match=r"did not pick up the command within 0.3 s.*step boundaries"):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=0.3)
    assert requests(tmp_path) == [] and channel.pending() == []


def test_a_command_taken_but_not_answered_in_time_says_it_may_still_apply(tmp_path):
    with (
        FakeRun(tmp_path, answer=False) as run,
        pytest.raises(ControlError, match="took the command but did not answer within 2 s"),
    ):
        send(tmp_path, "unbind", {"name": "oracle"}, timeout=2)
    assert run.received == [{"name": "oracle"}]


def test_not_a_run_directory_and_no_channel(tmp_path):
    with pytest.raises(ControlError, match="is not a run directory"):
        send(tmp_path / "nope", "unbind", {"name": "oracle"})
    with pytest.raises(ControlError, match="no control/ channel: the run was started before mesh.ctl"):
        send(tmp_path, "unbind", {"name": "oracle"})
    with pytest.raises(ControlError, match="has no teachers.json"):
        read_teachers(tmp_path)


def test_cli_bind_list_unbind_against_a_live_run(tmp_path):
    (tmp_path / "teacher").mkdir()
    with FakeRun(tmp_path) as run:
        bound = ctl(str(tmp_path), "teachers", "bind", "big", "{kind: task_oracle, path: teacher}", cwd=tmp_path)
        assert bound.returncode == 0, bound.stderr
        assert bound.stdout.startswith("bound teacher 'big' (task_oracle); it applies from step ")
        assert run.received[-1]["spec"]["path"] == str(tmp_path / "teacher")  # the run's cwd is not the client's
        missing = ctl(str(tmp_path), "teachers", "bind", "big", "{kind: task_oracle, path: gone}", cwd=tmp_path)
        assert missing.returncode == 1
        assert missing.stderr == "error: the run rejected the command: cannot load 'big'; the old binding stays\n"
        assert main([str(tmp_path), "teachers", "unbind", "oracle"]) == 0
    assert main([str(tmp_path), "teachers", "list"]) == 0  # after the run ended too
    assert ctl(str(tmp_path), "teachers", "list").stdout.splitlines() == [
        "name  kind         use  bound_at_step",
        f"big   task_oracle  -    {run.teachers['big']['bound_at_step']}",
    ]
    assert [e["status"] for e in events(tmp_path)] == ["applied", "rejected", "applied"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{kind: task_oracle, layers: 2}", "unknown key(s) ['layers'] in SPEC; a teacher binding takes ['kind', "),
        ("{kind: nope}", "unknown teacher 'nope'"),
        ("{use: [replay]}", "SPEC needs a kind: one of task_oracle"),
        ("[task_oracle]", "SPEC must be a mapping like '{kind: hf"),
        ("{kind: task_oracle", "SPEC is not valid YAML"),
        ("{kind: task_oracle, use: [distill]}", "cannot be used for distill"),
    ],
)
def test_cli_refuses_a_bad_spec_without_sending(tmp_path, capsys, spec, message):
    ControlChannel.create(tmp_path)
    assert main([str(tmp_path), "teachers", "bind", "big", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "\n" not in err.rstrip("\n")
    assert requests(tmp_path) == []


def test_cli_refuses_a_bad_name(tmp_path, capsys):
    ControlChannel.create(tmp_path)
    assert main([str(tmp_path), "teachers", "unbind", "Big"]) == 2
    assert "bad teacher name 'Big'" in capsys.readouterr().err and requests(tmp_path) == []


def test_cli_reports_an_unreachable_run(tmp_path, capsys):
    ControlChannel.create(tmp_path).close()
    assert main([str(tmp_path), "teachers", "unbind", "oracle"]) == 1
    assert "has ended" in capsys.readouterr().err
