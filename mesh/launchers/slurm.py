"""``slurm``: each mesh is a Slurm job of ``hosts`` nodes, one Monarch worker per node.

One job per mesh, not one for the whole topology: a job's nodes are exactly its mesh's
hosts, and jobs that are not exclusive may share a node, so the default three-mesh
topology runs on a one-node cluster. Each worker listens on a port of its own: the run draws
a base port, each mesh gets the next ``hosts`` ports and node ``SLURM_NODEID`` of its job
takes the mesh's first port plus that id, so no two workers of a run share a port even
where Slurm places several "nodes" on one machine (the tests' two-node cluster); the controller
attaches to the workers and spawns the mesh's processes inside them, that is inside the
job's allocation, where Slurm accounts for them and ``scancel`` ends them.

Job state is read with ``squeue --format`` (the same on every Slurm version, unlike
``squeue --json``, whose schema changed after 22.05) and node lists are expanded by
``scontrol show hostnames``; the controller dials each node at its ``NodeAddr``.
"""

from __future__ import annotations

import asyncio
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import BeforeValidator, NonNegativeInt, PositiveInt

from mesh.launchers.procs import spawn_procs
from mesh.topology.gpus import proc_starts
from mesh.topology.grammars import (
    SBATCH_OPTION,
    SBATCH_PATH,
    SBATCH_WORD,
    SLURM_MEM,
    SLURM_NAME,
    SLURM_NAMES,
    SLURM_TIME,
)
from mesh.topology.launcher import LauncherOptions

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from mesh.topology.plan import RunPlan
    from mesh.topology.schema import MeshSpec, Topology

WORKER = (
    "import os, socket; from monarch.actor import run_worker_loop_forever; "
    'port = int(os.environ["CM_WORKER_PORT"]) + int(os.environ["SLURM_NODEID"]); '
    'address = "tcp://%s:%d@tcp://0.0.0.0:%d" % (socket.gethostname(), port, port); '
    'run_worker_loop_forever(address=address, ca="trust_all_connections")'
)
# a run's base port is drawn from here: below Linux's ephemeral range (32768-60999), so no outgoing connection
# on a node (gloo, a TCPStore, Monarch's own) already holds a worker's port
PORTS = (20000, 32000)
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30
POLL_S = 0.5
WATCH_S = 2.0


class SlurmError(RuntimeError):
    """A job that could not be submitted, did not start, or ended under the run."""


def _quoted_time(value: object) -> object:
    """Refuse a time YAML read as a number: unquoted, ``12:00:00`` is 43200 (YAML 1.1 reads base 60)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(
            f"is the number {value}, but YAML reads an unquoted H:MM or H:MM:SS as one number in base 60; quote "
            "the time as sbatch spells it, e.g. time: '12:00:00' (or '30' for minutes)"
        )
    return value


def _megabytes(value: object) -> object:
    """``mem: 16384`` (megabytes, as sbatch reads a bare number) as sbatch's text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class SlurmOptions(LauncherOptions):
    """Each option becomes an ``#SBATCH`` line of every mesh's job; ``sbatch_args`` are
    further ones, given as sbatch spells them (``--constraint=h100``). ``gpus_per_node`` is
    what each node of the partition has: a mesh's job asks for the GPUs its node runs
    (procs x gpus), so CPU meshes take none. Every value is checked against what sbatch
    reads as one word of its kind (``mesh/topology/grammars.py``): a newline, space or '#'
    would end the directive early or add another, and a shell command after a newline runs."""

    one_machine: ClassVar[bool] = False
    kind: Literal["slurm"] = "slurm"
    partition: Annotated[str, SLURM_NAMES.field] | None = None
    account: Annotated[str, SLURM_NAME.field] | None = None
    qos: Annotated[str, SLURM_NAME.field] | None = None
    time: Annotated[str, BeforeValidator(_quoted_time), SLURM_TIME.field] | None = None
    gpus_per_node: NonNegativeInt | None = None  # 0: a partition of CPU nodes
    cpus_per_task: PositiveInt | None = None
    mem: Annotated[str, BeforeValidator(_megabytes), SLURM_MEM.field] | None = None
    exclusive: bool = False
    overcommit: bool = False
    sbatch_args: tuple[Annotated[str, SBATCH_OPTION.field], ...] = ()

    def check(self, plan: RunPlan) -> None:
        """What the job scripts take from the topology reads as one sbatch word (each mesh's job name,
        the log directory); with ``gpus_per_node`` (the GPUs each node of the partition has), every
        mesh's node must fit."""
        topology = plan.topology
        for name in plan.meshes:
            if not SBATCH_WORD.matches(name):
                raise ValueError(
                    f"meshes: the mesh name {SBATCH_WORD.refusal(name)}, which its Slurm job's name (#SBATCH "
                    "--job-name) must be; rename the mesh"
                )
        if not SBATCH_PATH.matches(logs := str(log_directory(topology))):
            raise ValueError(
                f"logging.root: the jobs write their output under it (#SBATCH --output={logs}/...), and "
                f"{SBATCH_PATH.refusal(logs)}; set logging.root to a path without those characters"
            )
        if self.gpus_per_node is None:
            return
        for name, mesh in topology.meshes.items():
            if mesh.share_gpus_with is None and mesh.procs * mesh.gpus > self.gpus_per_node:
                raise ValueError(
                    f"mesh {name} needs {mesh.procs * mesh.gpus} GPUs on each node (procs {mesh.procs} x gpus "
                    f"{mesh.gpus}), but launcher.gpus_per_node is {self.gpus_per_node}; lower meshes.{name}.procs "
                    f"and raise meshes.{name}.hosts, or pick a partition with bigger nodes"
                )

    def sbatch_lines(self) -> list[str]:
        """The options as ``#SBATCH`` lines, spelled as sbatch spells them."""
        lines = []
        for name in ("partition", "account", "qos", "time", "cpus_per_task", "mem"):
            if (value := getattr(self, name)) is not None:
                lines.append(f"#SBATCH --{name.replace('_', '-')}={value}")
        lines += [f"#SBATCH --{name}" for name in ("exclusive", "overcommit") if getattr(self, name)]
        return lines + [f"#SBATCH {arg}" for arg in self.sbatch_args]

    def describe(self, plan: RunPlan) -> list[str]:
        return describe_jobs(plan, self)

    def launcher(self) -> SlurmLauncher:
        return SlurmLauncher(self)


@dataclass
class SlurmJob:
    """One submitted mesh: its job id, the port of its first node, and, once it runs, its nodes'
    worker addresses in ``SLURM_NODEID`` order."""

    mesh: str
    job_id: str
    port: int
    workers: list[str]


def sbatch_script(
    name: str, spec: MeshSpec, port: int | str, options: SlurmOptions, logs: str, python: str = sys.executable
) -> str:
    """The batch script of one mesh: ``hosts`` nodes, one worker task on each, with the GPUs of its
    processes; its output in ``logs``."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={spec.hosts}"]
    lines += ["#SBATCH --ntasks-per-node=1", f"#SBATCH --output={logs}/%x-%j.out"]
    if spec.gpus:
        lines.append(f"#SBATCH --gpus-per-node={spec.procs * spec.gpus}")
    lines += options.sbatch_lines()
    lines += [
        f"export CM_WORKER_PORT={port}  # node SLURM_NODEID listens on this port + SLURM_NODEID",
        f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -c {shlex.quote(WORKER)}",
    ]
    return "\n".join(lines) + "\n"


def describe_jobs(plan: RunPlan, options: SlurmOptions) -> list[str]:
    """What ``--dry-run`` shows of a slurm placement: each mesh's job, its nodes and its batch script
    (the port is drawn when the run starts)."""
    topology, meshes = plan.topology, plan.meshes
    nodes = sum(spec.hosts for spec in meshes.values())
    shared = "each its own" if options.exclusive else "jobs may share nodes (launcher.exclusive: true keeps them apart)"
    split = ", ".join(f"{name} {spec.hosts}" for name, spec in meshes.items())
    lines = ["", f"# slurm jobs (one per mesh): {nodes} node(s) in all, {shared}", f"node split: {split}"]
    logs = str(log_directory(topology))
    for (name, spec), offset in zip(meshes.items(), first_ports(meshes).values(), strict=True):
        port = f"$((BASE_PORT + {offset}))"
        lines += [
            f"## mesh {name}: {spec.hosts} node(s), one worker each",
            sbatch_script(f"{topology.name}-{name}", spec, port, options, logs),
        ]
    return lines


def log_directory(topology: Topology) -> Path:
    """Where the jobs' output goes (``#SBATCH --output``)."""
    return Path(topology.logging.root).resolve() / "slurm"


def first_ports(meshes: dict[str, MeshSpec]) -> dict[str, int]:
    """Each mesh's first port as an offset from the run's base port: the meshes before it
    take one port per node."""
    offsets, taken = {}, 0
    for name, spec in meshes.items():
        offsets[name], taken = taken, taken + spec.hosts
    return offsets


def job_state(job_id: str) -> tuple[str | None, str]:
    """(state, node list) of a job in the queue; (None, "") once it has left it."""
    out = _run(["squeue", "--noheader", "--jobs", job_id, "--format", "%T|%N"], check=False).strip()
    if not out or "|" not in out:
        return None, ""
    state, nodes = out.splitlines()[0].split("|", 1)
    return state, nodes


def final_state(job_id: str) -> str:
    """How a job that left the queue ended (``sacct``), or "unknown" without accounting."""
    out = _run(["sacct", "--noheader", "--parsable2", "--jobs", job_id, "--format", "State"], check=False).split()
    return out[0] if out else "unknown"


def node_addresses(nodelist: str) -> list[str]:
    """The ``NodeAddr`` of each node of a job's node list, in ``SLURM_NODEID`` order."""
    names = _run(["scontrol", "show", "hostnames", nodelist]).split()
    described = _run(["scontrol", "show", "node", "--oneliner", nodelist])
    addresses = dict(re.findall(r"NodeName=(\S+).*?NodeAddr=(\S+)", described))
    return [addresses.get(name, name) for name in names]


def _run(command: list[str], check: bool = True) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise SlurmError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


class SlurmLauncher:
    def __init__(self, options: SlurmOptions) -> None:
        from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
        from monarch.actor import enable_transport

        self.options = options
        self.jobs: dict[str, SlurmJob] = {}
        loopback = socket.gethostbyname(socket.gethostname()).startswith("127.")
        # a node whose name resolves only to loopback (the tests' cluster on one machine) cannot advertise itself
        enable_transport(ChannelTransport.TcpWithLocalhost if loopback else ChannelTransport.TcpWithHostname)

    def start(self, plan: RunPlan) -> dict[str, ProcMesh]:
        topology = plan.topology
        self.specs, self.starts = plan.meshes, proc_starts(plan)
        base, offsets = random.randrange(*PORTS), first_ports(self.specs)
        logs = log_directory(topology)
        logs.mkdir(parents=True, exist_ok=True)
        for name, spec in self.specs.items():
            port = base + offsets[name]
            script = sbatch_script(f"{topology.name}-{name}", spec, port, self.options, str(logs))
            job_id = self._submit(script)
            self.jobs[name] = SlurmJob(name, job_id, port, [])
        self._wait_running()
        from monarch.actor import attach_to_workers  # a launch needs Monarch; a --dry-run only the scripts

        self.hosts = {
            name: attach_to_workers(name=name, ca="trust_all_connections", workers=job.workers)
            for name, job in self.jobs.items()
        }
        return {name: self.respawn(name) for name in self.specs}

    def _submit(self, script: str) -> str:
        result = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
        if result.returncode != 0:
            raise SlurmError(
                f"sbatch refused a mesh's job: {result.stderr.strip()}; check launcher.partition, account, qos and "
                "the other launcher.* options against the cluster's limits (sinfo, sacctmgr)"
            )
        return result.stdout.strip().split(";")[0]

    def _wait_running(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = dict(self.jobs)
        while waiting:
            for name, job in list(waiting.items()):
                state, nodes = job_state(job.job_id)
                if state == "RUNNING":
                    job.workers = [f"tcp://{a}:{job.port + i}" for i, a in enumerate(node_addresses(nodes))]
                    del waiting[name]
                elif state is None or state not in ("PENDING", "CONFIGURING"):
                    ended = state or final_state(job.job_id)
                    raise SlurmError(
                        f"Slurm job {job.job_id} (mesh {name}) ended before it ran: {ended}; its output is in the "
                        "launcher's log directory (<logging.root>/slurm)"
                    )
            if waiting and time.monotonic() > deadline:
                pending = ", ".join(f"{j.job_id} ({n})" for n, j in waiting.items())
                raise SlurmError(
                    f"Slurm jobs {pending} did not start within {START_TIMEOUT_S} s: the cluster is busy or cannot "
                    "meet the request (see `squeue` for the reason); lower meshes.*.hosts or change launcher.partition"
                )
            time.sleep(POLL_S)

    def respawn(self, name: str) -> ProcMesh:
        """Fresh processes in the mesh's workers, which live as long as its job."""
        if (lost := self._lost(name)) is not None:
            raise lost
        return spawn_procs(self.hosts[name], self.specs[name].procs, self.starts[name])

    async def watch(self) -> None:
        """Return never; raise once a job stops running (cancelled, preempted, out of time, its node
        failed), seconds after Slurm says so rather than when Monarch next misses its workers."""
        while True:
            await asyncio.sleep(WATCH_S)
            for name in self.jobs:
                if (lost := await asyncio.to_thread(self._lost, name)) is not None:
                    raise lost

    def _lost(self, name: str) -> SlurmError | None:
        """Why mesh ``name``'s job no longer holds its nodes, or None while it runs."""
        job = self.jobs[name]
        state, _ = job_state(job.job_id)
        if state == "RUNNING":
            return None
        if state is None:
            ended = final_state(job.job_id)
            state = "cancelled, preempted or out of time" if ended == "unknown" else ended
        return SlurmError(
            f"Slurm job {job.job_id} of mesh {name} ended ({state}), so its nodes are gone; rerun, or resume from "
            "the last checkpoint with --resume"
        )

    async def stop(self) -> None:
        """Cancel every job the run submitted and wait (bounded) until Slurm has ended them."""
        ids = [job.job_id for job in self.jobs.values()]
        if ids:
            await asyncio.to_thread(_cancel, ids)


def _cancel(ids: list[str]) -> None:
    _run(["scancel", *ids], check=False)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(job_state(job_id)[0] is not None for job_id in ids) and time.monotonic() < deadline:
        time.sleep(POLL_S)
