"""The object_store DiLoCo transport against real stores: a local directory, and a real S3 API
(moto's server on localhost) through s3fs. Replicas run as threads, and once as two separate OS
processes that share nothing but the store URL."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import torch
from moto.server import ThreadedMotoServer

from actors.diloco.object_store import ObjectStoreTransport, encode_delta
from actors.diloco.transport import RoundResult

LOGGER = "actors.diloco.object_store"
BUCKET = "diloco-test"
POLL = 0.05
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free localhost port, with the test bucket; stopped after the module."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3fs.S3FileSystem(
        key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    ).makedirs(BUCKET, exist_ok=True)  # moto keeps its buckets per process, across servers
    yield endpoint
    server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


@dataclass
class Store:
    url: str
    options: dict[str, Any]

    def transport(self, replica: int, replicas: int = 3, **kwargs: Any) -> ObjectStoreTransport:
        kwargs.setdefault("poll_s", POLL)
        return ObjectStoreTransport(self.url, replicas, replica, storage_options=self.options, **kwargs)

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return fsspec.core.url_to_fs(self.url, **self.options)

    def path(self, round: int, name: str, rank: int = 0) -> str:
        return f"{self.fs()[1]}/round_{round:06d}/rank_{rank}/{name}"

    def names(self, round: int, rank: int = 0) -> set[str]:
        fs, root = self.fs()
        return {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/round_{round:06d}/rank_{rank}", refresh=True)}


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "file":
        return Store(f"file://{tmp_path}/store", {})
    endpoint = request.getfixturevalue("s3_endpoint")
    return Store(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3_options(endpoint))


def make_delta(seed: int, shape: tuple[int, int] = (4, 3)) -> dict[str, torch.Tensor]:
    """An fp32 matrix and a bf16 vector: the mean must come back in each one's dtype."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(*shape, generator=g),
        "layer.bias": torch.randn(shape[1], generator=g).to(torch.bfloat16),
    }


def float32_mean(deltas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean the contract asks for: float32 accumulation in member order, given dtypes."""
    out = {}
    for name, ref in deltas[0].items():
        acc = torch.zeros(ref.shape, dtype=torch.float32)
        for d in deltas:
            acc += d[name].float()
        out[name] = (acc / len(deltas)).to(ref.dtype)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


def run_round(
    transports: dict[int, ObjectStoreTransport], round: int, deltas: dict[int, dict[str, torch.Tensor]]
) -> dict[int, RoundResult]:
    """Every transport averages ``round`` at once, each in its own thread (errors reraised here)."""
    with ThreadPoolExecutor(max_workers=len(transports)) as pool:
        futures = {i: pool.submit(t.average, round, deltas[i]) for i, t in transports.items()}
        return {i: future.result(timeout=30) for i, future in futures.items()}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_three_replicas_average_exactly(store: Store, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    deltas = {i: make_delta(i) for i in range(3)}
    transports = {i: store.transport(i, round_timeout=10.0) for i in range(3)}
    results = run_round(transports, 1, deltas)

    want = float32_mean([deltas[0], deltas[1], deltas[2]])
    exact = sum(d["layer.weight"].double() for d in deltas.values()) / 3
    torch.testing.assert_close(want["layer.weight"].double(), exact)  # the float32 mean is the mean
    for i, result in results.items():
        assert result.members == (0, 1, 2)
        assert_same(result.mean, want)
        assert result.seconds < 5.0  # closed when all were in, not at the 10 s timeout
    assert warnings_of(caplog) == []

    names = store.names(1)
    assert {"replica_0.safetensors", "replica_1.safetensors", "replica_2.safetensors"} <= names
    markers = sorted(n for n in names if n.startswith("closed_"))
    assert markers and all(n.endswith(".json") for n in markers)
    assert names - {f"replica_{i}.safetensors" for i in range(3)} == set(markers)  # no temporary leftovers

    fs, _ = store.fs()
    size = {n: fs.size(store.path(1, n)) for n in names}
    first_marker = size[markers[0]]  # every replica reads the smallest-id marker
    for i, result in results.items():
        own_marker = size.get(f"closed_{i}.json", 0)
        assert result.bytes_sent == size[f"replica_{i}.safetensors"] + own_marker
        others = sum(size[f"replica_{j}.safetensors"] for j in range(3) if j != i)
        assert result.bytes_received == others + first_marker


def test_single_replica_passes_through_and_writes_nothing(store: Store) -> None:
    delta = make_delta(0)
    transport = store.transport(0, replicas=1)
    result = transport.average(1, delta)
    assert result.members == (0,)
    assert all(result.mean[name] is delta[name] for name in delta)
    assert (result.bytes_sent, result.bytes_received) == (0, 0)
    fs, root = store.fs()
    assert not fs.exists(root)
    with pytest.raises(ValueError, match="rounds count from 1"):
        transport.average(0, delta)
    transport.close()
    with pytest.raises(RuntimeError, match="was closed"):
        transport.average(2, delta)


@pytest.mark.parametrize(
    ("replicas", "replica", "message"),
    [
        (3, 3, r"replica=3 is outside 0\.\.2 for replicas=3"),
        (3, -1, r"replica=-1 is outside 0\.\.2 for replicas=3"),
        (0, 0, r"replicas=0 is not a number of DiLoCo replicas; pass replicas >= 1"),
    ],
)
def test_replica_ids_out_of_range_refused(tmp_path, replicas: int, replica: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectStoreTransport(f"file://{tmp_path}", replicas, replica)
    assert list(tmp_path.iterdir()) == []


def close_without_replica_2(store: Store, caplog) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, RoundResult]]:
    """Round 1 of three replicas where replica 2 never shows up: it closes at the 0.5 s timeout."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    deltas = {i: make_delta(i) for i in range(3)}
    transports = {i: store.transport(i, round_timeout=0.5) for i in (0, 1)}
    return deltas, run_round(transports, 1, deltas)


def test_missing_replica_closes_at_timeout(store: Store, caplog) -> None:
    deltas, results = close_without_replica_2(store, caplog)
    want = float32_mean([deltas[0], deltas[1]])
    for result in results.values():
        assert result.members == (0, 1)
        assert_same(result.mean, want)
        assert result.seconds >= 0.5
    missing = [m for m in warnings_of(caplog) if "closed without replicas [2]" in m]
    assert len(missing) == 2 and all("round 1 " in m for m in missing)  # one line from each replica
    markers = {n for n in store.names(1) if n.startswith("closed_")}
    fs, _ = store.fs()
    for name in markers:
        assert json.loads(fs.cat_file(store.path(1, name)))["members"] == [0, 1]


def test_late_replica_adopts_the_members_of_the_closed_round(store: Store, caplog) -> None:
    deltas, results = close_without_replica_2(store, caplog)
    late = store.transport(2, round_timeout=10.0).average(1, deltas[2])
    assert late.members == (0, 1)
    assert_same(late.mean, results[0].mean)  # the others' mean, excluding its own delta
    assert late.seconds < 5.0  # the marker closed the round for it: no waiting for the timeout
    assert any("closed before replica 2's delta arrived" in m for m in warnings_of(caplog))
    names = store.names(1)
    assert "replica_2.safetensors" in names and "closed_2.json" not in names


def flip_last_byte(store: Store, path: str) -> None:
    fs, _ = store.fs()
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0xFF
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("damage", ["flipped byte", "wrong round", "other shape"])
def test_corrupt_delta_is_skipped_with_a_warning(store: Store, caplog, damage: str) -> None:
    """Replica 2's object is in the store but damaged or not what it should be: 0 and 1 read it,
    refuse it, name it, and average without it."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    deltas = {i: make_delta(i) for i in range(2)}
    bad = make_delta(2, shape=(3, 3) if damage == "other shape" else (4, 3))
    path = store.path(1, "replica_2.safetensors")
    fs, _ = store.fs()
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # a local directory; nothing on s3
    fs.pipe_file(path, encode_delta(bad, replica=2, round=7 if damage == "wrong round" else 1, rank=0))
    if damage == "flipped byte":
        flip_last_byte(store, path)
    stored = fs.size(path)

    results = run_round({i: store.transport(i, round_timeout=10.0) for i in (0, 1)}, 1, deltas)
    reason = {"flipped byte": "checksum mismatch", "wrong round": "round='7'", "other shape": "layout differs"}[damage]
    for result in results.values():
        assert result.members == (0, 1)
        assert_same(result.mean, float32_mean([deltas[0], deltas[1]]))
        assert result.bytes_received >= stored  # it was read, then refused
    skipped = [m for m in warnings_of(caplog) if "skipping" in m]
    assert len(skipped) == 2
    assert all("replica_2.safetensors" in m and reason in m for m in skipped)


def test_markers_with_different_members_resolve_to_the_smallest_readable_id(store: Store, caplog) -> None:
    """The race the markers settle: two replicas closed round 1 with different sets. Everyone adopts
    the smallest-id readable marker (a damaged one is skipped), here excluding the caller itself."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    deltas = {i: make_delta(i) for i in range(3)}
    fs, _ = store.fs()
    fs.makedirs(store.path(1, ""), exist_ok=True)  # a local directory; nothing on s3
    for i in (1, 2):
        fs.pipe_file(store.path(1, f"replica_{i}.safetensors"), encode_delta(deltas[i], replica=i, round=1, rank=0))
    fs.pipe_file(store.path(1, "closed_0.json"), b"{not json")
    for writer, members in ((1, [1, 2]), (2, [0, 1, 2])):
        record = {"round": 1, "rank": 0, "replica": writer, "members": members}
        fs.pipe_file(store.path(1, f"closed_{writer}.json"), json.dumps(record).encode())

    result = store.transport(0, round_timeout=10.0).average(1, deltas[0])
    assert result.members == (1, 2)
    assert_same(result.mean, float32_mean([deltas[1], deltas[2]]))
    assert "closed_0.json" in " ".join(m for m in warnings_of(caplog) if "damaged close marker" in m)
    assert store.transport(2).members_of(1) == (1, 2)


def test_a_late_replica_replays_closed_rounds(store: Store) -> None:
    transports = {i: store.transport(i, round_timeout=10.0) for i in range(3)}
    fresh = store.transport(2)
    assert fresh.latest_round() is None
    means = {}
    for round in (1, 2):
        deltas = {i: make_delta(10 * round + i) for i in range(3)}
        means[round] = run_round(transports, round, deltas)[0].mean

    assert fresh.latest_round() == 2
    for round in (1, 2):
        assert fresh.members_of(round) == (0, 1, 2)
        assert_same(fresh.mean_of(round), means[round])
    assert fresh.members_of(3) is None
    with pytest.raises(ValueError, match="round 3 has no close marker for rank 0"):
        fresh.mean_of(3)


def test_replay_after_a_timeout_gives_the_members_mean(store: Store, caplog) -> None:
    _, results = close_without_replica_2(store, caplog)
    fresh = store.transport(2)
    assert fresh.latest_round() == 1
    assert fresh.members_of(1) == (0, 1)
    assert_same(fresh.mean_of(1), results[0].mean)


def test_forget_before_deletes_older_rounds(store: Store) -> None:
    transports = {i: store.transport(i, replicas=2, round_timeout=10.0) for i in range(2)}
    for round in (1, 2, 3):
        run_round(transports, round, {i: make_delta(i) for i in range(2)})
    assert transports[0].forget_before(3) == (1, 2)
    assert transports[0].latest_round() == 3
    assert transports[0].members_of(1) is None and transports[0].members_of(3) == (0, 1)
    fs, root = store.fs()
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True)] == ["round_000003"]
    assert transports[1].forget_before(3) == ()  # nothing left to forget


PROCESS = """
import json, sys, torch
from actors.diloco.object_store import ObjectStoreTransport
url, options, replica, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
delta = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(replica))}
transport = ObjectStoreTransport(url, 2, replica, round_timeout=60.0, poll_s=0.05, storage_options=options)
result = transport.average(1, delta)
torch.save({"delta": delta, "mean": result.mean, "members": result.members}, out)
"""


def test_two_processes_share_only_the_store(store: Store, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outs = [tmp_path / f"replica_{i}.pt" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, store.url, json.dumps(store.options), str(i), str(outs[i])],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 0, stderr
    got = [torch.load(out) for out in outs]
    want = float32_mean([got[0]["delta"], got[1]["delta"]])
    for result in got:
        assert result["members"] == (0, 1)
        assert_same(result["mean"], want)


def test_missing_bucket_refused(s3_endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"bucket 'no-such-bucket' was not found.*Create the bucket first"):
        ObjectStoreTransport("s3://no-such-bucket/run", 2, 0, storage_options=s3_options(s3_endpoint))


def test_unreachable_store_refused() -> None:
    with socket.socket() as sock:  # bound, never listening: refused, and no other program can take the port
        sock.bind(("127.0.0.1", 0))
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{sock.getsockname()[1]}"},
            "config_kwargs": {"retries": {"max_attempts": 1}},
        }
        with pytest.raises(OSError, match=r"could not be reached or written \(EndpointConnectionError"):
            ObjectStoreTransport(f"s3://{BUCKET}/run", 2, 0, storage_options=options)
