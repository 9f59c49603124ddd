"""Hostile inputs to the check-time surfaces (issue 28): user code named in a topology is located,
never run; sizes that cannot fit are refused before anything starts; datasets, ``mesh.ctl`` specs
and URLs are read within bounds. Each is refused with one paragraph and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.tasks.dataset import DatasetError, DatasetSource
from mesh.ctl import main as ctl_main
from mesh.supervision.commands import ControlChannel
from mesh.topology.preflight import BatchFootprint, FreeMemory, StoreFootprint, check_memory, load_plan
from mesh.topology.schema import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "topologies" / "tiny.yaml"


def refused(path: Path, overrides: list[str]) -> str:
    """The one-paragraph message checking ``path`` with ``overrides`` refuses it with."""
    with pytest.raises(TopologyError) as info:
        load_plan(path, overrides)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "Traceback" not in message
    return message


# ----------------------------------------------------------------- user code is located, not run


@pytest.fixture
def evil(tmp_path, monkeypatch) -> Path:
    """A package on the import path whose every module writes a marker file when it runs; returns the
    marker's directory (empty while nothing ran)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    package = tmp_path / "site" / "evilpkg"
    package.mkdir(parents=True)
    for module in ("__init__", "mod"):
        (package / f"{module}.py").write_text(f"open({str(markers / module)!r}, 'w').write('ran')\n")
    (tmp_path / "site" / "evil_taskset.py").write_text(f"open({str(markers / 'taskset')!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield markers
    for name in [name for name in sys.modules if name.startswith(("evilpkg", "evil_taskset"))]:
        del sys.modules[name]


@pytest.mark.parametrize(
    "override",
    [
        'task={name: verifiers, taskset: "evilpkg.mod:Cls"}',
        "task={name: verifiers, taskset: evil-taskset}",  # verifiers' convention: the package by its name
        'actors.rewarder.functions=["evilpkg.mod:reward"]',
    ],
)
def test_checking_a_topology_locates_user_code_without_running_it(evil, override):
    load_topology(TINY, [override])
    assert sorted(os.listdir(evil)) == []


@pytest.mark.parametrize(
    "override, expected",
    [
        ('task={name: verifiers, taskset: "evilpkg.nomod:Cls"}', "no module 'evilpkg.nomod' is installed"),
        ('task={name: verifiers, taskset: "nopkg.mod:Cls"}', "no module 'nopkg.mod' is installed"),
        ('task={name: verifiers, taskset: "evilpkg.mod:"}', "not an import path of the form 'package.module:Class'"),
        ("task={name: verifiers, taskset: no-such-taskset}", "'no_such_taskset' is installed or on PYTHONPATH"),
        ('actors.rewarder.functions=["evilpkg.nomod:reward"]', "cannot import module 'evilpkg.nomod'"),
    ],
)
def test_user_code_that_cannot_be_found_is_refused_naming_it(evil, override, expected):
    assert expected in refused(TINY, [override])
    assert sorted(os.listdir(evil)) == []


def test_dry_run_runs_no_user_code(evil, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}
    command = [sys.executable, "-m", "mesh.run", str(TINY), "--dry-run"]
    override = ["--set", 'task={name: verifiers, taskset: "evilpkg.mod:Cls"}']
    done = subprocess.run(command + override, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(evil)) == []


# ----------------------------------------------------------------- sizes that cannot fit


def test_a_batch_that_cannot_fit_is_refused_naming_the_keys_and_the_largest_batch_that_fits():
    """The issue's machine: 24 GiB of RAM, half of it /dev/shm; 10000 prompts x 1000 samples were OOM-killed."""
    machine = FreeMemory(shm=12 * 2**30, ram=24 * 2**30)
    hostile = load_plan(TINY, ["loop.prompts_per_step=10000", "loop.group_size=1000"], placed_here=False)
    with pytest.raises(ValueError) as info:
        check_memory(hostile, machine)
    message = str(info.value)
    assert "loop.prompts_per_step x loop.group_size is 10000 x 1000" in message
    fits = int(re.search(r"largest batch that can fit is loop\.prompts_per_step: (\d+) at group_size 1000", message)[1])
    assert 0 < fits < 10000
    largest = load_plan(TINY, [f"loop.prompts_per_step={fits}", "loop.group_size=1000"], placed_here=False)
    check_memory(largest, machine)
    with pytest.raises(ValueError, match="loop.prompts_per_step x loop.group_size"):
        more = [f"loop.prompts_per_step={fits + 1}", "loop.group_size=1000"]
        check_memory(load_plan(TINY, more, placed_here=False), machine)


def test_every_shipped_topology_still_fits_the_issue_machine():
    machine = FreeMemory(shm=12 * 2**30, ram=24 * 2**30)
    for path in sorted((ROOT / "topologies").glob("*.yaml")):
        check_memory(load_plan(path, placed_here=False), machine)


def test_a_run_with_a_batch_no_machine_holds_exits_2_before_starting_anything(tmp_path):
    sets = ["--set", "loop.prompts_per_step=10000", "--set", "loop.group_size=1000000"]
    done = mesh_run([str(TINY), *sets, "--run-root", str(tmp_path)])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "the largest batch that can fit is loop.prompts_per_step:" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing started


def test_diloco_replicas_count_against_the_machine_like_generator_copies():
    message = refused(TINY, ["diloco={replicas: 1000, sync_every: 10}"])
    assert "meshes ask for 3000 processes in all (diloco.replicas: 1000 counted)" in message
    one = load_plan(TINY, ["diloco={replicas: 1, sync_every: 10}"], placed_here=False)
    plan = StoreFootprint.of(one)
    need = plan.ram_margin + BatchFootprint.of(one).bytes + plan.slots * plan.slot_bytes
    check_memory(one, FreeMemory(shm=10**12, ram=need))
    two = load_plan(TINY, ["diloco={replicas: 2, sync_every: 10}"], placed_here=False)
    with pytest.raises(ValueError, match="for each of the diloco.replicas: 2"):
        check_memory(two, FreeMemory(shm=10**12, ram=need))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("fault_tolerance={call_timeout: 1.0e+300}", "call_timeout must be a number of seconds in (0, 86400]"),
        ("fault_tolerance={call_timeout: .inf}", "fault_tolerance.call_timeout"),
        ("fault_tolerance={max_restarts: 1000000000}", "max_restarts must be an integer in [0, 1000]"),
        ("fault_tolerance={max_restarts: 1.0e+9}", "max_restarts must be an integer in [0, 1000]"),
        ("loop.steps=100000000000000", "loop.steps: Input should be less than or equal to 1000000000"),
        ('task={name: openenv, url: "http://localhost:8000", timeout_s: 1.0e+300}', "timeout_s in (0, 86400]"),
        ('task={name: openenv, url: "http://localhost:8000", timeout_s: .nan}', "timeout_s in (0, 86400]"),
    ],
)
def test_timeouts_restarts_and_steps_past_their_documented_maxima_are_refused(override, expected):
    assert expected in refused(TINY, [override])


def test_the_documented_maxima_themselves_are_accepted():
    top = ["fault_tolerance={call_timeout: 86400, max_restarts: 1000}", "loop.steps=1000000000"]
    topology = load_topology(TINY, top, placed_here=False)
    assert (topology.fault_tolerance.call_timeout, topology.fault_tolerance.max_restarts) == (86400, 1000)


# ----------------------------------------------------------------- LoRA settings no loop can train

LORA = "actors.trainer.lora={rank: 4}"
NOT_A_RANK = "lora.rank: rank must be a positive integer (the adapters' inner size), got"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actors.trainer.inner_loop=torchtitan", LORA], "which inner_loop 'torchtitan' does not wire in"),
        (["actors.trainer.lora={rank: 0}"], "lora.rank: rank must be a positive integer"),
        (["actors.trainer.lora={rank: -4}"], "lora.rank: rank must be a positive integer"),
        (["actors.trainer.lora={rank: true}"], f"{NOT_A_RANK} True"),
        (["actors.trainer.lora={rank: '8'}"], f"{NOT_A_RANK} '8'"),
        (["actors.trainer.lora={rank: 65}"], "lora.rank is 65, above the width of the narrowest layer it adapts"),
        (["actors.trainer.lora={rank: 1000000000}"], "set rank to at most 64 (e.g. 16)"),
        (["actors.trainer.lora={alpha: true}"], "lora.alpha: expected a number, got True"),
        (["actors.trainer.inner_loop=trl", "actors.trainer.lora={target_modules: [q_proj, lm_head]}"],
         "inner_loop 'trl' takes its logprobs from the head's weight alone"),
        (["actors.trainer.lora={target_modules: [lm_head], dropout: 0.1}"], "names lm_head with dropout 0.1"),
        (["actors.trainer.lora={target_modules: [q_proj, embed_tokens]}"], "names embed_tokens, an embedding"),
        (["actors.trainer.lora={target_modules: [q_proj, qkv]}"], "names qkv, which the model has no linear"),
        (["actors.trainer.lora={dropout: 1.5}"], "lora: dropout must be in [0, 1), got 1.5"),
        (["actors.trainer.lora={alpha: 0}"], "lora: alpha must be > 0"),
    ],
    ids=[
        "torchtitan",
        "rank_0",
        "rank_negative",
        "rank_true",
        "rank_string",
        "rank_above_width",
        "rank_huge",
        "alpha_true",
        "lm_head_trl",
        "lm_head_dropout",
        "embed_tokens",
        "unknown",
        "dropout",
        "alpha",
    ],
)
def test_lora_settings_no_loop_can_train_are_refused_naming_the_fix(overrides, expected):
    message = refused(TINY, overrides)
    assert expected in message and "actors.trainer" in message


def test_lora_on_the_torchtitan_loop_exits_2_naming_the_loops_that_train_adapters(tmp_path):
    sets = ["--set", "actors.trainer.inner_loop=torchtitan", "--set", LORA]
    done = mesh_run([str(TINY), *sets, "--dry-run", "--run-root", str(tmp_path)])
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "Use inner_loop native, trl, prime_rl, or remove lora" in done.stderr


def test_tiny_lora_with_the_trl_loop_exits_2_at_check_time_not_after_start_up(tmp_path):
    """tiny_lora.yaml adapts the head; TRL refused it only once the trainer had started."""
    tiny_lora = ROOT / "topologies" / "tiny_lora.yaml"
    done = mesh_run([str(tiny_lora), "--set", "actors.trainer.inner_loop=trl", "--run-root", str(tmp_path)])
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "use inner_loop native or prime_rl, which fold the head's adapter" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_huge_rank_is_blamed_on_the_rank_not_on_the_batch():
    message = refused(TINY, ["actors.trainer.lora={rank: 1000000000}"])
    assert "group_size" not in message and "prompts_per_step" not in message


def test_lora_on_every_loop_that_trains_adapters_is_accepted():
    for loop in ("native", "trl", "prime_rl"):
        topology = load_topology(TINY, [f"actors.trainer.inner_loop={loop}", LORA], placed_here=False)
        assert topology.actors.trainer.lora.rank == 4


# ----------------------------------------------------------------- a data file is read within bounds


def one_line_of(size: int, path: Path) -> Path:
    """A JSON Lines file of ``size`` bytes with no newline: a record opened and never closed (sparse,
    so it takes no disk)."""
    with path.open("wb") as file:
        file.write(b'{"prompt": "')
        file.truncate(size)
    return path


def test_a_3_gb_json_lines_file_with_no_newline_is_refused_in_under_a_second(tmp_path):
    data = one_line_of(3 * 10**9, tmp_path / "huge.jsonl")
    start = time.perf_counter()
    message = refused(TINY, [f"task={{name: dataset, dataset: {{path: {data}}}}}"])
    assert time.perf_counter() - start < 1.0
    assert f"{data}: no whole record in its first 4 MB" in message and "write one JSON object per line" in message


@pytest.mark.parametrize(
    "name, head", [("list.json", b'[{"prompt": "'), ("lines.jsonl", b"\n\n   \n" * 1000)], ids=["json-list", "blank-lines"]
)
def test_a_json_list_or_blank_lines_past_the_bound_are_refused_too(tmp_path, name, head):
    path = tmp_path / name
    with path.open("wb") as file:
        file.write(head)
        file.truncate(64 * 2**20)
    with pytest.raises(DatasetError, match="no whole record in its first 4 MB"):
        DatasetSource(str(path)).check()


def test_a_first_record_within_the_bound_is_read_whatever_follows(tmp_path):
    path = tmp_path / "rows.jsonl"
    with path.open("wb") as file:
        file.write(json.dumps({"prompt": "p" * (2 * 2**20), "answer": "a"}).encode() + b"\n")
        file.truncate(64 * 2**20)
    DatasetSource(str(path)).check()  # the columns come from the first line; the rest is read with the rows


# ----------------------------------------------------------------- mesh.ctl and URLs


DEEP_SPEC = "{a: " * 5000 + "1" + "}" * 5000


@pytest.mark.parametrize(
    "spec, expected",
    [
        (DEEP_SPEC, "SPEC holds more than 10000 values or nests them more than 32 levels deep"),
        ("[" * 5000 + "]" * 5000, "SPEC holds more than 10000 values or nests them more than 32 levels deep"),
        ("{kind: task_oracle, path: [" + "x, " * 20000 + "x]}", "SPEC holds more than 10000 values"),
        ("{kind: hf, path: " + "x" * 5000 + "}", "SPEC holds a text of 5000 characters"),
        ("{kind: openai, url: 'http://[::1', model: m, use: [replay]}", "(it does not parse (Invalid IPv6 URL))"),
    ],
    ids=["5000-deep-mapping", "5000-deep-list", "20001-values", "5000-char-text", "malformed-url"],
)
def test_mesh_ctl_refuses_a_spec_past_the_topology_limits_in_one_line(tmp_path, capsys, spec, expected):
    assert ctl_main([str(tmp_path), "teachers", "bind", "big", spec]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_mesh_ctl_with_a_5000_deep_spec_exits_2_with_one_line(tmp_path):
    command = [sys.executable, "-m", "mesh.ctl", str(tmp_path), "teachers", "bind", "big", DEEP_SPEC]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "RecursionError" not in done.stderr


@pytest.mark.parametrize(
    "request_bytes, expected",
    [
        (b'{"args": ' * 5000 + b"1" + b"}" * 5000, "not JSON"),  # RecursionError inside json
        (b'{"verb": "bind", "args": {"spec": ' + b"[" * 40 + b"]" * 40 + b"}}", "nests them more than 32 levels"),
        (b'{"x": "' + b"y" * 2_000_000 + b'"}', "larger than 1000 kB"),
        (b"\xff\xfe{}", "not JSON"),
    ],
    ids=["5000-deep", "40-deep", "2-MB", "not-UTF-8"],
)
def test_the_run_refuses_a_request_past_the_limits_without_failing(tmp_path, request_bytes, expected):
    channel = ControlChannel.create(tmp_path)
    (tmp_path / "control" / "requests" / "1-bad.json").write_bytes(request_bytes)
    assert channel.pending() == []
    reply = json.loads((tmp_path / "control" / "replies" / "bad.json").read_text())
    assert not reply["ok"] and expected in reply["message"]


MALFORMED_URLS = ["http://[::1", "http://[::1]:99999", "http://host:port", "http://", "ftp://host", "http://a b"]


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_a_malformed_openenv_url_is_refused_when_the_topology_is_read(url):
    message = refused(TINY, [f'task={{name: openenv, url: "{url}"}}'])
    assert f"OpenEnv url {url!r}" in message and "give http://host:port" in message


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_a_malformed_openai_teacher_url_is_refused_when_the_topology_is_read(url):
    binding = f'actors.teachers.bindings.api={{kind: openai, url: "{url}", model: m, use: [replay]}}'
    assert f"openai teacher url {url!r} is not an http(s) URL" in refused(TINY, [binding])


def test_well_formed_urls_pass():
    openenv = ['task={name: openenv, url: "http://[::1]:8000"}', "loop.warm_start.steps=0"]
    load_topology(TINY, openenv, placed_here=False)
    binding = 'actors.teachers.bindings.api={kind: openai, url: "https://api.example.com/v1", model: m, use: [replay]}'
    load_topology(TINY, [binding, "actors.trainer.loss.beta_replay=0.1"], placed_here=False)


def mesh_run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mesh.run", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
