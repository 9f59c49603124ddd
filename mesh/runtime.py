"""Placing a topology and running it: run directory, model, meshes, actors, controller.

Faults end the run with one paragraph naming the actor that failed and where its
metrics and last checkpoint are; nothing already written is lost.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import monarch.actor
from monarch.spmd import setup_torch_elastic_env_async

from actors import registry
from actors.bindings import Student
from actors.generator import Generator
from actors.model import Placement, build_tiny_model
from actors.rewarder import Rewarder
from actors.tasks import build_task
from actors.teachers import TeacherPool
from actors.trainer import Trainer
from mesh.control import ControlChannel
from mesh.controller import Actors, Controller
from mesh.progress import Progress
from mesh.router import Router
from mesh.rundir import RunDir
from mesh.teachers import TeacherBoard
from mesh.topology import Topology

if TYPE_CHECKING:  # monarch does not export the ActorMesh type publicly
    from monarch._src.actor.actor_mesh import ActorMesh

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


class RunFailed(RuntimeError):
    """The run stopped on a fault; the message says which actor and where the results are."""


async def run(
    topology: Topology, run_root: str | None = None, progress: bool = True, resume: str | None = None
) -> RunDir:
    """Run ``topology`` to the end; returns its run directory.

    ``resume``: a checkpoint directory of an earlier run of this topology; training goes
    on from its step with its policy, optimizer and loss state (TAID's schedule).
    """
    run_dir = RunDir.create(
        run_root or topology.logging.root, topology.name, topology.model_dump(mode="json"), topology.logging.tensorboard
    )
    task = build_task(topology.task.config)
    model_path = _prepare_model(topology, task.alphabet, run_dir)
    store = str(Path(SHM_ROOT or run_dir.path) / f"composer-mesh-{os.getpid()}-{run_dir.path.name}")
    launcher = registry.load("launcher", topology.launcher.kind)()
    monarch.actor.unhandled_fault_hook = _report_fault
    bar = Progress(topology, enabled=progress)
    control = ControlChannel.create(run_dir.path)
    if progress:
        print(f"run directory: {run_dir.path} (change its teachers: python -m mesh.ctl {run_dir.path} teachers)")
    try:
        meshes = launcher.start(topology)
        actors = await _spawn(topology, meshes, model_path, store)
        start_step = 0
        if resume is not None:
            start_step = next(iter((await actors.trainer.load.call(resume)).values()))
            bar.skip(start_step)
        weights = next(w for w in (await actors.trainer.publish.call()).values() if w is not None)
        bindings = topology.actors.teachers.bindings if topology.actors.teachers else {}
        teachers = await TeacherBoard.start(actors.teachers, bindings, start_step, topology.actors.trainer.loss)
        controller = Controller(topology, actors, task, run_dir, weights, bar, teachers, control)
        await controller.train(start_step)
    except Exception as error:
        raise RunFailed(
            f"run {run_dir.path} stopped: {_cause(error)}. Metrics up to the failure are in "
            f"{run_dir.metrics_file}, checkpoints in {run_dir.path / 'checkpoints'}; fix the cause and rerun."
        ) from error
    finally:
        control.close()
        bar.close()
        await launcher.stop()
        shutil.rmtree(store, ignore_errors=True)
        run_dir.close()
    return run_dir


def _cause(error: Exception) -> str:
    """One line: which call failed and the original exception, without the remote traceback."""
    headline = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    original = getattr(error, "exception", None)  # monarch's ActorError carries the actor's own exception
    if isinstance(original, BaseException):
        return f"{headline} {type(original).__name__}: {original}"
    return headline


def _report_fault(failure) -> None:
    """A process or actor died: say so now; the call waiting on it fails next and ends the run."""
    print(f"fault: {' '.join(failure.report().split())[:500]}", file=sys.stderr)


def _prepare_model(topology: Topology, alphabet: str, run_dir: RunDir) -> str:
    if topology.model.path is not None:
        return str(Path(topology.model.path).expanduser().resolve())
    return str(build_tiny_model(run_dir.model_dir, topology.model.init, alphabet, topology.seed))


async def _spawn(topology: Topology, meshes: dict, model_path: str, store: str) -> Actors:
    cfg, seed = topology.actors, topology.seed
    place = _placements(topology)
    trainer_procs = meshes[cfg.trainer.mesh]
    await setup_torch_elastic_env_async(trainer_procs)
    slots = topology.loop.max_policy_lag + 2  # a version in use is never overwritten (see actors/weights)
    trainer = trainer_procs.spawn(
        "trainer",
        Trainer,
        model_path,
        cfg.trainer,
        seed,
        store,
        slots,
        place[cfg.trainer.mesh],
        topology.loop.steps,
        topology.weight_transport(),
    )
    generators = _generators(topology, meshes, model_path, place)
    rewarder = meshes[cfg.rewarder.mesh].spawn("rewarder", Rewarder, topology.task.config, cfg.rewarder)
    teachers = None
    if cfg.teachers is not None:
        student = Student(model_path, cfg.generator.max_new_tokens, seed)
        teachers = meshes[cfg.teachers.mesh].spawn(
            "teachers", TeacherPool, cfg.teachers, student, place[cfg.teachers.mesh]
        )
    return Actors(trainer, generators, _one_proc(rewarder), teachers and _one_proc(teachers))


def _generators(topology: Topology, meshes: dict, model_path: str, place: dict[str, Placement]) -> Router:
    """A Generator on every replica mesh, every proc of each a target of one router.

    A generator seeds its proc ``seed + 1000 * rank`` (rank within its mesh); each replica's
    seed is offset by the procs before it, so every generator proc in the job samples its own stream.
    """
    cfg = topology.actors.generator
    procs = topology.meshes[cfg.mesh].procs * topology.meshes[cfg.mesh].hosts
    targets = []
    for i, name in enumerate(topology.replica_meshes()):
        seed = topology.seed + 1000 * procs * i
        targets += _each_proc(meshes[name].spawn("generator", Generator, model_path, cfg, seed, place[name]))
    return Router(targets, cfg.router)


def _each_proc(actors: ActorMesh) -> list[ActorMesh]:
    flat = actors.flatten("rank")
    return [flat.slice(rank=i) for i in range(len(flat))]


def _one_proc(actors: ActorMesh) -> ActorMesh:
    return _each_proc(actors)[0]


def _placements(topology: Topology) -> dict[str, Placement]:
    """Per launched mesh: CPU threads (the cores shared among the processes that compute, the
    trainer's and every generator replica's, at least one each) and its GPUs, numbered mesh after mesh on this host."""
    meshes = topology.launched_meshes()
    compute = {topology.actors.trainer.mesh, *topology.replica_meshes()}
    procs = sum(meshes[m].procs * meshes[m].hosts for m in compute)
    threads = max(1, (os.cpu_count() or 1) // procs)
    places, next_gpu = {}, 0
    for name, mesh in meshes.items():
        places[name] = Placement(threads, next_gpu if mesh.gpus else None, mesh.gpus)
        next_gpu += mesh.gpus * mesh.procs * mesh.hosts
    return places
