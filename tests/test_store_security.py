"""The weight store against another local user, planted links, a tampered manifest, and dead runs' leftovers.

Real files, real processes: the second user is a real account (made with ``useradd``),
its actions run as that user through ``setpriv``; a dead run is a real process killed
with SIGKILL.
"""

from __future__ import annotations

import json
import os
import pickle
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from actors.basics.pids import start_ticks
from actors.weights import storedir
from actors.weights.errors import TornWeightsError, WeightSyncError
from actors.weights.follower import WeightFollower
from actors.weights.store import WeightPublisher
from actors.weights.storedir import create_store, reclaim_dead_stores, remove_store
from actors.weights.transports.in_place import WeightSubscriber

REPO = Path(__file__).resolve().parents[1]
ATTACKER = "cm-store-attacker"
PRECIOUS = b"precious: any change means the run wrote outside its store\n"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two tensors of one size (their offsets can be swapped) and a bf16 one (its dtype can be swapped for fp16)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(4, 4, generator=g),
        "b": torch.randn(4, 4, generator=g),
        "c": torch.randn(8, generator=g).bfloat16(),
    }


def tree(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``path``: (owner, mode, link target or content) -- links are read, never followed."""
    out = {}
    for entry in sorted(path.rglob("*")):
        st = entry.lstat()
        what = os.readlink(entry) if entry.is_symlink() else entry.read_bytes().hex() if entry.is_file() else "dir"
        out[str(entry.relative_to(path))] = (st.st_uid, stat.S_IMODE(st.st_mode), what)
    return out


@pytest.fixture
def predictable(monkeypatch: pytest.MonkeyPatch):
    """Make store names predictable: each call takes the next of the given random parts."""

    def use(*tokens: str) -> None:
        parts = iter(tokens)
        monkeypatch.setattr(storedir, "_token", lambda: next(parts))

    return use


def store_name(token: str) -> str:
    return f"composer-mesh-{os.getuid()}-{token}"


# ------------------------------------------------------------------------------ creation


def test_a_store_is_a_fresh_0700_directory_of_this_user_under_a_random_name(tmp_path: Path) -> None:
    old_umask = os.umask(0o277)  # mkdir(0o700) alone would give 0500: the mode is fixed after mkdir
    try:
        first, second = create_store(tmp_path), create_store(tmp_path)
    finally:
        os.umask(old_umask)
    assert first != second
    for store in (first, second):
        assert re.fullmatch(rf"composer-mesh-{os.getuid()}-[0-9a-f]{{32}}", store.name)
        st = store.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        owner = json.loads((store / "owner.json").read_text())
        assert owner["pid"] == os.getpid() and owner["start_ticks"] == start_ticks(os.getpid())


def test_a_taken_name_is_never_reused(tmp_path: Path, predictable) -> None:
    taken, elsewhere = tmp_path / store_name("a" * 32), tmp_path / "elsewhere"
    elsewhere.mkdir()
    taken.symlink_to(elsewhere)  # a link, not even a directory: mkdir fails on it rather than following it
    predictable("a" * 32, "a" * 32, "b" * 32)
    assert create_store(tmp_path) == tmp_path / store_name("b" * 32)
    assert taken.is_symlink() and os.readlink(taken) == str(elsewhere) and not any(elsewhere.iterdir())
    predictable(*["a" * 32] * storedir.CREATE_ATTEMPTS)
    with pytest.raises(WeightSyncError, match="8 fresh random names were all taken"):
        create_store(tmp_path)


def test_the_publisher_creates_a_missing_store_exclusively_0700(tmp_path: Path) -> None:
    store = tmp_path / "weights"
    WeightPublisher(store, weights(), slots=2).close()
    st = store.lstat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.lstat().st_mode) for p in store.iterdir()} == {
        "owner.json": 0o600,
        "manifest.json": 0o600,
        "slot-0.bin": 0o600,
        "slot-1.bin": 0o600,
    }


# ------------------------------------------------------------------- a second local user


@dataclass(frozen=True)
class User:
    uid: int
    gid: int

    def run(self, script: str, *args: str | Path) -> subprocess.CompletedProcess:
        """``sh -c script`` as this user (``$1``... are ``args``); only /bin tools, which every user can run."""
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "sh", "-c", script]
        return subprocess.run(
            [*command, "sh", *map(str, args)], check=False, capture_output=True, text=True, timeout=30
        )


@pytest.fixture(scope="module")
def attacker() -> User:
    """The second local user: a system account without home or shell, made once per machine and kept."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (to create it and to switch to it)")
    for tool in ("useradd", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: cannot act as a second local user")
    try:
        entry = pwd.getpwnam(ATTACKER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
            check=False,
            capture_output=True,
            text=True,
        )
        if made.returncode not in (0, 9):  # 9: made meanwhile by a concurrent test run
            pytest.fail(f"useradd {ATTACKER} failed: {made.stderr}")
        entry = pwd.getpwnam(ATTACKER)
    return User(entry.pw_uid, entry.pw_gid)


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory every local user may create entries in, sticky like /dev/shm (pytest's tmp_path is private)."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root)


@pytest.fixture
def victim(shared_root: Path) -> Path:
    """A file the run's user may write and the attacker may not: what a planted link would make the run overwrite."""
    path = shared_root / "victim.txt"
    path.write_bytes(PRECIOUS)
    path.chmod(0o644)
    return path


def plant(attacker: User, directory: Path, victim: Path, mode: str = "777") -> None:
    """As the attacker: a directory at ``directory`` with links to ``victim`` at every name the store writes."""
    links = " && ".join(
        f'ln -s "$2" "$1/{name}"' for name in ("manifest.json.tmp", "manifest.json", "slot-0.bin", "owner.json.tmp")
    )
    done = attacker.run(f'mkdir -m {mode} "$1" && {links}', directory, victim)
    assert done.returncode == 0, done.stderr


def test_a_precreated_store_name_with_planted_links_is_skipped_for_a_fresh_one(
    attacker: User, shared_root: Path, victim: Path, predictable
) -> None:
    planted = shared_root / store_name("0" * 32)
    plant(attacker, planted, victim)
    before = tree(planted)
    predictable("0" * 32, "1" * 32)
    store = create_store(shared_root)
    assert store == shared_root / store_name("1" * 32)
    publisher = WeightPublisher(store, weights(), slots=2)
    record = publisher.publish(weights(1), 1)
    subscriber = WeightSubscriber(store)
    assert torch.equal(subscriber.load(record)["a"], weights(1)["a"])
    subscriber.check_intact(record)
    subscriber.close()
    publisher.close()
    assert victim.read_bytes() == PRECIOUS
    assert tree(planted) == before  # nothing written into, through or over the attacker's directory
    assert all(uid == attacker.uid for uid, _, _ in before.values())


def test_only_precreated_names_mean_a_clear_error_not_a_shared_store(
    attacker: User, shared_root: Path, victim: Path, predictable
) -> None:
    plant(attacker, shared_root / store_name("0" * 32), victim)
    predictable(*["0" * 32] * storedir.CREATE_ATTEMPTS)
    with pytest.raises(WeightSyncError, match="all taken"):
        create_store(shared_root)
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.parametrize("mode", ["777", "700"])
def test_the_publisher_refuses_a_store_path_another_user_created(
    attacker: User, shared_root: Path, victim: Path, mode: str
) -> None:
    planted = shared_root / "weights"  # a path the run was told to use, guessed and taken first
    plant(attacker, planted, victim, mode)
    with pytest.raises(WeightSyncError, match=rf"owned by uid {attacker.uid} \({ATTACKER}\) with mode 0{mode}"):
        WeightPublisher(planted, weights(), slots=2)
    assert victim.read_bytes() == PRECIOUS
    assert sorted(tree(planted)) == ["manifest.json", "manifest.json.tmp", "owner.json.tmp", "slot-0.bin"]


def test_a_link_at_the_store_path_is_refused_by_publisher_and_subscriber(
    attacker: User, shared_root: Path, victim: Path
) -> None:
    target, link = shared_root / "attackers-dir", shared_root / "weights"
    done = attacker.run('mkdir -m 777 "$1" && ln -s "$1" "$2"', target, link)
    assert done.returncode == 0, done.stderr
    for open_store in (lambda: WeightPublisher(link, weights(), slots=2), lambda: WeightSubscriber(link)):
        with pytest.raises(WeightSyncError, match=f"is a symbolic link to {target}"):
            open_store()
    assert not any(target.iterdir())


def test_another_user_cannot_enter_or_write_a_store(attacker: User, shared_root: Path) -> None:
    store = create_store(shared_root)
    publisher = WeightPublisher(store, weights(), slots=2)
    for script in ('ls "$1"', 'touch "$1/slot-9.bin"', 'cat "$1/manifest.json"', 'mv "$1" "$1.taken"'):
        assert attacker.run(script, store).returncode != 0, script
    publisher.close()


@pytest.mark.parametrize("change", ["owner", "mode 0755", "mode 0770"])
def test_a_store_of_another_owner_or_mode_is_refused_by_publisher_and_subscriber(
    attacker: User, shared_root: Path, change: str
) -> None:
    store = create_store(shared_root)
    publisher = WeightPublisher(store, weights(), slots=2)
    record = publisher.publish(weights(1), 1)
    if change == "owner":
        os.chown(store, attacker.uid, attacker.gid)
    else:
        store.chmod(int(change.split()[1], 8))
    st = store.lstat()
    refusal = rf"weight store {store} is owned by uid {st.st_uid} .* with mode {stat.S_IMODE(st.st_mode):04o}; .*0700"
    with pytest.raises(WeightSyncError, match=refusal):
        WeightSubscriber(store)
    follower, model = WeightFollower(), {}
    with pytest.raises(WeightSyncError, match=refusal):
        follower.hold(record, model.update)
    assert model == {} and follower.held is None
    with pytest.raises(WeightSyncError, match=refusal):
        WeightPublisher(store, weights(), slots=2)
    publisher.close()


# ------------------------------------------------------------------ links inside a store


@pytest.mark.parametrize("name", ["manifest.json.tmp", "manifest.json", "slot-1.bin", "cuda-ipc.pkl"])
def test_a_publisher_never_writes_through_a_link_inside_its_store(tmp_path: Path, name: str) -> None:
    store, victim = tmp_path / "weights", tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    WeightPublisher(store, weights(), slots=2).close()
    (store / name).unlink(missing_ok=True)
    (store / name).symlink_to(victim)
    publisher = WeightPublisher(store, weights(), slots=2)  # a restarted trainer re-creating the same store
    record = publisher.publish(weights(1), 1)
    assert victim.read_bytes() == PRECIOUS
    assert not (store / name).is_symlink()
    subscriber = WeightSubscriber(store)
    assert torch.equal(subscriber.load(record)["b"], weights(1)["b"])
    subscriber.close()
    publisher.close()


@pytest.mark.parametrize("name", ["manifest.json", "slot-1.bin"])
def test_a_subscriber_refuses_a_link_inside_the_store(tmp_path: Path, name: str) -> None:
    store = tmp_path / "weights"
    publisher = WeightPublisher(store, weights(), slots=2)
    copy = tmp_path / f"copy-of-{name}"
    shutil.copyfile(store / name, copy)  # following the link would even find the right bytes
    (store / name).unlink()
    (store / name).symlink_to(copy)
    with pytest.raises(WeightSyncError, match=rf"{store / name} is a symbolic link"):
        WeightSubscriber(store)
    publisher.close()


class Planted:
    """A pickle that, if ever unpickled, proves it by creating a directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("how", ["link", "other owner"])
def test_cuda_ipc_handles_are_never_unpickled_from_a_file_this_user_did_not_write(tmp_path: Path, how: str) -> None:
    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    store, marker, evil = tmp_path / "weights", tmp_path / "unpickled", tmp_path / "evil.pkl"
    publisher = WeightPublisher(store, weights(), slots=2)  # the manifest a cuda_ipc subscriber reads first
    evil.write_bytes(pickle.dumps(Planted(marker)))
    if how == "link":
        (store / "cuda-ipc.pkl").symlink_to(evil)
    else:
        shutil.copyfile(evil, store / "cuda-ipc.pkl")
        os.chown(store / "cuda-ipc.pkl", 65534, 65534)
    with pytest.raises(WeightSyncError, match="symbolic link" if how == "link" else "not a regular file owned by"):
        WeightSubscriber(store, transport="cuda_ipc")
    assert not marker.exists()
    publisher.close()


# ------------------------------------------------------------------ a tampered manifest


def rewrite_manifest(store: Path, change) -> None:
    doc = json.loads((store / "manifest.json").read_bytes())
    change(doc, {e["name"]: e for e in doc["tensors"]})
    (store / "manifest.json").write_text(json.dumps(doc))


def swap_offsets(doc: dict, t: dict) -> None:
    t["a"]["offset"], t["b"]["offset"] = t["b"]["offset"], t["a"]["offset"]


@pytest.mark.parametrize(
    "change",
    [
        swap_offsets,
        lambda doc, t: t["c"].update(dtype="float16"),  # same size, other numbers
        lambda doc, t: t["a"].update(shape=[2, 8]),
        lambda doc, t: doc["tensors"].reverse(),  # the same layout, other bytes: still not what was published
    ],
    ids=["swapped offsets", "dtype", "shape", "reordered"],
)
def test_a_manifest_changed_after_publishing_is_torn_before_any_view(tmp_path: Path, change) -> None:
    store = tmp_path / "weights"
    publisher = WeightPublisher(store, weights(), slots=2)
    record = publisher.publish(weights(1), 1)
    rewrite_manifest(store, change)
    subscriber = WeightSubscriber(store)  # a well-formed layout: attaching works...
    with pytest.raises(TornWeightsError, match="manifest .* is not the layout version 1 was published with"):
        subscriber.load(record)  # ...but no view of the version is built from it
    subscriber.close()
    follower, model = WeightFollower(), {}
    with pytest.raises(TornWeightsError, match="No views are built"):
        follower.hold(record, model.update)
    assert model == {} and follower.held is None
    publisher.close()


def test_a_manifest_changed_before_publishing_is_torn_too(tmp_path: Path) -> None:
    """A follower that attached to a tampered manifest refuses every later version, not just the first."""
    store = tmp_path / "weights"
    publisher = WeightPublisher(store, weights(), slots=2)
    rewrite_manifest(store, swap_offsets)
    subscriber = WeightSubscriber(store)
    for version in (0, 1, 2):
        with pytest.raises(TornWeightsError, match="not the layout"):
            subscriber.load(publisher.publish(weights(version), version))
    subscriber.close()
    publisher.close()


def setter(key: str, value):
    return lambda doc, t: doc.update({key: value})


def entry(tensor: str, **fields):
    return lambda doc, t: t[tensor].update(fields)


MALFORMED = {
    "not json": (b"{", "it is not JSON"),
    "not utf-8": (b'{"format": "\xff"}', "it is not JSON"),
    "deeply nested": (b"[" * 100_000, "it is not JSON"),
    "a list": (b"[]", "it holds a JSON list, not an object"),
    "old format": (setter("format", 1), "format 1, this code reads format 2"),
    "no tensors": (lambda doc, t: doc.pop("tensors"), "'tensors' is missing"),
    "slots as text": (setter("slots", "2"), "'slots' is '2', not of type int"),
    "slots as bool": (setter("slots", True), "'slots' is True, not of type int"),
    "no slots": (setter("slots", 0), "'slots' is 0, less than 1"),
    "entry not an object": (lambda doc, t: doc["tensors"].append(7), "tensor #3 is not an object"),
    "entry without offset": (lambda doc, t: t["b"].pop("offset"), "tensor #1 is not an object with exactly the keys"),
    "negative offset": (entry("b", offset=-64), "tensor #1: 'offset' is -64, less than 0"),
    "negative size": (entry("b", nbytes=-1), "tensor #1: 'nbytes' is -1, less than 0"),
    "negative dimension": (entry("a", shape=[-4, -4]), r"tensor #0: 'shape' is \[-4, -4\], not a list of sizes"),
    "shape not a list": (entry("a", shape="4x4"), "tensor #0: 'shape' is '4x4', not of type list"),
    "unknown dtype": (entry("c", dtype="float99"), "tensor 'c' has unknown dtype 'float99'"),
    "not a dtype": (entry("c", dtype="nn"), "tensor 'c' has unknown dtype 'nn'"),
    "size not its shape's": (entry("a", nbytes=32), "tensor 'a' claims 32 bytes, its float32\\[4, 4\\] has 64"),
    "misaligned": (entry("b", offset=72), "tensor 'b' is at offset 72, not a multiple of 64"),
    "past the end": (entry("c", offset=1 << 20), "tensor 'c' ends at byte 1048592, past the data region's"),
    "overlapping": (entry("b", offset=0), "tensors 'a' and 'b' overlap|tensors 'b' and 'a' overlap"),
    "same name twice": (entry("b", name="a"), "two tensors have the same name"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_a_clear_weight_sync_error(tmp_path: Path, case: str) -> None:
    store = tmp_path / "weights"
    publisher = WeightPublisher(store, weights(), slots=2)
    record = publisher.publish(weights(1), 1)
    damage, message = MALFORMED[case]
    if isinstance(damage, bytes):
        (store / "manifest.json").write_bytes(damage)
    else:
        rewrite_manifest(store, damage)
    with pytest.raises(WeightSyncError, match=message) as refused:
        WeightSubscriber(store)
    assert type(refused.value) is WeightSyncError and str(store / "manifest.json") in str(refused.value)
    follower, model = WeightFollower(), {}
    with pytest.raises(WeightSyncError):
        follower.hold(record, model.update)
    assert model == {}
    publisher.close()


# ------------------------------------------------------------------------- dead runs' stores


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_the_store_of_a_killed_run_is_reclaimed_and_a_live_ones_kept(tmp_path: Path) -> None:
    run = (
        "import sys, time, torch\n"
        "from actors.weights.store import WeightPublisher\n"
        "from actors.weights.storedir import create_store\n"
        "store = create_store(sys.argv[1])\n"
        "WeightPublisher(store, {'w': torch.ones(1000)}, slots=2).publish({'w': torch.ones(1000)}, 0)\n"
        "print(store, flush=True)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", run, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        dead = Path(child.stdout.readline().strip())
        assert (dead / "slot-1.bin").is_file()
        live = create_store(tmp_path)
        assert reclaim_dead_stores(tmp_path) == []  # the other run is alive yet
    finally:
        child.send_signal(signal.SIGKILL)  # no cleanup runs
        child.wait()
        child.stdout.close()
    assert dead.is_dir()
    assert reclaim_dead_stores(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir()


def record_owner(store: Path, **changes) -> None:
    owner = json.loads((store / "owner.json").read_text()) | changes
    (store / "owner.json").write_text(json.dumps(owner))


def test_a_reused_pid_does_not_keep_a_store_alive_but_another_hosts_run_does(tmp_path: Path) -> None:
    reused, remote = create_store(tmp_path), create_store(tmp_path)
    record_owner(reused, start_ticks=start_ticks(os.getpid()) - 1)  # this pid, but a process started earlier
    record_owner(remote, pid=2**22 + 1, host="another-host")  # cannot be asked: kept
    assert reclaim_dead_stores(tmp_path) == [reused]
    assert remote.is_dir()


def test_reclaim_follows_no_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_bytes(PRECIOUS)
    looks_like_a_store = root / store_name("c" * 32)
    looks_like_a_store.symlink_to(outside)  # a link named like a dead store: never followed, never removed
    dead = create_store(root)
    record_owner(dead, pid=2**22 + 1, start_ticks=1)  # pid_max is at most 2**22: no such process
    (dead / "slot-0.bin").symlink_to(outside / "keep.txt")
    (dead / "sub").symlink_to(outside)
    assert reclaim_dead_stores(root) == [dead]
    assert looks_like_a_store.is_symlink() and (outside / "keep.txt").read_bytes() == PRECIOUS
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_reclaim_leaves_what_is_not_a_dead_store_of_this_user(tmp_path: Path) -> None:
    young, old = tmp_path / store_name("d" * 32), tmp_path / store_name("e" * 32)
    for unrecorded in (young, old):  # a creator killed between mkdir and its record
        unrecorded.mkdir(mode=0o700)
    stale = time.time() - storedir.UNRECORDED_GRACE_S - 5
    os.utime(old, (stale, stale))
    other_uid = tmp_path / f"composer-mesh-{os.getuid() + 1}-{'f' * 32}"
    other_uid.mkdir()
    not_a_dir = tmp_path / store_name("0" * 32)
    not_a_dir.write_bytes(PRECIOUS)
    unrelated = tmp_path / "composer-mesh-notes"
    unrelated.mkdir()
    assert reclaim_dead_stores(tmp_path) == [old]
    assert young.is_dir() and other_uid.is_dir() and not_a_dir.read_bytes() == PRECIOUS and unrelated.is_dir()


def test_reclaim_leaves_another_users_store_and_links_alone(attacker: User, shared_root: Path, victim: Path) -> None:
    ours = shared_root / "ours"  # what an attacker would like the run to delete
    ours.mkdir()
    (ours / "keep.txt").write_bytes(PRECIOUS)
    theirs, link = shared_root / store_name("1" * 32), shared_root / store_name("2" * 32)
    done = attacker.run(
        'mkdir -m 700 "$1" && ln -s "$3" "$1/slot-0.bin" && ln -s "$4" "$2"', theirs, link, victim, ours
    )
    assert done.returncode == 0, done.stderr
    assert reclaim_dead_stores(shared_root) == []  # their dir carries our uid in its name and no record: not ours
    assert (ours / "keep.txt").read_bytes() == PRECIOUS and victim.read_bytes() == PRECIOUS
    assert link.is_symlink() and (theirs / "slot-0.bin").is_symlink()
    assert remove_store(link) is False and remove_store(theirs) is False
    assert (ours / "keep.txt").read_bytes() == PRECIOUS and link.is_symlink() and theirs.is_dir()


def test_remove_store_removes_the_store_and_nothing_else(tmp_path: Path) -> None:
    store, outside = create_store(tmp_path), tmp_path / "outside.txt"
    outside.write_bytes(PRECIOUS)
    WeightPublisher(store, weights(), slots=2).close()
    (store / "link").symlink_to(outside)
    assert remove_store(store) is True and not store.exists()
    assert outside.read_bytes() == PRECIOUS
    assert remove_store(store) is False
