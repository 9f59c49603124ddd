"""The DiLoCo surface as a hostile user or a foreign writer of the store tries it: every case is refused in one
paragraph naming the cause, and nothing they wrote is ever averaged into a replica's weights.

The store cases run two replicas (threads) against a real local directory and a real S3 API (moto), with the
forged entry put there the way anyone who can write the store could."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_diloco import SMALL, start, wait_for_run, wait_for_step
from test_diloco_config import TINY_DILOCO
from test_diloco_object_store import (
    Store,
    float32_mean,
    make_delta,
    run_round,
    s3_endpoint,  # noqa: F401  (the fixture)
    store,  # noqa: F401  (the fixture)
)

from actors.diloco.object_store import ObjectStoreTransport, RefusedEntry, checksum, encode_delta
from mesh.topology.schema import TopologyError, load_topology

SECRET = b"shared between the replicas"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def plant(store: Store, name: str, data: bytes, round: int = 1) -> None:
    fs, _ = store.fs()
    path = store.path(round, name)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a local directory; nothing on s3
    fs.pipe_file(path, data)


def nan_delta() -> dict[str, torch.Tensor]:
    delta = make_delta(2)
    delta["layer.weight"][1, 2] = float("nan")
    return delta


def two_replicas(store: Store, **kwargs) -> dict[int, ObjectStoreTransport]:
    return {i: store.transport(i, replicas=3, round_timeout=1.0, **kwargs) for i in (0, 1)}


def test_a_nan_delta_with_a_valid_checksum_is_refused_naming_replica_and_round(store: Store) -> None:
    forged = encode_delta(nan_delta(), replica=2, round=1, rank=0)  # a valid checksum: anyone can compute it
    plant(store, "replica_2.safetensors", forged)
    with pytest.raises(RefusedEntry) as info:
        run_round(two_replicas(store), 1, {i: make_delta(i) for i in range(2)})
    message = str(info.value)
    assert "round 1" in message and "replica 2" in message and "replica_2.safetensors" in message
    assert "non-finite" in message and "'layer.weight'" in message and "diloco.secret_env" in message


def test_a_replica_never_writes_its_own_non_finite_delta(store: Store) -> None:
    transport = store.transport(0, replicas=2)
    delta = make_delta(0)
    delta["layer.bias"][0] = float("inf")
    with pytest.raises(RefusedEntry, match=r"round 3 .*own pseudo-gradient \(replica 0\) has 1 non-finite"):
        transport.average(3, delta)
    fs, _ = store.fs()
    assert not fs.exists(store.path(3, "replica_0.safetensors"))


def test_replaying_a_round_with_a_nan_delta_is_refused(store: Store) -> None:
    plant(store, "replica_1.safetensors", encode_delta(nan_delta(), replica=1, round=1, rank=0))
    plant(store, "closed_1.json", json.dumps({"round": 1, "rank": 0, "replica": 1, "members": [1]}).encode())
    with pytest.raises(RefusedEntry, match="round 1 .*replica 1: it has 1 non-finite"):
        store.transport(0, replicas=2).mean_of(1)


@pytest.mark.parametrize("forgery", ["unsigned", "other secret", "signed then changed"])
def test_with_a_secret_a_delta_written_without_it_is_refused(store: Store, forgery: str) -> None:
    delta = make_delta(2)
    secret = {"unsigned": None, "other secret": b"guessed", "signed then changed": SECRET}[forgery]
    data = encode_delta(delta, replica=2, round=1, rank=0, secret=secret)
    if forgery == "signed then changed":  # the values changed, the checksum recomputed: only the secret can sign
        changed = {name: t.clone() for name, t in delta.items()}
        changed["layer.weight"] += 1
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        from safetensors.torch import save

        data = save(changed, {**header, "checksum": checksum(changed)})
    plant(store, "replica_2.safetensors", data)
    with pytest.raises(RefusedEntry) as info:
        run_round(two_replicas(store, secret=SECRET), 1, {i: make_delta(i) for i in range(2)})
    message = str(info.value)
    assert "round 1" in message and "claims to be written by replica 2" in message
    assert ("no signature" if forgery == "unsigned" else "signature is wrong") in message


def test_with_a_secret_an_unsigned_close_marker_is_refused(store: Store) -> None:
    for i in (0, 1):
        plant(store, f"replica_{i}.safetensors", encode_delta(make_delta(i), replica=i, round=1, rank=0, secret=SECRET))
    plant(store, "closed_0.json", json.dumps({"round": 1, "rank": 0, "replica": 0, "members": [1]}).encode())
    with pytest.raises(RefusedEntry, match=r"closed_0\.json, which claims to be written by replica 0: it carries no"):
        store.transport(2, replicas=3, secret=SECRET).mean_of(1)


def test_with_a_secret_signed_replicas_average_exactly(store: Store) -> None:
    deltas = {i: make_delta(i) for i in range(2)}
    transports = {i: store.transport(i, replicas=2, round_timeout=10.0, secret=SECRET) for i in (0, 1)}
    results = run_round(transports, 1, deltas)
    assert all(r.members == (0, 1) for r in results.values())
    torch.testing.assert_close(results[0].mean, float32_mean([deltas[0], deltas[1]]), rtol=0, atol=0)
    late = store.transport(1, replicas=2, secret=SECRET)
    torch.testing.assert_close(late.mean_of(1), results[1].mean, rtol=0, atol=0)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_file_store_others_can_write_is_refused(tmp_path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ValueError, match=rf"mode {mode:04o}, which lets its group or others write in it.*chmod go-w"):
        ObjectStoreTransport(shared.as_uri(), 2, 0)
    assert list(shared.iterdir()) == []


def test_a_file_store_of_another_user_is_refused(tmp_path) -> None:
    if os.getuid() == 0:  # root hands a directory of its own to nobody
        other = tmp_path / "theirs"
        other.mkdir(mode=0o755)
        os.chown(other, 65534, 65534)
    else:
        other = next(Path(p) for p in ("/usr", "/etc", "/") if os.stat(p).st_uid != os.getuid())
    with pytest.raises(ValueError, match=r"owned by uid \d+.*, not by uid \d+ .*the user of this process"):
        ObjectStoreTransport(other.as_uri(), 2, 0)


def test_a_missing_file_store_is_created_private(tmp_path) -> None:
    ObjectStoreTransport((tmp_path / "new" / "store").as_uri(), 2, 0)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "store").st_mode) == 0o700


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["diloco.round_timeout=1e308"], "at most 86400 (a day), got 1e+308"),
        (["diloco.round_timeout=inf"], "should be a finite number"),
        (["diloco.replicas=100000"], "replicas must be in 1..1024"),
        (["diloco.outer_optimizer.lr=1e300"], "at most 10, got 1e+300"),
        (["diloco.transport=object_store", "diloco.secret_env=CM_TEST_UNSET_SECRET"], "'CM_TEST_UNSET_SECRET'"),
        (["diloco.transport=object_store", "diloco.secret_env=CM_TEST_EMPTY_SECRET"], "'CM_TEST_EMPTY_SECRET'"),
        (["diloco.secret_env=CM_TEST_SET_SECRET"], "drop secret_env or use transport: object_store"),
        (["diloco.transport=torchft", "diloco.lighthouse=http://[::1"], "is not a lighthouse's URL (it does not parse"),
        (["diloco.transport=torchft", "diloco.lighthouse=http://h:99999"], "is not a lighthouse's URL (it does not parse"),
        (["diloco.transport=torchft", "diloco.lighthouse=lighthouse:29510"], "it needs a scheme: http://"),
    ],
)
def test_diloco_values_past_their_limits_are_refused(monkeypatch, overrides: list[str], words: str) -> None:
    monkeypatch.delenv("CM_TEST_UNSET_SECRET", raising=False)
    monkeypatch.setenv("CM_TEST_EMPTY_SECRET", "")
    monkeypatch.setenv("CM_TEST_SET_SECRET", "x")
    with pytest.raises(TopologyError) as info:
        load_topology(TINY_DILOCO, overrides)
    assert words in str(info.value) and "diloco" in str(info.value)


def test_a_set_secret_env_passes_the_check(monkeypatch) -> None:
    monkeypatch.setenv("CM_TEST_SET_SECRET", "x")
    topology = load_topology(TINY_DILOCO, ["diloco.transport=object_store", "diloco.secret_env=CM_TEST_SET_SECRET"])
    assert topology.diloco.secret() == b"x"


# ----------------------------------------------------------------------------- a parent killed with SIGKILL

PARENT = """
import sys, time
from mesh.runtime.replicas import start_child
child = start_child([sys.executable, "-c", "import time; time.sleep(120)"], sys.stderr.buffer)
print(child.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for init to reap it has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after ``seconds`` (returns as soon as none is)."""
    deadline = time.monotonic() + seconds
    while (alive := [pid for pid in pids if not gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_a_child_started_for_a_replica_dies_with_its_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=ENV)
    child = int(parent.stdout.readline())
    assert not gone(child)
    parent.kill()
    parent.wait(timeout=10)
    assert wait_gone([child], 10.0) == []


def children_of(pid: int) -> list[int]:
    kids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat_file.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat_file.parent.name))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return kids


def procs_of(run: Path) -> list[dict]:
    return list(json.loads((run / "procs.json").read_text()).values())


@pytest.mark.slow
def test_diloco_replicas_and_their_meshes_die_within_10_s_of_a_sigkilled_parent(tmp_path) -> None:
    process = start(tmp_path, 200, "object_store")
    runs = [wait_for_run(tmp_path, i) for i in (0, 1)]
    for run in runs:
        wait_for_step(run, 5)  # checkpoints every 5 steps: step_000005 is written
    replicas = children_of(process.pid)
    meshes = [p["pid"] for run in runs for mesh in procs_of(run) for p in mesh["procs"]]
    assert len(replicas) == 2 and len(meshes) == 6 and not any(map(gone, replicas + meshes))
    process.kill()
    process.communicate(timeout=10)
    assert wait_gone(replicas + meshes, 10.0) == []
    for run in runs:
        assert (run / "checkpoints" / "step_000005" / "diloco_rank0.pt").is_file()


# ----------------------------------------------------------------------------- a stop during a sync


def test_a_stop_closes_a_round_whose_partner_never_comes_at_once(store: Store) -> None:
    asked = time.monotonic() + 0.5
    transport = store.transport(0, replicas=2, round_timeout=60.0, stop_requested=lambda: time.monotonic() > asked)
    result = transport.average(1, make_delta(0))
    assert result.members == (0,) and result.seconds < 5.0  # not the 60 s round_timeout
    late = store.transport(1, replicas=2, round_timeout=60.0).average(1, make_delta(1))
    assert late.members == (0,) and late.seconds < 5.0  # the partner that comes later adopts the closed round


@pytest.mark.slow
def test_a_signal_during_a_sync_whose_partner_never_comes_stops_within_10_s(tmp_path) -> None:
    """Replica 0 of 2 started alone: its first sync waits for replica 1, which never comes."""
    store_url = (tmp_path / "store").as_uri()
    sets = [*SMALL, "loop.steps=20", "diloco.transport=object_store", f"diloco.store={store_url}"]
    command = [sys.executable, "-m", "mesh.run", str(TINY_DILOCO), "--replica", "0", "--no-progress"]
    sets.append("diloco.round_timeout=600")
    command += ["--run-root", str(tmp_path / "runs"), *(arg for s in sets for arg in ("--set", s))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    waiting = tmp_path / "store" / "round_000001" / "rank_0" / "replica_0.safetensors"
    deadline = time.monotonic() + 240
    while not waiting.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    time.sleep(1.0)  # well into the wait for replica 1
    asked = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()  # a run still waiting for its round (the failure this test is about) goes with the test
    assert time.monotonic() - asked < 10.0 and process.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGINT: the run stopped at a step boundary with a checkpoint in"), err
    checkpoint = Path(last.split("--resume ")[1])
    assert checkpoint.name == "step_000005" and (checkpoint / "diloco_rank0.pt").is_file()


@pytest.mark.slow
def test_a_run_with_a_secret_refuses_an_unsigned_delta_naming_it_and_fails_with_one_paragraph(tmp_path) -> None:
    """Replica 0 of 2 with secret_env (the trainer's processes read the variable); a writer without the secret
    puts replica 1's delta, with a valid checksum, beside replica 0's: the run stops at the sync, rc 1."""
    store = tmp_path / "store"
    sets = [*SMALL, "loop.steps=20", "diloco.transport=object_store", f"diloco.store={store.as_uri()}"]
    sets += ["diloco.round_timeout=600", "diloco.secret_env=CM_TEST_DILOCO_SECRET"]
    command = [sys.executable, "-m", "mesh.run", str(TINY_DILOCO), "--replica", "0", "--no-progress"]
    command += ["--run-root", str(tmp_path / "runs"), *(arg for s in sets for arg in ("--set", s))]
    env = {**ENV, "CM_TEST_DILOCO_SECRET": SECRET.decode()}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        own = store / "round_000001" / "rank_0" / "replica_0.safetensors"
        deadline = time.monotonic() + 240
        while not own.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        from safetensors.torch import load

        forged = encode_delta(load(own.read_bytes()), replica=1, round=1, rank=0)  # unsigned, checksum valid
        (own.parent / ".forging").write_bytes(forged)
        (own.parent / ".forging").rename(own.parent / "replica_1.safetensors")
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "RefusedEntry: DiLoCo round 1 (rank 0): refused" in line and "replica_1.safetensors" in line
    assert "claims to be written by replica 1: it carries no signature" in line
