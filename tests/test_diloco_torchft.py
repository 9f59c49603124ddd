"""The torchft transport of DiLoCo on a real lighthouse and real Managers, no mocks.

The lighthouse runs in this process (``Lighthouse.start``); every trainer rank of every replica is its
own OS process (``tests/diloco_torchft_worker.py``, torchft's Manager is per process), which reports
through files. Means are compared bit for bit: the deltas are chosen so that their mean is exact in
float32, float64 and bfloat16.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from diloco_torchft_worker import delta_for, initial_state

from actors.diloco.torchft import Lighthouse, LighthouseUnreachable, TorchFTTransport

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "diloco_torchft_worker.py"
HEARTBEAT_MS = 1500


class Workers:
    """Worker processes of one test, their files, and their cleanup."""

    def __init__(self, dir: Path, lighthouse: str) -> None:
        self.dir, self.lighthouse = dir, lighthouse
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, tag: str, replica: int, rank: int = 0, world: int = 1, calls: int = 1, **plan) -> None:
        plan = {
            "dir": str(self.dir),
            "lighthouse": self.lighthouse,
            "tag": tag,
            "replica": replica,
            "rank": rank,
            "world": world,
            "calls": calls,
            **plan,
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(self.dir / f"{tag}.log", "wb") as log:
            self.procs[tag] = subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(plan)], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def log(self, tag: str) -> str:
        return (self.dir / f"{tag}.log").read_text(errors="replace")[-3000:]

    def wait_file(self, name: str, timeout: float = 60.0) -> Path:
        path = self.dir / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            for tag, proc in self.procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    pytest.fail(f"worker {tag} exited with {proc.returncode} waiting for {name}:\n{self.log(tag)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {name} after {timeout} s; logs:\n" + "\n".join(self.log(t) for t in self.procs))
            time.sleep(0.02)
        return path

    def result(self, tag: str, call: int, timeout: float = 60.0) -> dict:
        return torch.load(self.wait_file(f"{tag}_call{call}.pt", timeout), weights_only=False)

    def signal(self, name: str) -> None:
        torch.save(None, self.dir / name)

    def finish(self, timeout: float = 30.0) -> None:
        for tag, proc in self.procs.items():
            if proc.returncode == -signal.SIGKILL:
                continue
            assert proc.wait(timeout) == 0, f"worker {tag} exited with {proc.returncode}:\n{self.log(tag)}"

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def expected_mean(replicas: list[int], rank: int, round: int) -> dict[str, torch.Tensor]:
    """(Σ deltas) / n in each tensor's dtype: the transport's arithmetic, exact for these deltas."""
    deltas = [delta_for(r, rank, round) for r in replicas]
    return {name: sum(d[name] for d in deltas) / len(replicas) for name in deltas[0]}


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), (name, got[name], value)


def ring_bytes(n: int, rank: int = 0) -> int:
    """The transport's estimate: a ring all-reduce of the contributions vector and the flat share."""
    share = sum(t.numel() * t.element_size() for t in delta_for(0, rank, 1).values())
    return int(2 * (n - 1) * (share + 4 * n) / n)


@pytest.fixture
def workers(tmp_path):
    made: list[tuple[Lighthouse, Workers]] = []

    def start(**lighthouse) -> Workers:
        lh = Lighthouse.start(**{"heartbeat_timeout_ms": HEARTBEAT_MS, "quorum_tick_ms": 50, **lighthouse})
        w = Workers(tmp_path, lh.address)
        made.append((lh, w))
        return w

    yield start
    for lh, w in made:
        w.kill_all()
        lh.stop()


def test_two_replicas_average_exactly(workers):
    w = workers(min_replicas=2)
    for replica in (0, 1):
        w.spawn(f"r{replica}", replica, calls=2)
    for call in (1, 2):
        results = [w.result(f"r{replica}", call) for replica in (0, 1)]
        for res in results:
            assert res["members"] == (0, 1)
            assert res["committed"] == call
            assert_exact(res["mean"], expected_mean([0, 1], 0, call))
            assert res["bytes_sent"] == res["bytes_received"] == ring_bytes(2)
            assert res["seconds"] > 0
        assert torch.equal(results[0]["state"]["theta0"], results[1]["state"]["theta0"])
    w.finish()


def test_world_two_each_rank_averages_its_share(workers):
    """Two replicas of two ranks each: rank r of replica 0 averages with rank r of replica 1 only."""
    w = workers(min_replicas=2)
    for replica in (0, 1):
        for rank in (0, 1):
            w.spawn(f"r{replica}k{rank}", replica, rank=rank, world=2, host_store=True)
    for replica in (0, 1):
        for rank in (0, 1):
            res = w.result(f"r{replica}k{rank}", 1)
            assert res["members"] == (0, 1)
            assert_exact(res["mean"], expected_mean([0, 1], rank, 1))
            assert res["bytes_sent"] == ring_bytes(2, rank)
    w.finish()


@pytest.fixture(scope="module")
def loss_and_heal(tmp_path_factory):
    """Replicas 0 (``a``) and 1 (``b``); ``b`` is killed after round 1, ``a`` runs round 2 alone, a new
    replica 1 (``b2``) starts from scratch, is healed from ``a`` in round 3 and averages with it in round 4."""
    lh = Lighthouse.start(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS, quorum_tick_ms=50)
    w = Workers(tmp_path_factory.mktemp("loss_and_heal"), lh.address)
    try:
        both = ["ready_a", "ready_b"]  # round 1 only once both Managers beat (min_replicas is 1)
        w.spawn(
            "a",
            0,
            calls=4,
            wait_before={"1": both, "2": ["go2"], "3": ["entering_b2_1"]},
            # b2 must ask for round 3's quorum first: a alone would make a fast quorum of the last one ({a})
            sleep_before={"1": 0.3, "3": 0.5},
        )
        w.spawn("b", 1, calls=2, wait_before={"1": both, "2": ["never"]}, sleep_before={"1": 0.3})
        round1 = {tag: w.result(tag, 1) for tag in ("a", "b")}
        w.procs["b"].send_signal(signal.SIGKILL)
        w.procs["b"].wait()
        w.signal("go2")
        round2 = w.result("a", 2)
        w.spawn("b2", 1, calls=2)
        a3, a4 = w.result("a", 3), w.result("a", 4)
        b3, b4 = w.result("b2", 1), w.result("b2", 2)
        loaded = torch.load(w.wait_file("b2_loaded.pt"), weights_only=False)
        w.finish()
        yield {"round1": round1, "a2": round2, "a3": a3, "a4": a4, "b3": b3, "b4": b4, "loaded": loaded}
    finally:
        w.kill_all()
        lh.stop()


def test_replica_loss(loss_and_heal):
    for res in loss_and_heal["round1"].values():
        assert res["members"] == (0, 1)
        assert_exact(res["mean"], expected_mean([0, 1], 0, 1))
    a2 = loss_and_heal["a2"]
    # the survivor's next round waits out the dead replica's heartbeat, no longer
    assert a2["seconds"] < HEARTBEAT_MS / 1000 + 3.0, a2["seconds"]
    assert a2["members"] == (0,)
    assert_exact(a2["mean"], delta_for(0, 0, 2))  # alone: the mean is its own delta
    assert a2["bytes_sent"] == a2["bytes_received"] == 0
    assert a2["committed"] == 2


def test_heal_from_survivor(loss_and_heal):
    d = loss_and_heal
    survivor = d["a2"]["state"]  # a's outer state when the quorum of round 3 formed
    assert d["loaded"]["round"] == survivor["round"] == 2
    assert torch.equal(d["loaded"]["theta0"], survivor["theta0"])
    # round 3: b2 is healed, contributes nothing (its delta was against a stale θ₀) and gets a's mean
    for res in (d["a3"], d["b3"]):
        assert res["members"] == (0,)
        assert res["committed"] == 3
        assert_exact(res["mean"], delta_for(0, 0, 3))
    assert torch.equal(d["a3"]["state"]["theta0"], d["b3"]["state"]["theta0"])
    theta0_bytes = initial_state(0)["theta0"].numel() * 4
    assert d["b3"]["bytes_received"] == ring_bytes(2) + theta0_bytes
    assert d["a3"]["bytes_sent"] == ring_bytes(2) + theta0_bytes
    # round 4: in lockstep, both contribute
    for res in (d["a4"], d["b4"]):
        assert res["called_round"] == 4 and res["committed"] == 4
        assert res["members"] == (0, 1)
        assert_exact(res["mean"], expected_mean([0, 1], 0, 4))
    assert torch.equal(d["a4"]["state"]["theta0"], d["b4"]["state"]["theta0"])


def test_unreachable_lighthouse_is_one_clear_error():
    with socket.socket() as bound:  # bound, never listening: refused, and no other program can take the port
        bound.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{bound.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(LighthouseUnreachable) as err:
            TorchFTTransport(address, 0, 0, 1, "127.0.0.1", 0, dict, lambda state: None, connect_timeout_s=2.0)
    message = str(err.value)
    assert time.monotonic() - start < 5
    assert address in message and "Start the lighthouse" in message and "port" in message
    assert "\n" not in message and "Traceback" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__

    with pytest.raises(LighthouseUnreachable, match="not http://host:port"):
        TorchFTTransport("http://nohost", 0, 0, 1, "127.0.0.1", 0, dict, lambda state: None)


def test_lighthouse_address_and_stop():
    lh = Lighthouse.start(heartbeat_timeout_ms=HEARTBEAT_MS)
    host, port = lh.address.removeprefix("http://").rsplit(":", 1)
    assert lh.address.startswith("http://") and host == socket.gethostname()
    socket.create_connection((host, int(port)), timeout=2).close()
    lh.stop()
    lh.stop()  # idempotent
