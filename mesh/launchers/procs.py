"""Starting a launched mesh's processes, each seeing exactly its GPUs (``mesh/topology/gpus.py``)."""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.topology.gpus import visible_devices_command

if TYPE_CHECKING:
    from monarch.actor import ProcMesh

    from mesh.topology.plan import ProcStart

# Every proc starts with these: quiet HF progress bars, and no tokenizer thread pools
# fighting the trainer's threads on a small machine.
PROC_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
# the socket of this host's fork server (mesh/launchers/forkserver.py), which the local launcher starts through
FORK_SERVER_ENV = "MESH_FORK_SERVER"
FORK_CLIENT = Path(__file__).with_name("fork_client.py")


def spawn_procs(host_mesh, procs: int, start: ProcStart, fork_server: str | None = None) -> ProcMesh:
    """``procs`` processes per host, the per-proc dim named last (``monarch.spmd`` reads LOCAL_RANK
    from it), each seeing exactly its GPUs and with its libraries imported; forked from the fork server
    at ``fork_server`` where it can."""
    from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
    from monarch.actor import default_bootstrap_cmd  # only a launch needs Monarch, not a check

    from actors.basics.proc_info import import_libraries

    proc = default_bootstrap_cmd()
    program = [proc.program, *proc.args]
    if fork_server:  # the client stands in for the forked process, or runs the program itself
        program = [sys.executable, "-S", str(FORK_CLIENT), fork_server, "--", *program]

    def command(point) -> object:
        # through sh, so the GPUs are chosen on the proc's own host, from what its worker sees
        script = f'{visible_devices_command(start.gpus[point.rank])}; exec "$0" "$@"'
        return BootstrapCommand("/bin/sh", None, ["-c", script, *program], PROC_ENV)

    setup = functools.partial(import_libraries, start.libraries) if start.libraries else None
    return host_mesh.spawn_procs(per_host={"procs": procs}, bootstrap=setup, bootstrap_command=command)


async def stop_procs(meshes: list[ProcMesh]) -> None:
    """Stop every mesh at once: each takes about a second to let its processes exit, and one that fails to stop
    must not leave the others running. The first failure is raised once all have been asked."""
    results = await asyncio.gather(*(procs.stop() for procs in meshes), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
