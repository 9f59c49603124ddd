"""The ``diloco`` section of a topology: replicas, how often they sync, and over what (no torch).

A DiLoCo run is ``replicas`` whole pipelines, each its own run (``<name>-r<i>``) with its
own meshes, prompt stream and weight store, that average their pseudo-gradients every
``sync_every`` inner steps and apply the outer optimizer (``actors/diloco/syncer.py``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from actors.basics.urls import check_url

Transport = Literal["torchft", "object_store"]
STORE_SCHEMES = {"file": None, "s3": "s3fs"}  # fsspec protocols the object store is tested on -> the module they need
# The largest values the keys take: past them a value is a typo, not a setting (a day of waiting for a replica,
# more replicas than one store's listing of a round is meant to hold, a step beyond any outer learning rate in use)
MAX_ROUND_TIMEOUT_S = 86_400.0
MAX_REPLICAS = 1024
MAX_OUTER_LR = 10.0


@dataclass(frozen=True)
class OuterOptimizerConfig:
    """The outer optimizer: SGD on the pseudo-gradient, Nesterov momentum by default (the DiLoCo paper's)."""

    lr: float = 0.7  # the outer step's learning rate
    momentum: float = 0.9  # the outer step's momentum, in [0, 1)
    nesterov: bool = True  # Nesterov momentum (needs momentum > 0)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and 0 < self.lr <= MAX_OUTER_LR):
            raise ValueError(
                f"outer_optimizer.lr must be a number > 0 and at most {MAX_OUTER_LR:g}, got {self.lr}; "
                "the DiLoCo paper uses 0.7"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer_optimizer.momentum must be in [0, 1), got {self.momentum}; the paper uses 0.9")
        if self.nesterov and self.momentum == 0:
            raise ValueError(
                "outer_optimizer.nesterov needs momentum > 0 (Nesterov is a kind of momentum); "
                "set momentum (e.g. 0.9) or nesterov: false"
            )


@dataclass(frozen=True)
class DiLoCoConfig:
    replicas: int  # whole pipelines, each its own run, that meet every sync_every steps
    sync_every: int  # inner steps between two syncs (H), each averaging the replicas' pseudo-gradients
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    transport: Transport = "torchft"  # torchft: a lighthouse and a quorum per round; object_store: fsspec files
    # object_store: where rounds go (s3://bucket/prefix or file:///path); default: <the run's directory>/diloco
    store: str | None = None
    # torchft: a running lighthouse's http://host:port; default: the run starts one
    lighthouse: str | None = None
    # seconds a round waits for missing replicas: object_store closes it without them; torchft (where a dead
    # replica leaves at once, on its heartbeat) waits this long for live stragglers once a majority is in
    round_timeout: float = 60.0
    replica: int | None = None  # which replica this run is (--replica i); None: the run starts them all
    fragments: int = 1  # streaming DiLoCo: > 1 syncs one fragment of the model every sync_every / fragments steps
    # object_store: the NAME of an environment variable holding a secret every replica shares; each delta and
    # close marker is then signed with it (HMAC-SHA256) and entries without a valid signature are refused
    secret_env: str | None = None

    @property
    def interval(self) -> int:
        """Inner steps between two rounds (one fragment each, with streaming)."""
        return self.sync_every // self.fragments

    def __post_init__(self) -> None:
        if not (1 <= self.replicas <= MAX_REPLICAS and self.sync_every >= 1):
            raise ValueError(
                f"replicas must be in 1..{MAX_REPLICAS} and sync_every >= 1, got {self.replicas} and "
                f"{self.sync_every}; e.g. replicas: 2, sync_every: 16"
            )
        if self.fragments < 1 or self.sync_every % self.fragments:
            raise ValueError(
                f"fragments ({self.fragments}) must be >= 1 and divide sync_every ({self.sync_every}): each fragment "
                "syncs every sync_every steps, one of them every sync_every / fragments steps"
            )
        if self.fragments > 1 and self.transport == "torchft":
            raise ValueError(
                "fragments > 1 (streaming DiLoCo) runs over transport: object_store only: a torchft heal can move a "
                "replica to a round of another fragment in the middle of its exchange; use object_store or fragments: 1"
            )
        if self.replica is not None and not 0 <= self.replica < self.replicas:
            raise ValueError(
                f"replica {self.replica} is outside this run's replicas 0..{self.replicas - 1} "
                f"(diloco.replicas is {self.replicas}); give --replica a number in that range"
            )
        if not (math.isfinite(self.round_timeout) and 0 < self.round_timeout <= MAX_ROUND_TIMEOUT_S):
            raise ValueError(
                f"round_timeout must be a number of seconds > 0 and at most {MAX_ROUND_TIMEOUT_S:g} (a day), "
                f"got {self.round_timeout}; e.g. 60"
            )
        if self.store is not None:
            _check_store(self.store)
        if self.transport == "torchft" and self.store is not None:
            raise ValueError("diloco.store is where the object_store transport keeps rounds; with torchft, drop it")
        if self.transport == "object_store" and self.lighthouse is not None:
            raise ValueError("diloco.lighthouse is torchft's; with the object_store transport, drop it")
        if self.lighthouse is not None:
            _check_lighthouse(self.lighthouse)
        if self.secret_env is not None:
            _check_secret_env(self.secret_env, self.transport)

    def secret(self) -> bytes | None:
        """The shared secret the store's entries are signed with (``secret_env``'s value, read in the calling
        process: the trainer's, which may run on another host than the one that checked the topology), or None."""
        if self.secret_env is None:
            return None
        if not os.environ.get(self.secret_env):
            raise RuntimeError(
                f"diloco.secret_env names {self.secret_env!r}, which is unset or empty in the trainer's process on "
                f"{os.uname().nodename}; the trainer's hosts need it too: pass it to their environment (Slurm passes "
                "the submitting shell's on; on Kubernetes set it in the pods' env)"
            )
        return os.environ[self.secret_env].encode()


def _check_store(url: str) -> None:
    scheme = urlparse(url).scheme
    if scheme not in STORE_SCHEMES:
        raise ValueError(
            f"diloco.store {url!r} is not a URL this system runs on; give s3://bucket/prefix or file:///absolute/path"
        )
    module = STORE_SCHEMES[scheme]
    if module is not None and importlib.util.find_spec(module) is None:
        raise ValueError(
            f"diloco.store {url!r} needs {module}, which is not installed: pip install 'composer-mesh[diloco]'"
        )


def _check_lighthouse(url: str) -> None:
    try:
        check_url(url, ("http",))
    except ValueError as error:
        raise ValueError(
            f"diloco.lighthouse {url!r} is not a lighthouse's URL ({error}); give the address torchft's lighthouse "
            "prints, e.g. http://lighthouse:29510"
        ) from None


def _check_secret_env(name: str, transport: Transport) -> None:
    if transport != "object_store":
        raise ValueError(
            "diloco.secret_env signs what the replicas write into the object store; torchft's replicas meet through "
            "a lighthouse and exchange nothing through a store, so drop secret_env or use transport: object_store"
        )
    if not os.environ.get(name):
        raise ValueError(
            f"diloco.secret_env names the environment variable {name!r}, which is unset or empty in this process; "
            f"export {name}=<the secret every replica shares> (the same value for every replica) before starting, "
            "or drop secret_env"
        )
