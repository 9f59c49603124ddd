"""A real two-node Slurm cluster on this machine (munged, slurmctld, a slurmd per node), for the slurm
launcher's tests.

Debian's ``slurm-wlm`` (installed by ``.ci/setup``) runs as root from a generated
``slurm.conf`` in a temporary directory; client commands find it through ``SLURM_CONF``.
Its build allows several slurmd on one machine (``slurmd -N <node>``, each node with a port
of its own), so ``node1`` and ``node2`` both run here and a mesh of two hosts is a real
two-node job. The partition lets jobs share a node (``OverSubscribe=FORCE``), as a
topology's meshes do.

``node2`` runs in a mount namespace of its own whose ``/dev/shm`` is the directory
``<root>/node2-shm`` (where mount namespaces are allowed), so like a real second machine it
does not share this machine's ``/dev/shm``: a weight store there must be made and removed
by a process on node2.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("node1", "node2")
NODE2_SHM = "node2-shm"
START_TIMEOUT_S = 60

CONF = """\
ClusterName=composer
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=node1 NodeHostname={host} NodeAddr={address} Port=17001 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
NodeName=node2 NodeHostname={host} NodeAddr={address} Port=17002 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


def start_cluster(root: Path) -> str | None:
    """Start the cluster with its files under ``root`` and point ``SLURM_CONF`` at it; the reason
    it cannot start (for a skip) or None."""
    missing = [d for d in DAEMONS if shutil.which(d, path="/usr/sbin:/usr/bin:/sbin") is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: .ci/setup installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "a one-node Slurm cluster needs root (slurmd runs jobs as any user)"
    for sub in ("state", *(f"spool-{node}" for node in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 3 // 4
    host = socket.gethostname()
    address = socket.gethostbyname(host)
    conf.write_text(CONF.format(host=host, address=address, root=root, cpus=os.cpu_count(), memory_mb=memory_mb))
    os.environ["SLURM_CONF"] = str(conf)
    slurmds = [["/usr/sbin/slurmd", "-f", str(conf), "-N", node] for node in NODES]
    slurmds[1] = _with_own_shm(slurmds[1], root / NODE2_SHM)
    for command in (_munged(), ["/usr/sbin/slurmctld", "-f", str(conf)], *slurmds):
        started = subprocess.run(command, capture_output=True, text=True)
        if started.returncode != 0:
            return f"`{' '.join(command)}` failed: {started.stderr.strip()}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "--noheader", "--format", "%T"], capture_output=True, text=True).stdout
        if state.split() == ["idle"]:
            return None
        time.sleep(0.5)
    return f"the one-node cluster did not become idle in {START_TIMEOUT_S} s (see {root}/slurmctld.log)"


def stop_cluster(root: Path) -> None:
    subprocess.run(["scancel", "--user", "root"], capture_output=True)
    for pid_file in (*(f"slurmd-{node}.pid" for node in NODES), "slurmctld.pid"):
        if (root / pid_file).exists():
            subprocess.run(["kill", (root / pid_file).read_text().strip()], capture_output=True)


def node2_shm(root: Path) -> Path | None:
    """node2's own ``/dev/shm`` as this machine sees it (None: node2 shares this machine's)."""
    return root / NODE2_SHM if (root / NODE2_SHM).is_dir() else None


def _with_own_shm(command: list[str], shm: Path) -> list[str]:
    """``command`` in a new mount namespace with ``shm`` bound on ``/dev/shm`` (unchanged where
    mount namespaces are not allowed: ``node2_shm`` then says so)."""
    probe = ["unshare", "--mount", "--propagation", "private", "true"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        return command
    shm.mkdir(mode=0o1777)
    shm.chmod(0o1777)  # like /dev/shm: everyone may create, only owners may remove
    bind = f"mount --bind {shlex.quote(str(shm))} /dev/shm && exec {shlex.join(command)}"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind]


def _munged() -> list[str]:
    """munged as its own user when it is not running yet (``true`` when it is)."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return ["true"]
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    return ["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"]
