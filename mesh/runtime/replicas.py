"""``python -m mesh.run x.yaml`` for a DiLoCo topology of several replicas: start them all, watch, stop.

Each replica is its own run, ``python -m mesh.run x.yaml --replica I`` in a process tree of its
own (a child of this one), exactly as a user would start it by hand on another machine or
cluster; this run only prepares where they meet, starts them, shows their progress and hands
them its signals. The parent's run directory holds::

    <name>-<time>/
      replicas/<name>-r<I>-<time>/   each replica's own run directory (metrics, checkpoints, reward.png)
      replica_<I>.log                each replica's output
      lighthouse                     torchft: the address of the lighthouse this run serves
      diloco/                        object_store: the rounds, unless diloco.store names a store
      reward.png                     every replica's reward curve

On one machine the replicas split its cores between them (each child's CPU affinity), so the
threads each replica's meshes start match the cores it has.

The replicas die with this run: were it killed with SIGKILL (no handler runs, nothing is passed
on), the kernel kills each replica at once (Linux's parent-death signal), and a replica's meshes
end with their replica as a single run's do. Each keeps the last checkpoint it wrote.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tqdm import tqdm

from mesh.records.rundir import METRICS_FILE, REWARD_KEY, RunDir, RunDirError, draw, plot_replica_rewards, read_rows
from mesh.supervision.interrupts import SIGNALS
from mesh.topology.schema import Topology

POLL_S = 0.5
LIGHTHOUSE_FILE = "lighthouse"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Replica:
    """One replica's run, as its parent sees it."""

    index: int
    process: subprocess.Popen
    log: Path
    runs: Path  # where its run directory appears
    name: str
    records: list[dict] = field(default_factory=list)
    unreadable: bool = False  # its metrics.jsonl could not be read (``read``)
    _run: Path | None = None
    _read_to: tuple[int, int] = (0, 0)  # (inode, offset) of metrics.jsonl read so far

    @property
    def run_dir(self) -> Path | None:
        if self._run is None:
            self._run = next(iter(sorted(self.runs.glob(f"{self.name}-*"))), None)
        return self._run

    def read(self) -> None:
        """Add the metrics lines written since the last read; all of them again when the file was
        replaced (a restarted trainer's run rewinds it to its checkpoint). A file that cannot be read
        is said once and no longer followed: the replica trains on, its progress unseen here."""
        if self.run_dir is None or self.unreadable:
            return
        inode, offset = self._read_to
        try:
            rows = read_rows(self.run_dir / METRICS_FILE, inode, offset)
        except RunDirError as error:
            self.unreadable = True
            print(f"warning: replica {self.index}'s progress is no longer shown: {error}", file=sys.stderr)
            return
        if rows.inode != inode:
            self.records = []
        self.records += rows.records
        self._read_to = (rows.inode, rows.end)

    @property
    def step(self) -> int:
        return self.records[-1]["step"] + 1 if self.records else 0

    def outcome(self) -> str:
        code = self.process.returncode
        where = self.run_dir or self.log
        if code == 0:
            reward = f", reward {self.records[-1][REWARD_KEY]:.3f}" if self.records else ""
            return f"replica {self.index}: done at step {self.step}{reward}, in {where}"
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if line.startswith(("error:", "stopped:"))), None)
        return f"replica {self.index}: exit {code}: {said or 'see ' + str(self.log)}"


def run_replicas(topology: Topology, path: str, overrides: list[str], run_root: str | None, progress: bool) -> int:
    """Start the topology's replicas as runs of their own and wait for them; the exit code is 0 when all
    finished, else the first failed replica's."""
    diloco = topology.diloco
    parent = RunDir.create(
        run_root or topology.logging.root, topology.name, topology.model_dump(mode="json"), tensorboard=False
    )
    lighthouse = None
    if diloco.transport == "torchft" and diloco.lighthouse is None:
        lighthouse = serve_lighthouse(parent.path, diloco.round_timeout)
        meeting = f"diloco.lighthouse={lighthouse.address}"
    elif diloco.transport == "object_store" and diloco.store is None:
        meeting = f"diloco.store={(parent.path / 'diloco').resolve().as_uri()}"
    else:
        meeting = (
            f"diloco.{'lighthouse' if diloco.transport == 'torchft' else 'store'}={diloco.lighthouse or diloco.store}"
        )
    print(f"run directory: {parent.path} ({diloco.replicas} DiLoCo replicas, {meeting.removeprefix('diloco.')})")
    cores = core_sets(diloco.replicas)
    replicas = [
        _start(i, topology.name, path, [*overrides, meeting], parent.path, cores[i]) for i in range(diloco.replicas)
    ]
    try:
        _watch(replicas, topology.loop.steps, progress)
    finally:
        for replica in replicas:
            replica.read()
        if lighthouse is not None:
            lighthouse.stop()
        curves = {f"replica {r.index}": r.records for r in replicas}
        draw(parent.path / "reward.png", lambda out: plot_replica_rewards(curves, out))
    for replica in replicas:
        print(replica.outcome(), file=sys.stdout if replica.process.returncode == 0 else sys.stderr)
    print(f"run directory: {parent.path}")
    return next((r.process.returncode for r in replicas if r.process.returncode != 0), 0)


def serve_lighthouse(run_path: Path, round_timeout: float):
    """A torchft lighthouse served from this process for the run's replicas; its address is written
    to ``<run>/lighthouse`` for replicas started by hand (``--set diloco.lighthouse=...``). A quorum
    that has a majority waits ``round_timeout`` for the other live replicas."""
    from actors.diloco.torchft import Lighthouse

    lighthouse = Lighthouse.start(join_timeout_ms=int(round_timeout * 1000))
    (run_path / LIGHTHOUSE_FILE).write_text(lighthouse.address + "\n")
    return lighthouse


def core_sets(replicas: int) -> list[set[int] | None]:
    """The cores each replica may use: this process's, split evenly; None (share all) when there are
    fewer cores than replicas."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < replicas:
        return [None] * replicas
    share = len(cores) // replicas
    return [set(cores[i * share : (i + 1) * share]) for i in range(replicas)]


def _start(index: int, name: str, path: str, overrides: list[str], parent: Path, cores: set[int] | None) -> Replica:
    log = parent / f"replica_{index}.log"
    runs = parent / "replicas"
    command = [sys.executable, "-m", "mesh.run", path, "--replica", str(index), "--run-root", str(runs)]
    command += [arg for override in overrides for arg in ("--set", override)] + ["--no-progress"]
    mine = os.sched_getaffinity(0)
    if cores is not None:  # the child inherits the affinity of the thread that forks it
        os.sched_setaffinity(0, cores)
    try:
        with log.open("wb") as out:
            process = start_child(command, out)
    finally:
        os.sched_setaffinity(0, mine)
    return Replica(index, process, log, runs, f"{name}-r{index}")


def start_child(command: list[str], out: IO[bytes]) -> subprocess.Popen:
    """``command`` in a session of its own (this run hands it its signals itself), killed by the kernel when
    this process dies, however it dies: no replica trains on, unwatched, after its parent was SIGKILLed."""
    return subprocess.Popen(
        command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent()
    )


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs between fork and exec so that it gets SIGKILL when this process exits: prctl's
    parent-death signal, which exec keeps. The parent is alive then (it waits for the exec), so no death can
    come before the request. The signal follows the thread that forks, so start replicas from the main thread.
    None where the platform has no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, called after it
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _watch(replicas: list[Replica], steps: int, progress: bool) -> None:
    """Show the replicas' progress until all have exited; this run's signals go to every replica (each
    stops at a step boundary with a checkpoint; a second signal stops them at once)."""
    previous = {s: signal.signal(s, lambda signum, _: _forward(replicas, signum)) for s in SIGNALS}
    bar = tqdm(total=steps, desc="replicas", unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        while any(r.process.poll() is None for r in replicas):
            time.sleep(POLL_S)
            for replica in replicas:
                replica.read()
            bar.n = min(r.step for r in replicas)
            bar.set_postfix_str("  ".join(_status(r) for r in replicas))
    finally:
        bar.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _status(replica: Replica) -> str:
    if replica.process.returncode not in (None, 0):
        return f"r{replica.index} exited {replica.process.returncode}"
    if not replica.records:
        return f"r{replica.index} starting"
    last = replica.records[-1]
    sync = next((r for r in reversed(replica.records) if "diloco/round" in r), None)
    synced = f" round {sync['diloco/round']:.0f} ({sync['diloco/replicas_in_round']:.0f} in)" if sync else ""
    return f"r{replica.index} step {replica.step} reward {last.get(REWARD_KEY, 0.0):.2f}{synced}"


def _forward(replicas: list[Replica], signum: int) -> None:
    print(f"\n{signal.Signals(signum).name}: passed on to every replica", file=sys.stderr)
    for replica in replicas:
        if replica.process.poll() is None:
            replica.process.send_signal(signum)
