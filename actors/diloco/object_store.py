"""The ``object_store`` transport: replicas that share no network average through a store URL.

DiLoCo replicas in separate jobs or clusters may have no route to one another, only to a common
object store (``s3://bucket/prefix`` through s3fs, or ``file:///path`` on a shared filesystem).
Each replica writes its pseudo-gradient for a round into the store, reads the others' and takes
the mean. Everything goes through ``fsspec.core.url_to_fs(url, **storage_options)``.

Layout, one directory per round and trainer rank (each rank's syncer has its own transport)::

    <url>/round_<k:06d>/rank_<r>/replica_<i>.safetensors   the delta of replica i
    <url>/round_<k:06d>/rank_<r>/closed_<i>.json           replica i's close marker: the members

A delta object is the safetensors encoding of the tensors as given (names and dtypes kept); its
metadata holds the replica id, round, rank and an xxh3_64 checksum over the names, dtypes,
shapes and bytes of the tensors. A reader verifies all of it and the layout (same names, shapes
and dtypes as its own delta): a corrupt or mismatched object is skipped with a warning naming
it, never averaged. Objects appear whole: on a local filesystem through a temporary name in the
same directory and a rename; on an object store one PUT is already atomic.

A round closes for a replica when every replica's delta is in the store, when a close marker
already exists (the round was closed by someone else, waiting longer changes nothing),
``round_timeout`` seconds after the replica wrote its own delta, or at once when its run is
asked to stop (``stop_requested``: a signal ends the run at this step boundary, not a round
timeout later). Replicas that close a round on
their own clocks could see different sets of deltas and then apply different means, their
weights drifting apart with nothing reporting it. So membership is agreed through the markers:
a replica that finds no marker writes its own (listing the deltas it sees); every replica
then waits a settle time (a few poll intervals), lists the markers again and adopts the members
of the marker with the smallest replica id. All of those deltas are in the store, so every
replica computes exactly the same mean (float32 accumulation in member-id order, on the CPU),
even one whose own delta came too late: it gets the others' mean, excluding itself, as a
torchft heal would give it.

The remaining race: a replica lists the round, sees no marker, and its marker becomes visible
only after another replica has already re-listed at the end of its settle time. That needs the
gap between one replica's listing and its marker's PUT to exceed the settle time (a stalled
process, a very slow PUT); if that replica saw a different set of deltas and has the smaller id,
the two adopt different members and their weights diverge. Raise ``settle_s`` where stores or
processes stall for long.

Verification is the same on every replica (the same bytes give the same verdict), so a damaged
delta listed in a marker is skipped by all of them alike. One exception: a replica averages its
own delta from memory, not from the store; were its stored copy damaged after the write, the
others would skip it (and log the object) while it includes itself.

What is never averaged, whoever wrote it: a delta holding NaN or inf (a replica does not write
its own, and one read from the store fails the round with :class:`RefusedEntry` naming the
entry, the replica it claims to be from and the round: a damaged delta is skipped, but this one
was written whole by something that must stop). The checksum catches damage, not forgery:
anyone can recompute it. With a ``secret`` (``diloco.secret_env``) every delta and close marker
also carries an HMAC-SHA256 signature over its identity and content, and an entry without a
valid one fails the round the same way; without a secret, any writer of the store can add
deltas. A ``file://`` store must be a directory of this user that group and others cannot write.

A replica that missed rounds reapplies them from the store: ``latest_round`` (the newest round
with a close marker for this rank), ``members_of`` and ``mean_of`` (the mean recomputed from the
stored deltas of the members, identical to what they got). Rounds are never deleted on their
own; ``forget_before`` removes older rounds once no replica needs to reapply them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor

from actors.diloco.transport import RoundResult
from actors.weights.storedir import foreign_hands

log = logging.getLogger(__name__)

FORMAT = "diloco-delta/1"
ROUND_DIR = re.compile(r"round_(\d+)")
DELTA_FILE = re.compile(r"replica_(\d+)\.safetensors")
MARKER_FILE = re.compile(r"closed_(\d+)\.json")


class CorruptDelta(ValueError):
    """A stored delta that cannot be averaged: unreadable, checksum wrong, or not the one expected."""


class RefusedEntry(RuntimeError):
    """An entry of the store that must never be trained on (a delta with non-finite values, an entry without
    a valid signature): the round fails naming it, rather than going on without it as for a damaged delta,
    since someone or something is writing what it should not."""


class Unsigned(ValueError):
    """Why an entry's signature does not verify (``decode_delta`` and the markers raise it)."""


@dataclass(frozen=True)
class Listing:
    """The replica ids whose delta objects and close markers one listing of a round showed."""

    deltas: frozenset[int]
    markers: frozenset[int]


@dataclass
class _Reads:
    """What one round's reads gave: verified deltas (read once), rejected ids, bytes read."""

    received: int = 0
    deltas: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)


# --- encoding ---------------------------------------------------------------------------------


def _digest(digest: Any, tensors: Mapping[str, Tensor]) -> Any:
    """``digest`` fed each tensor's name, dtype, shape and bytes, in name order: a flipped byte
    anywhere in the data, or a tensor stored under another name or shape, changes it."""
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest


def checksum(tensors: Mapping[str, Tensor]) -> str:
    """xxh3_64 of the tensors (``_digest``): catches damage, not forgery, since anyone can recompute it."""
    return _digest(xxhash.xxh3_64(), tensors).hexdigest()


def signature(secret: bytes, ids: Mapping[str, str], tensors: Mapping[str, Tensor] | None = None) -> str:
    """HMAC-SHA256 with ``secret`` over an entry's identity (format, replica, round, rank, ...) and its
    tensors: only a holder of the secret can write an entry that verifies, and only for that identity."""
    mac = hmac.new(secret, json.dumps(dict(ids), sort_keys=True).encode(), hashlib.sha256)
    return (_digest(mac, tensors) if tensors is not None else mac).hexdigest()


def encode_delta(
    delta: Mapping[str, Tensor], *, replica: int, round: int, rank: int, secret: bytes | None = None
) -> bytes:
    """The safetensors bytes of ``delta`` (CPU, contiguous), with who/when and the checksum in
    the metadata so that a reader can tell a misplaced or damaged object from a good one; with a
    ``secret``, also its signature, so that it can tell one written without the secret."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in delta.items()}
    metadata = {"format": FORMAT, "replica": str(replica), "round": str(round), "rank": str(rank)}
    if secret is not None:
        metadata["signature"] = signature(secret, metadata, tensors)
    metadata["checksum"] = checksum(tensors)
    return safetensors_save(tensors, metadata)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (``safetensors.torch.load`` does not return it)."""
    if len(data) < 8:
        raise CorruptDelta(f"{len(data)} bytes, shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise CorruptDelta(f"header length {header_len} exceeds the object's {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError as exc:
        raise CorruptDelta(f"unreadable safetensors header ({exc})") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise CorruptDelta("no metadata in the safetensors header")
    return metadata


def decode_delta(
    data: bytes, *, replica: int, round: int, rank: int, secret: bytes | None = None
) -> dict[str, Tensor]:
    """The tensors of a stored delta, after checking that it is whole (checksum) and that it is
    the delta of ``replica`` for ``round`` and ``rank``; raises :class:`CorruptDelta` naming why.
    With a ``secret``, an entry whose signature is missing or wrong raises :class:`Unsigned`."""
    metadata = _metadata(data)
    expected = {"format": FORMAT, "replica": str(replica), "round": str(round), "rank": str(rank)}
    if secret is not None and "signature" not in metadata:
        raise Unsigned("it carries no signature: it was written without diloco.secret_env's secret")
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise CorruptDelta(f"metadata {key}={metadata.get(key)!r}, expected {value!r}")
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error type for damaged bytes
        raise CorruptDelta(f"unreadable safetensors data ({exc})") from exc
    if secret is not None and not hmac.compare_digest(signature(secret, expected, tensors), metadata["signature"]):
        raise Unsigned("its signature is wrong: it was written with another secret, or changed since it was signed")
    if checksum(tensors) != metadata.get("checksum"):
        raise CorruptDelta("checksum mismatch: the stored bytes are damaged")
    return tensors


def non_finite(tensors: Mapping[str, Tensor]) -> str | None:
    """Where ``tensors`` hold a NaN or an infinity (the first tensor by name and how many), or None."""
    for name in sorted(tensors):
        bad = int((~torch.isfinite(tensors[name])).sum())
        if bad:
            return f"{bad} non-finite value(s) (NaN or inf) in {name!r} of {tensors[name].numel()}"
    return None


def layout_mismatch(tensors: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> str | None:
    """Why ``tensors`` cannot be averaged with ``reference`` (names, shapes, dtypes), or None."""
    if set(tensors) != set(reference):
        missing, extra = sorted(set(reference) - set(tensors)), sorted(set(tensors) - set(reference))
        return f"different tensor names (missing {missing}, extra {extra})"
    for name, ref in reference.items():
        got = tensors[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"{name!r} is {got.dtype} {tuple(got.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
    return None


def mean_of_deltas(deltas: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The mean on the CPU, accumulated in float32 (float64 stays float64) in the given order and
    returned in the first delta's dtypes: the same inputs in the same order give the same bits
    on every replica."""
    out: dict[str, Tensor] = {}
    for name, ref in deltas[0].items():
        acc = torch.zeros(ref.shape, dtype=torch.promote_types(ref.dtype, torch.float32))
        for delta in deltas:
            acc += delta[name].detach().cpu().to(acc.dtype)
        out[name] = (acc / len(deltas)).to(ref.dtype)
    return out


# --- the transport ----------------------------------------------------------------------------


class ObjectStoreTransport:
    """DiLoCo averaging through an fsspec store: one instance per replica and trainer rank.

    ``poll_s`` is how often a waiting replica lists the round (one LIST request each time);
    ``settle_s`` (default three polls) how long a closing replica waits for other markers.
    The fsspec filesystem is fsspec's cached instance for these arguments, shared with anyone
    else using it in the process, so :meth:`close` does not close it.
    """

    def __init__(
        self,
        url: str,
        replicas: int,
        replica: int,
        rank: int = 0,
        round_timeout: float = 60.0,
        poll_s: float = 0.1,
        storage_options: dict[str, Any] | None = None,
        settle_s: float | None = None,
        secret: bytes | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        _check_ids(replicas, replica, rank)
        if round_timeout <= 0 or poll_s <= 0:
            raise ValueError(
                f"round_timeout={round_timeout} and poll_s={poll_s} must both be positive seconds; "
                "pass e.g. round_timeout=60.0, poll_s=0.1"
            )
        self.url = url.rstrip("/")
        self.replicas, self.replica, self.rank = replicas, replica, rank
        self.round_timeout, self.poll_s = round_timeout, poll_s
        self.settle_s = 3 * poll_s if settle_s is None else settle_s
        self.secret, self.stop_requested = secret, stop_requested
        self._closed = False
        if replicas == 1:  # a world of one never touches the store: nothing to average with
            self.fs, self.root = None, ""
            return
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self._atomic_by_rename = isinstance(self.fs, LocalFileSystem)
        self._check_store()

    # -- the protocol --

    def average(self, round: int, delta: dict[str, Tensor]) -> RoundResult:
        """Write this replica's delta, wait for the others (or the timeout), agree on the members
        through the close markers and return their mean (see the module docstring)."""
        start = time.monotonic()
        self._check_round(round)
        if self.replicas == 1:
            return RoundResult(dict(delta), (self.replica,), 0, 0, time.monotonic() - start)
        own = {name: t.detach().cpu() for name, t in delta.items()}
        if (where := non_finite(own)) is not None:
            raise RefusedEntry(
                f"DiLoCo round {round} (rank {self.rank}): this replica's own pseudo-gradient (replica {self.replica}) "
                f"has {where}, so it is not written to {self.url}: its training diverged since the last sync (see "
                "train/loss in metrics.jsonl). Resume from an earlier checkpoint, with a lower learning rate"
            )
        encoded = encode_delta(own, **self._ids(round), secret=self.secret)
        sent = self._put(self._delta_path(round, self.replica), encoded)
        listing = self._wait(round, deadline=time.monotonic() + self.round_timeout)
        reads = _Reads(deltas={self.replica: own})
        if not listing.markers:  # at once: the longer from listing to marker, the wider the race
            sent += self._put(self._marker_path(round, self.replica), self._marker(round, listing.deltas))
        time.sleep(self.settle_s)
        members = self._agreed_members(round, reads)
        if members is None:  # our own marker was written; only a store that lost it gets here
            raise RuntimeError(
                f"round {round} (rank {self.rank}) has no readable close marker in {self.url} after this "
                "replica wrote one; the store lost or damaged it. Check the store's health and retry the run."
            )
        averaged = tuple(i for i in members if self._load(round, i, own, reads) is not None)
        if not averaged:
            raise RuntimeError(
                f"round {round} (rank {self.rank}): none of the agreed members {list(members)} has a readable "
                f"delta in {self.url}; the store damaged them. Check the store and restart the round."
            )
        self._report(round, averaged)
        mean = mean_of_deltas([reads.deltas[i] for i in averaged])
        mean = {name: mean[name].to(device=t.device) for name, t in delta.items()}
        return RoundResult(mean, averaged, sent, reads.received, time.monotonic() - start)

    def close(self) -> None:
        """Nothing is held between rounds (no server, no open objects); later calls are refused."""
        self._closed = True

    # -- reapplying closed rounds --

    def latest_round(self) -> int | None:
        """The newest round with a close marker for this rank, or None when none was closed."""
        for round in sorted(self._rounds(), reverse=True):
            if self._list(round).markers:
                return round
        return None

    def members_of(self, round: int) -> tuple[int, ...] | None:
        """The members the replicas agreed on for ``round`` (the smallest-id readable marker's),
        or None when the round has no close marker for this rank."""
        return self._agreed_members(round, _Reads())

    def mean_of(self, round: int) -> dict[str, Tensor]:
        """The mean of a closed round recomputed from its members' stored deltas (on the CPU, in
        the stored dtypes): what the members got, for a replica that missed the round."""
        members = self.members_of(round)
        if members is None:
            raise ValueError(
                f"round {round} has no close marker for rank {self.rank} in {self.url}: it was not closed "
                "yet, or was removed by forget_before. Replay only rounds up to latest_round()."
            )
        reads = _Reads()
        reference = None
        for i in members:  # the first readable member's layout is the one the others must have
            tensors = self._load(round, i, reference, reads)
            reference = tensors if reference is None else reference
        averaged = [i for i in members if i in reads.deltas]
        if not averaged:
            raise ValueError(
                f"round {round} (rank {self.rank}): none of its members {list(members)} has a readable delta "
                f"in {self.url}; the round cannot be reapplied. Restart from a checkpoint instead."
            )
        return mean_of_deltas([reads.deltas[i] for i in averaged])

    def forget_before(self, round: int) -> tuple[int, ...]:
        """Delete this rank's objects of the rounds before ``round`` and return those rounds.
        Other ranks' transports forget their own; call it only for rounds no replica will reapply."""
        if self.fs is None:
            return ()
        gone = []
        for old in sorted(r for r in self._rounds() if r < round):
            rank_dir = self._rank_dir(old)
            try:
                self.fs.rm(rank_dir, recursive=True)
            except FileNotFoundError:
                continue
            gone.append(old)
            if self._atomic_by_rename:  # a local directory stays behind; remove it once empty
                try:
                    self.fs.rmdir(rank_dir.rsplit("/", 1)[0])
                except OSError:
                    pass  # other ranks' objects are still in it
        return tuple(gone)

    # -- the store --

    def _check_store(self) -> None:
        """Fail at construction, not after the first H inner steps, when the store is unusable."""
        assert self.fs is not None
        bucket = self.root.split("/", 1)[0]
        try:
            if self._atomic_by_rename:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
            else:
                self.fs.info(bucket)
        except Exception as exc:
            if isinstance(exc, FileNotFoundError) and not self._atomic_by_rename:
                raise ValueError(
                    f"the DiLoCo object store {self.url} does not exist: its bucket {bucket!r} was not found "
                    f"({exc}). Create the bucket first (the transport never creates buckets), or fix the URL."
                ) from exc
            raise OSError(
                f"the DiLoCo object store {self.url} could not be reached or written ({type(exc).__name__}: "
                f"{exc}). Check the URL, the endpoint_url, credentials and permissions in storage_options, and "
                "that this host can reach the store."
            ) from exc
        if self._atomic_by_rename:
            self._check_local_owner()

    def _check_local_owner(self) -> None:
        """A directory another user can write to lets that user put deltas into every replica's mean: refuse
        it, as the weight store refuses a store that is not this user's (``actors/weights/storedir.py``)."""
        hands = foreign_hands(os.stat(self.root))
        if hands is not None:
            raise ValueError(
                f"the DiLoCo object store {self.url} is a directory {hands}, so someone besides this user could "
                "write deltas that every replica averages in. Use a directory of your own that only you can write "
                f"(chmod go-w {self.root}, or a fresh diloco.store path; the run creates a missing one with mode 0700)"
            )

    def _put(self, path: str, data: bytes) -> int:
        """Write ``data`` so that readers see all of it or nothing; returns the bytes written."""
        assert self.fs is not None
        try:
            if self._atomic_by_rename:
                folder, name = path.rsplit("/", 1)
                self.fs.makedirs(folder, exist_ok=True)
                temporary = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"  # no pattern matches it
                self.fs.pipe_file(temporary, data)
                self.fs.mv(temporary, path)
            else:
                self.fs.pipe_file(path, data)  # one PUT: the object appears whole
        except Exception as exc:
            raise OSError(
                f"writing {self.fs.unstrip_protocol(path)} failed ({type(exc).__name__}: {exc}); check that the "
                "store is reachable and writable with these storage_options."
            ) from exc
        return len(data)

    def _names(self, folder: str) -> list[str]:
        """The base names in ``folder`` from a fresh listing (s3fs caches listings otherwise)."""
        assert self.fs is not None
        try:
            paths = self.fs.ls(folder, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]

    def _list(self, round: int) -> Listing:
        names = self._names(self._rank_dir(round))
        return Listing(_ids(DELTA_FILE, names), _ids(MARKER_FILE, names))

    def _rounds(self) -> list[int]:
        return [int(m.group(1)) for n in self._names(self.root) if (m := ROUND_DIR.fullmatch(n))]

    def _wait(self, round: int, deadline: float) -> Listing:
        """Poll until every delta is in, a marker says the round closed, the deadline passed or a stop was asked."""
        everyone = frozenset(range(self.replicas))
        while True:
            listing = self._list(round)
            closed = everyone <= listing.deltas or listing.markers or time.monotonic() >= deadline
            if closed or self.stop_requested():
                return listing
            time.sleep(self.poll_s)

    def _load(
        self, round: int, replica: int, reference: Mapping[str, Tensor] | None, reads: _Reads
    ) -> dict[str, Tensor] | None:
        """Replica ``replica``'s verified delta (read once per round), or None with a warning."""
        if replica in reads.deltas:
            return reads.deltas[replica]
        if replica in reads.rejected:
            return None
        assert self.fs is not None
        path = self._delta_path(round, replica)
        try:
            data = self.fs.cat_file(path)
            reads.received += len(data)
            tensors = decode_delta(data, **self._ids(round, replica), secret=self.secret)
            reason = layout_mismatch(tensors, reference) if reference is not None else None
            if reason is not None:
                raise CorruptDelta(f"layout differs from this replica's delta: {reason}")
        except Unsigned as exc:
            raise self._refused(path, round, replica, f"{exc}") from None
        except (CorruptDelta, FileNotFoundError) as exc:
            log.warning(
                "DiLoCo object store: skipping %s (round %d, rank %d, replica %d), not averaged: %s",
                self.fs.unstrip_protocol(path),
                round,
                self.rank,
                replica,
                exc if isinstance(exc, CorruptDelta) else "the object is gone",
            )
            reads.rejected.add(replica)
            return None
        if (where := non_finite(tensors)) is not None:
            raise self._refused(path, round, replica, f"it has {where}")
        reads.deltas[replica] = tensors
        return tensors

    def _refused(self, path: str, round: int, replica: int, why: str) -> RefusedEntry:
        """The error that fails a round on an entry nobody may train on, naming it and its claimed writer."""
        signed = (
            "Every replica must run with the same diloco.secret_env secret; if they do, someone else wrote it"
            if self.secret is not None
            else "Only the replicas of this run should write the store: find what else writes there, and set "
            "diloco.secret_env so that entries written without a shared secret are refused"
        )
        return RefusedEntry(
            f"DiLoCo round {round} (rank {self.rank}): refused {self.fs.unstrip_protocol(path)}, which claims to be "
            f"written by replica {replica}: {why}. It is not averaged and the round fails rather than train on it. "
            f"{signed}; then resume each replica from its last checkpoint"
        )

    # -- markers --

    def _marker(self, round: int, members: Iterable[int]) -> bytes:
        record = {"round": round, "rank": self.rank, "replica": self.replica, "members": sorted(members)}
        if self.secret is not None:
            record["signature"] = signature(self.secret, _marker_ids(record))
        return json.dumps(record, sort_keys=True).encode()

    def _agreed_members(self, round: int, reads: _Reads) -> tuple[int, ...] | None:
        """The members of the smallest-id readable marker of ``round``, or None when it has none."""
        assert self.fs is not None
        for writer in sorted(self._list(round).markers):
            path = self._marker_path(round, writer)
            try:
                data = self.fs.cat_file(path)
            except FileNotFoundError:
                continue
            reads.received += len(data)
            members = self._parse_marker(data, round, writer)
            if self.secret is not None and (why := self._unsigned_marker(data)) is not None:
                raise self._refused(path, round, writer, why)
            if members is not None:
                return members
            log.warning("DiLoCo object store: ignoring the damaged close marker %s", self.fs.unstrip_protocol(path))
        return None

    def _parse_marker(self, data: bytes, round: int, writer: int) -> tuple[int, ...] | None:
        try:
            record = json.loads(data)
            members = tuple(sorted(int(i) for i in record["members"]))
            ok = (record["round"], record["rank"], record["replica"]) == (round, self.rank, writer)
        except (ValueError, KeyError, TypeError):
            return None
        if not ok or not members or not all(0 <= i < self.replicas for i in members):
            return None
        return members

    def _unsigned_marker(self, data: bytes) -> str | None:
        """Why a close marker's signature does not verify with this transport's secret, or None."""
        try:
            record = json.loads(data)
            claimed = record.pop("signature", None)
        except (ValueError, AttributeError):
            return "it is not a JSON object, so it carries no signature"
        if not isinstance(claimed, str):
            return "it carries no signature: it was written without diloco.secret_env's secret"
        if not hmac.compare_digest(signature(self.secret, _marker_ids(record)), claimed):
            return "its signature is wrong: it was written with another secret, or changed since it was signed"
        return None

    def _report(self, round: int, averaged: tuple[int, ...]) -> None:
        """One warning line when the mean is not over every replica: which ids, and why if known."""
        left_out = sorted(set(range(self.replicas)) - set(averaged))
        if not left_out:
            return
        if self.replica in left_out:
            log.warning(
                "DiLoCo object store: round %d (rank %d) closed before replica %d's delta arrived; it takes the "
                "mean of replicas %s, excluding its own",
                round,
                self.rank,
                self.replica,
                list(averaged),
            )
        else:
            log.warning(
                "DiLoCo object store: round %d (rank %d) closed without replicas %s (missing at closing time, "
                "late or rejected); averaged over replicas %s",
                round,
                self.rank,
                left_out,
                list(averaged),
            )

    # -- names --

    def _ids(self, round: int, replica: int | None = None) -> dict[str, int]:
        return {"replica": self.replica if replica is None else replica, "round": round, "rank": self.rank}

    def _rank_dir(self, round: int) -> str:
        return f"{self.root}/round_{round:06d}/rank_{self.rank}"

    def _delta_path(self, round: int, replica: int) -> str:
        return f"{self._rank_dir(round)}/replica_{replica}.safetensors"

    def _marker_path(self, round: int, replica: int) -> str:
        return f"{self._rank_dir(round)}/closed_{replica}.json"

    def _check_round(self, round: int) -> None:
        if self._closed:
            raise RuntimeError(f"this object-store transport (replica {self.replica}) was closed; make a new one")
        if round < 1:
            raise ValueError(f"round={round} is not a DiLoCo round: rounds count from 1; pass round >= 1")


def _marker_ids(record: Mapping[str, Any]) -> dict[str, str]:
    """What a close marker's signature covers: everything in it but the signature."""
    return {"format": "diloco-marker/1", **{key: json.dumps(value) for key, value in record.items()}}


def _ids(pattern: re.Pattern[str], names: Sequence[str]) -> frozenset[int]:
    return frozenset(int(m.group(1)) for n in names if (m := pattern.fullmatch(n)))


def _check_ids(replicas: int, replica: int, rank: int) -> None:
    """One sentence naming the bad values and the fix: a wrong id would silently join the wrong slot."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas} is not a number of DiLoCo replicas; pass replicas >= 1")
    if not 0 <= replica < replicas:
        raise ValueError(
            f"replica={replica} is outside 0..{replicas - 1} for replicas={replicas}; "
            "give each replica a distinct id in that range"
        )
    if rank < 0:
        raise ValueError(f"rank={rank} is not a trainer rank; pass the syncer's trainer rank (>= 0)")
