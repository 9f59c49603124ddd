"""Weight sync: exact round trips over shm, rdma and cuda_ipc, zero-copy views, and loud failures."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import cloudpickle
import pytest
import torch
from monarch.actor import Actor, endpoint, this_host
from tmpfs import tmpfs
from torch.utils._python_dispatch import TorchDispatchMode

from actors.weights.checksum import DEVICE_CHUNK_WORDS, device_checksum
from actors.weights.config import choose_transport
from actors.weights.errors import StaleWeightsError, TornWeightsError, WeightSyncError
from actors.weights.follower import WeightFollower
from actors.weights.manifest import HEADER_BYTES
from actors.weights.record import RemoteSlot, WeightVersion
from actors.weights.store import WeightPublisher
from actors.weights.storedir import remove_store
from actors.weights.transports import in_place
from actors.weights.transports.backend import TRANSPORTS, SlotBackend, slot_backend
from actors.weights.transports.in_place import WeightSubscriber
from actors.weights.transports.shm import slot_file
from mesh.topology.preflight import load_plan

cloudpickle.register_pickle_by_value(
    sys.modules[__name__]
)  # the actors below run in procs that cannot import this file
REPO = Path(__file__).resolve().parents[1]


def state_dict(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """fp32, bf16 and int64 tensors; sizes that are not multiples of the 64-byte alignment."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "embed.weight": torch.randn(7, 5, generator=g),
        "layer.weight": torch.randn(3, 11, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.randint(-(2**40), 2**40, (2,), generator=g),
        "head.weight": torch.randn(4, 6, generator=g).t(),  # non-contiguous source
    }
    return {name: tensor.to(device) for name, tensor in sd.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "weights"


@pytest.fixture
def pair(store: Path):
    pub = WeightPublisher(store, state_dict(), slots=2)
    sub = WeightSubscriber(store)
    yield pub, sub
    sub.close()
    pub.close()


def test_roundtrip_in_another_process_under_dev_shm(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this host")
    store = Path("/dev/shm") / f"composer-mesh-test-{uuid.uuid4().hex}"
    pub = WeightPublisher(store, state_dict(0), slots=3)
    try:
        pub.publish(state_dict(1), 4)
        sd = state_dict(2)
        record = tmp_path / "version.pkl"
        record.write_bytes(pickle.dumps(pub.publish(sd, 5)))
        out = tmp_path / "loaded.pt"
        child = (
            "import pickle, sys, torch\n"
            "from actors.weights.transports.in_place import WeightSubscriber\n"
            "want = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "sub = WeightSubscriber(want.store)\n"
            "views = sub.load(want)\n"
            "sub.check_intact(want)\n"
            "torch.save({k: v.clone() for k, v in views.items()}, sys.argv[2])\n"
        )
        path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        subprocess.run([sys.executable, "-c", child, str(record), str(out)], check=True, env=env, timeout=60)
        assert_same(torch.load(out), sd)
    finally:
        pub.close()
        shutil.rmtree(store)
    assert not store.exists()


def test_load_returns_zero_copy_views_of_the_slot(pair) -> None:
    pub, sub = pair
    views = sub.load(pub.publish(state_dict(1), 0))
    assert_same(views, state_dict(1))
    mapping = sub._slots[0].mm
    start = torch.frombuffer(memoryview(mapping), dtype=torch.uint8).data_ptr()
    for v in views.values():
        assert start + HEADER_BYTES <= v.data_ptr() < start + len(mapping)
    pub.publish(state_dict(2), 2)  # same slot: the old views now show the new bytes
    assert_same(views, state_dict(2))


def test_model_adopts_the_views_with_load_state_dict_assign(store: Path) -> None:
    trained = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    pub = WeightPublisher(store, trained.state_dict(), slots=2)
    sub = WeightSubscriber(store)
    want = pub.publish(trained.state_dict(), 0)
    assert sub.store == want.store  # what a generator compares to decide whether to re-attach
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    fresh.load_state_dict(sub.load(want), assign=True, strict=True)
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))
    pub.publish({k: v + 1 for k, v in trained.state_dict().items()}, 2)  # same slot: the model sees it
    assert torch.equal(fresh[0].bias, trained[0].bias.detach() + 1)
    with pytest.raises(TornWeightsError):
        sub.check_intact(want)
    sub.close()
    pub.close()


def test_lazy_conj_and_neg_views_are_copied_resolved(store: Path) -> None:
    # Contiguous, yet their raw bytes are not their values: a raw memcpy would be wrong.
    z, x = torch.randn(5, dtype=torch.complex64), torch.randn(6)
    sd = {"conj": z.conj(), "neg": torch._neg_view(x), "param": torch.nn.Parameter(x.clone())}
    assert sd["conj"].is_conj() and sd["neg"].is_neg() and sd["neg"].is_contiguous()
    pub = WeightPublisher(store, sd, slots=1)
    sub = WeightSubscriber(store)
    views = sub.load(pub.publish(sd, 0))
    assert torch.equal(views["conj"], z.conj().resolve_conj())
    assert torch.equal(views["neg"], -x)
    assert torch.equal(views["param"], x) and not views["param"].requires_grad
    sub.close()
    pub.close()


def test_stale_after_the_slot_is_overwritten(pair) -> None:
    pub, sub = pair
    old = pub.publish(state_dict(0), 0)
    pub.publish(state_dict(1), 1)
    new = pub.publish(state_dict(2), 2)
    with pytest.raises(StaleWeightsError, match=r"holds version 2 \(READY\), not version 0.*must not sample"):
        sub.load(old)
    assert_same(sub.load(new), state_dict(2))


def test_stale_when_never_published(pair) -> None:
    pub, sub = pair
    done = pub.publish(state_dict(0), 0)
    with pytest.raises(StaleWeightsError, match="holds no version"):
        sub.load(dataclasses.replace(done, version=1))  # slot 1 is still empty
    with pytest.raises(StaleWeightsError, match=r"holds version 0 \(READY\), not version 2"):
        sub.load(dataclasses.replace(done, version=2))  # newer than anything published


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_corrupt_data_byte_is_torn(store: Path, where: str) -> None:
    # Small chunks, so the store is hashed in several chunks and every one must count.
    pub = WeightPublisher(store, state_dict(), slots=2, chunk_bytes=128)
    sub = WeightSubscriber(store)
    want = pub.publish(state_dict(3), 1)
    sub.load(want)
    offset = HEADER_BYTES + {"first": 0, "middle": want.nbytes // 2, "last": want.nbytes - 1}[where]
    with open(slot_file(store, 1), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    views = sub.load(want)  # the header is fine: views come back, and sampling may start...
    with pytest.raises(TornWeightsError, match="corrupt"):
        sub.check_intact(want)  # ...but nothing leaves the generator: the background hash refuses the bytes
    assert views
    sub.close()
    pub.close()


def test_verification_starts_after_load_and_sees_later_damage(pair, store: Path) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 0)
    sub.load(want)  # the header is checked now; the bytes are hashed from start_verification on
    with open(slot_file(store, 0), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\xff")
    with pytest.raises(TornWeightsError, match="corrupt"):
        sub.check_intact(want)  # nobody started the verification: check_intact runs it, and refuses


def test_failed_publish_leaves_the_slot_writing_not_ready(pair) -> None:
    pub, sub = pair
    old = pub.publish(state_dict(0), 0)
    broken = {k: v.to("meta") if k == "step" else v for k, v in state_dict(1).items()}
    with pytest.raises((NotImplementedError, RuntimeError)):  # meta tensors have no bytes to copy
        pub.publish(broken, 2)
    for version in (old, dataclasses.replace(old, version=2)):
        with pytest.raises(StaleWeightsError, match=r"holds version 2 \(WRITING\)"):
            sub.load(version)


def test_wrong_checksum_in_the_record_is_torn(pair) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 0)
    with pytest.raises(TornWeightsError, match="expected"):
        sub.load(dataclasses.replace(want, checksum=want.checksum ^ 1))


@pytest.mark.parametrize(
    ("word", "load_error"), [(1, StaleWeightsError), (2, TornWeightsError)], ids=["stamp", "checksum"]
)
def test_overwritten_header_fails_check_intact_and_load(pair, store: Path, word: int, load_error: type) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 1)
    sub.load(want)
    sub.check_intact(want)
    with open(slot_file(store, 1), "r+b") as f:  # scribble over one int64 header word; the data stay intact
        f.seek(8 * word)
        f.write(b"\x7f" * 8)
    with pytest.raises(TornWeightsError, match="overwritten while in use"):
        sub.check_intact(want)
    with pytest.raises(load_error):
        sub.load(want)


def test_check_intact_detects_republish_of_the_slot(pair) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 0)
    sub.load(want)
    sub.check_intact(want)  # verified first: otherwise the republish may race the background hash
    pub.publish(state_dict(1), 2)
    with pytest.raises(TornWeightsError, match=r"now holds version 2 \(READY\)"):
        sub.check_intact(want)


def test_slot_rewritten_while_hashing_is_torn(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 0)
    real = in_place.data_checksum

    def hash_then_overwrite(*args):
        digest = real(*args)
        monkeypatch.setattr(in_place, "data_checksum", real)
        pub.publish(state_dict(1), 2)  # the writer laps the reader mid-verify
        return digest

    monkeypatch.setattr(in_place, "data_checksum", hash_then_overwrite)
    sub.load(want)
    with pytest.raises(TornWeightsError, match="rewritten .* while version 0 was being verified"):
        sub.check_intact(want)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda sd: sd.update({"layer.bias": sd["layer.bias"].float()}), "layer.bias"),
        (lambda sd: sd.update({"embed.weight": sd["embed.weight"][:6]}), "embed.weight"),
        (lambda sd: sd.pop("step"), "step"),
        (lambda sd: sd.update({"extra": torch.zeros(1)}), "extra"),
    ],
    ids=["dtype", "shape", "missing", "extra"],
)
def test_publish_rejects_a_different_state_dict(pair, change, key: str) -> None:
    pub, sub = pair
    sd = state_dict(0)
    change(sd)
    with pytest.raises(WeightSyncError, match=f"key '{key}'"):
        pub.publish(sd, 0)
    with pytest.raises(StaleWeightsError):  # nothing was stamped READY
        sub.load(WeightVersion(0, 0, sub.nbytes, str(sub.store)))


def test_record_from_another_store_is_rejected(pair, tmp_path: Path) -> None:
    pub, sub = pair
    want = pub.publish(state_dict(0), 0)
    with pytest.raises(WeightSyncError, match="not from this store"):
        sub.load(dataclasses.replace(want, store=str(tmp_path / "elsewhere")))


def test_a_deleted_store_is_refused(store: Path) -> None:
    pub = WeightPublisher(store, state_dict(), slots=2)
    assert sorted(p.name for p in store.iterdir()) == ["manifest.json", "owner.json", "slot-0.bin", "slot-1.bin"]
    pub.close()
    assert remove_store(store)  # what the trainer does when the run stops it
    with pytest.raises(WeightSyncError, match="no weight store"):
        WeightSubscriber(store)


def test_a_store_that_does_not_fit_its_filesystem_is_refused_naming_the_free_space(tmp_path: Path) -> None:
    """A node's full /dev/shm fails the trainer's start with a cause and a fix, never SIGBUS mid-publish."""
    big = {"w": torch.zeros(300_000)}  # 1.2 MB a slot: the second of two does not fit in 2 MiB
    with tmpfs(tmp_path / "shm", size="2m") as shm:
        with pytest.raises(WeightSyncError) as info:
            WeightPublisher(shm / "store", big, slots=2)
    message = str(info.value)
    assert (
        f"cannot reserve the weight store's 2 slots of {HEADER_BYTES + 1_200_000} bytes in {shm / 'store'}" in message
    )
    assert "No space left on device (ENOSPC;" in message and "lower loop.max_policy_lag" in message


def test_tensors_are_64_byte_aligned_in_manifest_order(pair) -> None:
    pub, _ = pair
    entries = pub.manifest.tensors
    assert [e.name for e in entries] == list(state_dict())
    assert all(e.offset % 64 == 0 for e in entries)
    assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(entries))


class OpsSeen(TorchDispatchMode):
    """The names of the torch ops run under it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_store_in_the_followers_dtype_casts_each_tensor_as_it_copies_it(store: Path) -> None:
    """``dtype``: floating tensors are published in it (rounded as ``.to`` rounds), others as they
    are; the manifest records it, the checksum covers the published bytes, and no cast copy of a
    tensor is made on the way (a cast ``copy_`` into the slot's view, never ``.to``)."""
    pub = WeightPublisher(store, state_dict(0), slots=2, dtype=torch.bfloat16)
    sub = WeightSubscriber(store)
    published = state_dict(1)
    with OpsSeen() as seen:
        want = pub.publish(published, 0)
    assert "copy_" in seen.names and "_to_copy" not in seen.names
    views = sub.load(want)
    sub.check_intact(want)  # the background hash of the bf16 bytes matches the record
    cast = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in published.items()}
    assert_same(views, cast)
    assert {e.name: e.dtype for e in sub.manifest.tensors}["embed.weight"] == "bfloat16"
    assert {e.name: e.dtype for e in sub.manifest.tensors}["step"] == "int64"
    with pytest.raises(WeightSyncError, match=r"key 'embed.weight' is float64\[7, 5\], the store takes float32"):
        pub.publish(state_dict(2) | {"embed.weight": state_dict(2)["embed.weight"].double()}, 1)  # as the first came
    sub.close()
    pub.close()


# ------------------------------------------------------------------- transports, followers


@pytest.mark.parametrize(
    ("same_host", "on_gpu", "transport"),
    [(True, False, "shm"), (True, True, "cuda_ipc"), (False, False, "rdma"), (False, True, "rdma")],
)
def test_choose_transport_by_placement(same_host: bool, on_gpu: bool, transport: str) -> None:
    assert choose_transport(same_host, on_gpu) == transport and transport in TRANSPORTS


def test_unknown_transport_is_refused(store: Path) -> None:
    unknown = "weight transport 'nccl' is unknown; use one of shm, rdma, cuda_ipc"
    with pytest.raises(ValueError, match=unknown):
        WeightPublisher(store, state_dict(), slots=2, transport="nccl")
    with pytest.raises(ValueError, match=unknown):  # a record naming it: the follower refuses it the same way
        WeightFollower().hold(WeightVersion(0, 0, 64, str(store), "nccl"), {}.update)
    with pytest.raises(ValueError, match=unknown):
        slot_backend("nccl")
    assert not store.exists()  # refused before anything was created


@pytest.mark.parametrize("name", TRANSPORTS)
def test_every_registered_transport_implements_the_whole_slot_backend_interface(name: str) -> None:
    """Structural, so it runs here for every transport: building a backend needs neither a GPU nor Monarch."""
    backend = slot_backend(name)
    assert isinstance(backend, SlotBackend) and backend.name == name
    assert not inspect.isabstract(type(backend)), f"{name} leaves {sorted(type(backend).__abstractmethods__)} out"
    assert all(callable(getattr(backend, method)) for method in ("create", "handle", "close", "attach"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_ipc_without_a_gpu_says_how_to_fix_it(store: Path) -> None:
    with pytest.raises(WeightSyncError, match="needs a CUDA GPU.*meshes.\\*.gpus"):
        WeightPublisher(store, state_dict(), slots=2, transport="cuda_ipc")


def test_device_checksum_sees_every_changed_or_moved_word() -> None:
    data = torch.randint(0, 256, (3 * DEVICE_CHUNK_WORDS * 4 // 2,), dtype=torch.uint8)  # 1.5 chunks of words
    base = device_checksum(data)
    assert device_checksum(data.clone()) == base
    for index in (0, data.numel() // 2, data.numel() - 1):
        flipped = data.clone()
        flipped[index] ^= 0x80
        assert device_checksum(flipped) != base, index
    words = data.clone().view(torch.int32)
    words[[0, 1]] = words[[1, 0]]  # two words swap places: the same sum, another weighted sum
    assert device_checksum(words.view(torch.uint8)) != base


def test_follower_over_shm_keeps_what_it_holds_when_a_version_is_refused(pair) -> None:
    pub, _ = pair
    follower, model = WeightFollower(), {}
    v0 = pub.publish(state_dict(0), 0)
    assert follower.hold(v0, model.update) > 0 and follower.hold(v0, model.update) == 0.0
    follower.check_intact(v0)
    with pytest.raises(StaleWeightsError, match="holds no version"):
        follower.hold(dataclasses.replace(v0, version=1), model.update)
    assert follower.held == v0
    assert_same(model, state_dict(0))
    follower.close()


def test_records_compare_without_their_handles() -> None:
    record = WeightVersion(3, 7, 64, "/store", "rdma", RemoteSlot("slot", "manifest"))
    assert record == dataclasses.replace(record, remote=RemoteSlot("other", "handles"))
    assert len({record, dataclasses.replace(record, remote=None)}) == 1
    assert record != dataclasses.replace(record, transport="shm")


class Publishing(Actor):
    """The trainer's side of a cross-process test: a publisher of ``state_dict(seed)`` versions."""

    def __init__(self, store: str, transport: str, device: str = "cpu"):
        self.device = device
        self.publisher = WeightPublisher(store, state_dict(0, device), slots=2, transport=transport)

    @endpoint
    def publish(self, seed: int, version: int) -> WeightVersion:
        return self.publisher.publish(state_dict(seed, self.device), version)

    @endpoint
    def fail_publish(self, version: int) -> None:
        """A publish that dies half-way (a tensor without bytes): its slot stays WRITING."""
        try:
            self.publisher.publish({**state_dict(0), "step": torch.zeros(2, dtype=torch.int64, device="meta")}, version)
        except (NotImplementedError, RuntimeError):
            return
        raise AssertionError("publishing a meta tensor should fail")

    @endpoint
    def close(self) -> None:
        self.publisher.close()

    @endpoint
    def tamper_manifest(self) -> None:
        """Swap a tensor's dimensions in the registered manifest bytes: well-formed, same length, a lie."""
        buffer = self.publisher._backend._manifest_buffer
        raw = bytes(buffer.numpy())
        assert raw.count(b'"shape": [7, 5]') == 1
        buffer.copy_(
            torch.frombuffer(bytearray(raw.replace(b'"shape": [7, 5]', b'"shape": [5, 7]')), dtype=torch.uint8)
        )

    @endpoint
    def flip_byte(self, version: int) -> None:
        """Change one data byte of the version's slot behind the header's back."""
        data = self.publisher._slots[version % self.publisher.slots].data
        data[0] = data[0] ^ 1


class Following(Actor):
    """The generator's side: a follower whose 'model' is the dict of adopted tensors."""

    def __init__(self):
        self.follower = WeightFollower()
        self.model: dict[str, torch.Tensor] = {}

    @endpoint
    def hold(self, weights: WeightVersion) -> dict[str, torch.Tensor]:
        self.follower.hold(weights, self.model.update)
        self.follower.check_intact(weights)
        return {name: tensor.cpu().clone() for name, tensor in self.model.items()}

    @endpoint
    def serving(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The version held, checked intact, and a copy of the weights the model uses."""
        self.follower.check_intact(self.follower.held)
        return self.follower.held.version, {name: tensor.cpu().clone() for name, tensor in self.model.items()}


@pytest.fixture(scope="module")
def two_procs():
    procs = this_host().spawn_procs(per_host={"procs": 2})
    yield procs
    procs.stop().get()


def spawn_pair(procs, store: Path, transport: str, device: str = "cpu"):
    name = uuid.uuid4().hex[:8]
    publishing = procs.slice(procs=0).spawn(f"pub{name}", Publishing, str(store), transport, device)
    return publishing, procs.slice(procs=1).spawn(f"fol{name}", Following)


def test_rdma_round_trip_between_two_procs(two_procs, store: Path) -> None:
    publishing, following = spawn_pair(two_procs, store, "rdma")
    v0 = publishing.publish.call_one(0, 0).get()
    assert v0.transport == "rdma" and v0.remote is not None
    assert len(pickle.dumps(v0)) < 2048  # handles, not bytes, travel with the record
    assert not store.exists()  # rdma slots are the publisher's own memory, not files
    assert_same(following.hold.call_one(v0).get(), state_dict(0))
    v1 = publishing.publish.call_one(1, 1).get()
    assert_same(following.hold.call_one(v1).get(), state_dict(1))
    v2 = publishing.publish.call_one(2, 2).get()  # over v0's slot: the follower's copy is its own
    assert following.serving.call_one().get()[0] == 1
    assert_same(following.hold.call_one(v2).get(), state_dict(2))
    publishing.close.call_one().get()  # withdraws the registrations: a late pull fails, the follower keeps v2
    with pytest.raises(Exception, match="(?s)WeightSyncError.*over RDMA failed.*keeps serving version 2"):
        following.hold.call_one(v1).get()
    assert following.serving.call_one().get()[0] == 2


def test_rdma_follower_keeps_serving_the_old_version_when_a_pull_is_stale_torn_or_corrupt(
    two_procs, store: Path
) -> None:
    publishing, following = spawn_pair(two_procs, store, "rdma")
    v1 = publishing.publish.call_one(1, 1).get()
    following.hold.call_one(v1).get()

    def refused(record: WeightVersion, error: str, match: str) -> None:
        with pytest.raises(Exception, match=f"(?s){error}.*{match}"):
            following.hold.call_one(record).get()
        version, served = following.serving.call_one().get()
        assert version == 1
        assert_same(served, state_dict(1))

    v2 = publishing.publish.call_one(2, 2).get()
    v4 = publishing.publish.call_one(4, 4).get()  # laps v2 in slot 0 before the follower pulls it
    refused(v2, "StaleWeightsError", r"holds version 4 \(READY\), not version 2")
    publishing.flip_byte.call_one(4).get()  # a rewrite or damage the header does not show
    refused(v4, "TornWeightsError", "hashes to .* rewrote the slot during the pull .* keeps serving version 1")
    v5 = publishing.publish.call_one(5, 5).get()  # over the slot of the version being served: no harm
    refused(dataclasses.replace(v5, checksum=v5.checksum ^ 1), "TornWeightsError", "expected")
    publishing.fail_publish.call_one(7).get()
    refused(v5, "StaleWeightsError", r"holds version 7 \(WRITING\)")


def test_rdma_follower_refuses_a_pulled_manifest_that_is_not_the_published_one(two_procs, store: Path) -> None:
    publishing, following = spawn_pair(two_procs, store, "rdma")
    v0 = publishing.publish.call_one(0, 0).get()
    assert_same(following.hold.call_one(v0).get(), state_dict(0))  # attached to the true manifest
    publishing.tamper_manifest.call_one().get()
    late = two_procs.slice(procs=1).spawn(f"late{uuid.uuid4().hex[:8]}", Following)  # attaches to the lie
    v1 = publishing.publish.call_one(1, 1).get()
    with pytest.raises(Exception, match="(?s)TornWeightsError.*not the layout version 1 was published with"):
        late.hold.call_one(v1).get()
    assert_same(following.hold.call_one(v1).get(), state_dict(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_round_trip_between_two_procs(two_procs, tmp_path: Path) -> None:
    store = tmp_path / "weights"
    publishing, following = spawn_pair(two_procs, store, "cuda_ipc", "cuda")
    v0 = publishing.publish.call_one(0, 0).get()
    assert v0.transport == "cuda_ipc" and (store / in_place.CUDA_HANDLES).exists()
    assert_same(following.hold.call_one(v0).get(), state_dict(0))
    v1 = publishing.publish.call_one(1, 1).get()
    assert_same(following.hold.call_one(v1).get(), state_dict(1))
    publishing.publish.call_one(3, 3).get()  # rewrites v1's slot while it is served
    with pytest.raises(Exception, match="(?s)TornWeightsError.*overwritten while in use"):
        following.serving.call_one().get()
    v4 = publishing.publish.call_one(4, 4).get()
    publishing.flip_byte.call_one(4).get()  # damage the header does not show: the GPU checksum must
    with pytest.raises(Exception, match="(?s)TornWeightsError.*corrupt"):
        following.hold.call_one(v4).get()


@pytest.mark.parametrize(
    "transport",
    [
        "shm",
        "rdma",  # Monarch's TCP fallback where there is no ibverbs, as here
        pytest.param(
            "cuda_ipc",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc keeps the slots on a CUDA GPU"),
            ],
        ),
    ],
)
def test_every_transport_round_trips_through_the_same_publisher_and_follower(
    two_procs, tmp_path: Path, transport: str
) -> None:
    device = "cuda" if transport == "cuda_ipc" else "cpu"
    publishing, following = spawn_pair(two_procs, tmp_path / "weights", transport, device)
    for seed, version in ((0, 0), (1, 1), (2, 2)):  # version 2 reuses version 0's slot
        record = publishing.publish.call_one(seed, version).get()
        assert record.transport == transport and (record.remote is not None) == (transport == "rdma")
        assert_same(following.hold.call_one(record).get(), state_dict(seed))
    publishing.close.call_one().get()


ONE_MESH = ["launcher.kind=process", "actors.generator.mesh=trainer", "actors.teachers.mesh=trainer"]


@pytest.mark.parametrize(
    ("overrides", "transport"),
    [
        ([], "shm"),  # launcher local: every mesh on this host
        (["launcher.kind=process"], "rdma"),  # the generator's mesh is another host
        (ONE_MESH, "shm"),  # the weight followers on the trainer's own single-host mesh
        ([*ONE_MESH, "meshes.trainer.hosts=2"], "rdma"),
        ([*ONE_MESH, "actors.generator.copies=2"], "rdma"),  # a copy is a mesh of its own
    ],
)
def test_the_runtime_picks_the_transport_from_the_placement(overrides: list[str], transport: str) -> None:
    assert load_plan(REPO / "topologies" / "tiny.yaml", overrides).transport == transport
