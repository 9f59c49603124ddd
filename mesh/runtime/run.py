"""Placing a topology and running it: run directory, model, weight store, meshes, actors, controller.

A run ends in one of three ways, and each keeps everything written so far:

- done: the last step's checkpoint, metrics, ``reward.png`` and the trace are in the run directory, and
  ``final/``: that checkpoint's policy as a Hugging Face directory (``mesh/export.py``);
- a fault the run cannot absorb (an actor's endpoint raised, or more processes died than
  ``fault_tolerance.max_restarts`` allows): :class:`RunFailed`, one paragraph naming the
  actor, the step and the original exception; the remote traceback goes to ``error.log``;
- a signal: :class:`~mesh.supervision.interrupts.Interrupted` after a final checkpoint (see
  ``mesh/supervision/interrupts.py``).

Processes that die or hang along the way are replaced by the fleet (``mesh/supervision/fleet.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

# Monarch notices a dead process when it next polls its supervision state, by default every
# 10 s: a run that replaces dead processes wants to hear within a second. Read when Monarch starts.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import monarch.actor  # noqa: E402
from monarch.spmd import setup_torch_elastic_env_async  # noqa: E402

from actors.agents.task import AgentSpec  # noqa: E402
from actors.basics.compute import Compute  # noqa: E402
from actors.basics.proc_info import ProcInfo  # noqa: E402
from actors.diloco.config import DiLoCoConfig  # noqa: E402
from actors.diloco.syncer import checkpoint_name  # noqa: E402
from actors.environments.openenv_task import EpisodeSpec  # noqa: E402
from actors.environments.serve import EnvironmentServer  # noqa: E402
from actors.generator.actor import Generator  # noqa: E402
from actors.models.tiny import build_tiny_model  # noqa: E402
from actors.reference_model.actor import Batching, Reference  # noqa: E402
from actors.rewarder.actor import Rewarder  # noqa: E402
from actors.tasks import build_task  # noqa: E402
from actors.teachers.bindings import Student  # noqa: E402
from actors.teachers.pool import TeacherPool  # noqa: E402
from actors.trainer.actor import Trainer, TrainerSetup, start_trainers  # noqa: E402
from losses.config import COVARIANCE  # noqa: E402
from mesh.checkpoints.fingerprint import built_weights, topology_fingerprint  # noqa: E402
from mesh.controller import (  # noqa: E402
    Collected,
    Collection,
    CollectSettings,
    Controller,
    EpisodeCollection,
    LoopSettings,
    RecordedCollection,
    ReferenceInTrainer,
    ReferenceScoring,
    RemoteReference,
    RemoteRewarder,
    RewardedInGenerators,
    Rewarding,
    RunContext,
    SampleCollection,
    Services,
)
from mesh.controller.router import Router  # noqa: E402
from mesh.controller.samples import SampleRecording  # noqa: E402
from mesh.controller.teacher_board import TeacherBoard  # noqa: E402
from mesh.records.layout import EVENTS  # noqa: E402
from mesh.records.rundir import ERROR_LOG, RunDir  # noqa: E402
from mesh.records.trace import Tracer  # noqa: E402
from mesh.runtime.replicas import serve_lighthouse  # noqa: E402
from mesh.runtime.retrain import oldest_age  # noqa: E402
from mesh.supervision.commands import ControlChannel  # noqa: E402
from mesh.supervision.faults import explain, paragraph  # noqa: E402
from mesh.supervision.fleet import ActorFailed, Fault, Fleet, Role  # noqa: E402
from mesh.supervision.interrupts import (  # noqa: E402
    FinalInterrupted,
    Interrupted,
    Signalled,
    Stopper,
    newest_checkpoint,
)
from mesh.supervision.progress import Progress  # noqa: E402
from mesh.topology.plan import RunPlan, model_path_of  # noqa: E402
from mesh.topology.schema import SamplesLogging  # noqa: E402

if TYPE_CHECKING:  # monarch does not export these types publicly
    from monarch._src.actor.actor_mesh import ActorMesh
    from monarch.actor import ProcMesh

ENVIRONMENT_LOG = "environment.log"  # a served environment's output
PROCS = "procs.json"


class RunFailed(RuntimeError):
    """The run stopped on a fault; the message names the actor, the cause and where the results are."""


async def run(
    plan: RunPlan,
    run_root: str | None = None,
    progress: bool = True,
    resume: str | None = None,
    recorded: list[Collected] | None = None,
) -> RunDir:
    """Run ``plan`` to the end; returns its run directory.

    ``resume``: a checkpoint directory of an earlier run of this topology; training goes
    on from its step with its policy, optimizer, loss state and in-flight batches.
    ``recorded``: the batches to train on, one per step (``mesh/runtime/retrain.py``; ``plan``
    is then ``RunPlan.retraining``'s: only the trainer starts).
    """
    stopper = Stopper()
    stopper.install()  # from before the run directory is made until all is stopped: a signal stops it, cleanly
    try:
        return await _run(plan, run_root, progress, resume, recorded, stopper)
    finally:
        stopper.remove()


async def _run(
    plan: RunPlan,
    run_root: str | None,
    progress: bool,
    resume: str | None,
    recorded: list[Collected] | None,
    stopper: Stopper,
) -> RunDir:
    topology = plan.topology
    logging = topology.logging
    resumed_from = Path(resume).parent.parent if resume else None  # <run>/checkpoints/step_N
    run_dir = RunDir.create(
        run_root or logging.root,
        topology.name,
        topology.model_dump(mode="json"),
        logging.tensorboard,
        logging,
        resumed_from,
        plan.record(),
    )
    if logging.trace is not None:
        run_dir.tracer = Tracer(logging.trace.steps, run_dir.path, run_dir.background)
    bar = Progress(topology, enabled=progress)
    faults = _FaultLog(run_dir.path, bar)
    controller: Controller | None = None
    if progress:
        print(f"run directory: {run_dir.path} (change its teachers: python -m mesh.ctl {run_dir.path} teachers)")
    try:
        async with AsyncExitStack() as cleanup:  # undone in reverse: the trainer (its weight store) before the meshes
            cleanup.push(run_dir)  # closed last, with the run's outcome
            cleanup.callback(bar.close)
            monarch.actor.unhandled_fault_hook = faults.monarch  # recorded; once the fleet exists its calls fail over
            launcher = topology.launcher.launcher()
            cleanup.push_async_callback(_stop, launcher)
            control = None  # a retraining binds no teachers: nothing for mesh.ctl to change
            if recorded is None:
                control = ControlChannel.create(run_dir.path)
                cleanup.callback(control.close)
            task = build_task(topology.task.config)
            episodes = _episodes(task, run_dir, cleanup)
            model_path = _prepare_model(plan, getattr(task, "alphabet", None), run_dir)
            bindings = topology.actors.teachers.bindings if topology.actors.teachers else {}
            board = TeacherBoard(bindings, topology.actors.trainer.loss)
            roles = _roles(plan, model_path, board, _diloco_meeting(plan, run_dir, cleanup))
            trainer_mesh = topology.actors.trainer.mesh
            fleet = Fleet(launcher, roles, topology.fault_tolerance, trainer_mesh, faults.record, run_dir.tracer)
            cleanup.push_async_callback(_stop_trainer, fleet)
            monarch.actor.unhandled_fault_hook = lambda failure: (faults.monarch(failure), fleet.notice(failure))
            fleet.listeners.append(lambda mesh: _write_procs(run_dir.path, fleet))
            await fleet.start(launcher.start(plan))
            _write_procs(run_dir.path, fleet)
            services = _services(plan, fleet)
            if isinstance(episodes, AgentSpec):
                await _say_guests(plan, fleet, episodes, faults)
            if services.teacher_pool is not None:
                await board.attach(services.teacher_pool)
            context = RunContext(run_dir, bar, control, stopper, fleet)
            settings = _loop_settings(plan, episodes, recorded, Path(model_path))
            collection = _collection(settings, task, services, episodes, recorded, faults.episodes)
            controller = Controller(settings, services, collection, board, context)
            await _watched(controller.train(Path(resume) if resume else None), launcher)
    except Interrupted:
        raise
    except asyncio.CancelledError:  # a second signal, or one before the first step
        if stopper.requested is None:
            raise
        outer_state = checkpoint_name(0) if topology.diloco is not None else None
        newest = newest_checkpoint(run_dir.path, controller and controller.last_checkpoint, outer_state)
        raise Interrupted(stopper.requested, run_dir.path, newest, at_once=True) from None
    except Exception as error:
        step = controller.step if controller is not None else None
        raise RunFailed(_failure_message(run_dir, error, step, faults)) from error
    _write_final(run_dir, controller.last_checkpoint, faults, stopper)
    return run_dir


def _write_final(run_dir: RunDir, checkpoint: Path, faults: _FaultLog, stopper: Stopper) -> None:
    """The last checkpoint exported (no merge: a LoRA run's is its adapter directory) to ``final/``, once every
    process has stopped; a stop by a signal leaves none, its checkpoint is for ``--resume``. A signal while the
    meshes stopped, or during the export, stops it at once (``FinalInterrupted``: exit 128 + the signal). Any
    other failure ends the run in error.log, as a failed step does: ``mesh.report`` calls the run failed, not
    finishing forever. ``export`` itself removes the ``final.partial`` it wrote, whatever stopped it."""
    from mesh.checkpoints.export import ExportError, export

    if stopper.requested is not None:
        raise FinalInterrupted(stopper.requested, run_dir.path, checkpoint)
    final = run_dir.final_dir
    theirs = os.path.lexists(final)  # not the export's to write over, nor the runtime's to remove
    try:
        with stopper.at_once():
            export(checkpoint, final)
    except Signalled as signalled:
        if not theirs:  # renamed into place before the signal: whole, but the run says it wrote none
            shutil.rmtree(final, ignore_errors=True)
        raise FinalInterrupted(signalled.signum, run_dir.path, checkpoint) from None
    except ExportError as error:  # ``export`` turns every failure into one (a full disk, a library's refusal)
        with contextlib.suppress(OSError):  # the same full disk: the message below still says it all
            cause = f"final/ was not written: {paragraph(str(error))}"
            faults.write("the run stopped after its last step", cause, None)
        raise RunFailed(
            f"run {run_dir.path} trained every step, but its final model could not be written: {error}. Its "
            f"checkpoints are whole; export the last one again with python -m mesh.export {checkpoint} <dir>"
        ) from None


def _episodes(task, run_dir: RunDir, cleanup: AsyncExitStack) -> EpisodeSpec | None:
    """An environment task's episodes, its server started first when the run serves it (stopped
    with the run; its output in the run directory)."""
    if not callable(getattr(task, "episodes", None)):
        return None
    if task.serve is None:
        return task.episodes()
    log = run_dir.path / ENVIRONMENT_LOG
    server = cleanup.enter_context(EnvironmentServer(task.serve.app, task.serve.params, log))
    return task.episodes(server.url)


async def _say_guests(plan: RunPlan, fleet: Fleet, spec: AgentSpec, faults: _FaultLog) -> None:
    """What holds for the agents on each generator (``actors/agents/guests.py``), said once at the start."""
    said: set[str] = set()
    for name in plan.generator_meshes:
        said |= set((await fleet.handle("generator", name).agent_guarantees.call(spec)).values())
    for guarantees in sorted(said):
        faults.guests(guarantees)


def _failure_message(run_dir: RunDir, error: Exception, step: int | None, faults: _FaultLog) -> str:
    cause = error.cause if isinstance(error, ActorFailed) else explain(error)
    what = str(error) if isinstance(error, ActorFailed) else cause.summary
    faults.write(f"the run stopped{'' if step is None else f' at step {step}'}", what, cause.traceback)
    where = "before its first step" if step is None else f"at step {step}"
    return (
        f"run {run_dir.path} stopped {where}: {what}. The full traceback is in {run_dir.path / ERROR_LOG}; "
        f"metrics up to the failure are in {run_dir.metrics_file} and checkpoints in {run_dir.path / 'checkpoints'}. "
        "Fix the cause and rerun (or resume from the last checkpoint with --resume)."
    )


async def _watched(work: Awaitable[object], launcher) -> None:
    """Await ``work``, stopped early by the launcher's ``watch`` (if it has one) raising that the
    placement is gone."""
    if not hasattr(launcher, "watch"):
        await work
        return
    tasks = [asyncio.ensure_future(work), asyncio.ensure_future(launcher.watch())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stop(launcher) -> None:
    try:
        await launcher.stop()
    except Exception as error:  # a broken mesh may not stop cleanly; its processes die with this one
        print(f"warning: stopping the meshes: {paragraph(str(error))}", file=sys.stderr)


async def _stop_trainer(fleet: Fleet) -> None:
    """Stop the trainer's actors before the meshes: rank 0's ``__cleanup__`` removes the weight
    store on its host, which only a process there can (``actors/trainer/actor.py``). The actors placed beside it stop
    first: the trainer destroys its processes' whole torch.distributed world as it stops, and a vLLM generator in
    the same process must shut its engine down while the groups it made in that world exist."""
    mesh = fleet.trainer_mesh
    for role in fleet.roles_on(mesh):
        if role != "trainer":
            try:
                await fleet.stop_role(role, mesh)
            except Exception as error:  # never in place of the run's own outcome
                print(f"warning: stopping the {role} beside the trainer: {paragraph(str(error))}", file=sys.stderr)
    try:
        await fleet.stop_role("trainer", mesh)
    except Exception as error:  # never in place of the run's own outcome
        print(
            f"warning: stopping the trainer: {paragraph(str(error))}; its weight store stays on its host until "
            "the next trainer that starts there reclaims it",
            file=sys.stderr,
        )


class _FaultLog:
    """Every fault of the run: one line on the terminal, an event in ``events.jsonl``, the
    traceback in ``error.log``."""

    def __init__(self, run_path: Path, bar: Progress):
        self.run_path, self.bar = run_path, bar

    def record(self, fault: Fault) -> None:
        if fault.restart:
            outcome = f"replaced its processes in {fault.seconds:.1f} s (restart {fault.restart})"
        else:
            outcome = "no restarts left"
        self.bar.note(f"fault: {fault.actor} in {fault.endpoint}: {fault.cause.summary}; {outcome}")
        self.write(f"fault: {fault.actor} in {fault.endpoint}", fault.cause.summary, fault.cause.traceback)
        event = {"time": time.time(), "event": "fault", "actor": fault.actor, "endpoint": fault.endpoint}
        event |= {"cause": fault.cause.summary, "restart": fault.restart, "seconds": fault.seconds}
        with (self.run_path / EVENTS).open("a") as f:
            f.write(json.dumps(event) + "\n")

    def episodes(self, step: int, failures: list[str]) -> None:
        """A step's failed episodes (an environment or an agent that failed them): one line, an event each."""
        self.bar.note(f"step {step}: {len(failures)} episodes failed; the first: {failures[0]}")
        with (self.run_path / EVENTS).open("a") as f:
            for cause in failures:
                event = {"time": time.time(), "event": "fault", "actor": "episode", "endpoint": f"step {step}"}
                f.write(json.dumps(event | {"cause": cause, "restart": None, "seconds": 0.0}) + "\n")

    def guests(self, guarantees: str) -> None:
        """What holds for the run's agents: one line, an event."""
        self.bar.note(f"agents: {guarantees}")
        with (self.run_path / EVENTS).open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": "agents", "guarantees": guarantees}) + "\n")

    def monarch(self, failure) -> None:
        """Monarch's unhandled-fault hook: keep its report; the default hook would exit the program."""
        self.write(f"monarch: mesh {failure.mesh_name} failed", failure.report(), None)

    def write(self, title: str, summary: str, traceback: str | None) -> None:
        with (self.run_path / ERROR_LOG).open("a") as f:
            f.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {title}\n{summary}\n{traceback or ''}\n")


def _prepare_model(plan: RunPlan, alphabet: str | None, run_dir: RunDir) -> str:
    topology = plan.topology
    if topology.model.source is not None:
        return str(topology.model.source.directory())
    return str(build_tiny_model(run_dir.model_dir, topology.model.init, alphabet, topology.seed))


def _roles(plan: RunPlan, model_path: str, board: TeacherBoard, diloco: DiLoCoConfig | None) -> dict[str, list[Role]]:
    """Mesh name -> the actors placed on it, the trainer first on its mesh (a DiLoCo replica's owns its syncer)."""
    topology = plan.topology
    cfg, seed = topology.actors, topology.seed
    roles: dict[str, list[Role]] = {name: [] for name in plan.meshes}
    reference = plan.reference

    async def trainer(procs: ProcMesh) -> ActorMesh:
        await setup_torch_elastic_env_async(procs)
        placement = reference.placement if reference is not None else None
        setup = TrainerSetup(
            model_path,
            cfg.trainer,
            seed,
            plan.store_slots,
            _compute(plan, cfg.trainer.mesh, "trainer"),
            topology.loop.steps,
            plan.transport,
            plan.weights_dtype,
            reference_path=model_path_of(reference, model_path) if placement == "in_trainer" else None,
            reference_is_base=placement == "adapter_off",
            diloco=diloco,
            replica=plan.diloco_replica,
        )
        return procs.spawn("trainer", Trainer, setup)

    roles[cfg.trainer.mesh].append(Role("trainer", trainer, start_trainers))
    rewarding = (topology.task.config, cfg.rewarder) if plan.rewarder == "in_generator" else ()
    for name in plan.generator_meshes:  # none in a retraining: the plan starts the trainer alone
        compute = _compute(plan, name, "generator")
        adapter = cfg.trainer.lora
        spawn = _spawner("generator", Generator, model_path, cfg.generator, compute, *rewarding, adapter=adapter)
        roles[name].append(Role("generator", spawn, _start_all))
    if plan.runs("rewarder"):
        roles[cfg.rewarder.mesh].append(
            Role("rewarder", _spawner("rewarder", Rewarder, topology.task.config, cfg.rewarder), _start_all)
        )
    if plan.runs("reference"):
        compute = _compute(plan, reference.mesh, "reference")
        args = (model_path_of(reference, model_path), model_path, compute, Batching.of(cfg.trainer))
        spawn = _spawner("reference", Reference, *args)
        roles[reference.mesh].append(Role("reference", spawn, _start_all))
    if plan.runs("teachers"):
        student = Student(model_path, cfg.generator.max_new_tokens, seed, cfg.trainer.lora)
        spawn = _spawner("teachers", TeacherPool, student, _compute(plan, cfg.teachers.mesh, "teachers"))

        async def start_teachers(pool: ActorMesh) -> list[ProcInfo]:  # every binding in use, under its id
            return list((await pool.start.call(board.live())).values())

        roles[cfg.teachers.mesh].append(Role("teachers", spawn, start_teachers))
    return roles


def _diloco_meeting(plan: RunPlan, run_dir: RunDir, cleanup: AsyncExitStack) -> DiLoCoConfig | None:
    """This replica's ``diloco`` section with where the replicas meet filled in: the object store (the
    topology's, else ``<run>/diloco``), or a torchft lighthouse (the topology's, else one this run serves
    until it ends: a run of one replica)."""
    diloco = plan.topology.diloco
    if plan.diloco_replica is None:
        return None
    if diloco.transport == "object_store":
        return replace(diloco, store=diloco.store or (run_dir.path / "diloco").resolve().as_uri())
    if diloco.lighthouse is not None:
        return diloco
    lighthouse = serve_lighthouse(run_dir.path, diloco.round_timeout)
    cleanup.callback(lighthouse.stop)
    return replace(diloco, lighthouse=lighthouse.address)


def _spawner(name: str, actor_class, *args, **kwargs):
    async def spawn(procs: ProcMesh) -> ActorMesh:
        return procs.spawn(name, actor_class, *args, **kwargs)

    return spawn


async def _start_all(actors: ActorMesh) -> list[ProcInfo]:
    return list((await actors.start.call()).values())


def _services(plan: RunPlan, fleet: Fleet) -> Services:
    """Supervised handles: every call goes through the fleet, which replaces dead processes; rewarding and
    reference scoring in the implementation the plan placed them for, chosen here once."""
    cfg = plan.topology.actors
    targets = [
        fleet.handle("generator", name, proc)
        for name in plan.generator_meshes
        for proc in range(plan.meshes[name].size)
    ]
    router = Router(targets, cfg.generator.router)
    fleet.listeners.append(lambda mesh: router.forget([i for i, t in enumerate(targets) if t.mesh == mesh]))
    rewarding: Rewarding = RewardedInGenerators()
    if plan.runs("rewarder"):
        rewarding = RemoteRewarder(fleet.handle("rewarder", cfg.rewarder.mesh, 0))
    reference: ReferenceScoring = ReferenceInTrainer()  # also when there is no reference
    if plan.runs("reference"):
        reference = RemoteReference(fleet.handle("reference", plan.reference.mesh, 0))
    teacher_pool = fleet.handle("teachers", cfg.teachers.mesh, 0) if plan.runs("teachers") else None
    trainer = cfg.trainer.mesh
    ranks = [fleet.handle("trainer", trainer, proc) for proc in range(plan.meshes[trainer].size)]
    return Services(fleet.handle("trainer", trainer), ranks, router, rewarding, reference, teacher_pool)


def _collection(
    settings: LoopSettings,
    task,
    services: Services,
    episodes: EpisodeSpec | None,
    recorded: list[Collected] | None,
    failed: Callable[[int, list[str]], None],
) -> Collection:
    """Where each step's batch comes from: the recording a retraining trains on, the environment's episodes, or
    the generators' samples."""
    if recorded is not None:
        return RecordedCollection(recorded)
    if episodes is not None:
        lag = settings.max_policy_lag if settings.collect.by_group else None
        return EpisodeCollection(settings.collect, task, services, episodes, failed, lag)
    return SampleCollection(settings.collect, task, services)


def _loop_settings(
    plan: RunPlan, episodes: EpisodeSpec | None, recorded: list[Collected] | None, model_dir: Path
) -> LoopSettings:
    """What the controller's parts read of the plan, read once. A retraining evaluates nothing (it has no
    generators) and lets its batches be as old as they were recorded. ``model_dir``: the policy's base, as
    built or converted for this run."""
    topology = plan.topology
    loop, loss = topology.loop, topology.actors.trainer.loss
    collect = CollectSettings(
        prompts_per_step=loop.prompts_per_step,
        group_size=loop.group_size,
        prompt_seed=plan.prompt_seed,
        seed=topology.seed,
        evaluation_prompts=loop.evaluation.prompts,
        evaluation_greedy=loop.evaluation.greedy,
        warm_start_teacher=loop.warm_start.teacher,
        warm_start_steps=loop.warm_start.steps,
        replay=loss.beta_replay > 0,
        distill=loss.alpha_sdpo > 0,
        distill_every_sample=loss.distill.signal == "rlsd",
        by_group=loop.collect == "group",
        oracle=topology.oracle,
    )
    lag = loop.max_policy_lag if recorded is None else oldest_age(recorded)
    return LoopSettings(
        steps=loop.steps,
        max_policy_lag=lag,
        evaluation_every=loop.evaluation.every if recorded is None else 0,
        evaluation_at_start=loop.evaluation.at_start and recorded is None,
        gap_check_problems=loop.gap_check.problems if recorded is None else 0,
        checkpoint_every=topology.checkpointing.every,
        advantage=loss.policy.advantage,
        # every reply of an episode
        max_completion_len=topology.actors.generator.max_new_tokens * (episodes.max_turns if episodes else 1),
        covariance=loss.policy if loss.policy.name in COVARIANCE else None,
        reference=plan.reference is not None,
        diloco_interval=topology.diloco.interval if plan.diloco_replica is not None else None,
        fingerprint=built_weights(topology_fingerprint(topology).to_json(), model_dir),
        collect=collect,
        samples=_sample_recording(topology.logging.samples),
    )


def _sample_recording(samples: SamplesLogging | None) -> SampleRecording | None:
    return None if samples is None else SampleRecording(samples.every, samples.per_step, samples.full)


def _write_procs(run_path: Path, fleet: Fleet) -> None:
    """``procs.json``: every mesh's processes now (to find a process to inspect, or to test faults)."""
    where = {
        name: {"roles": [r.name for r in fleet.meshes[name].roles], "procs": [p.__dict__ for p in procs]}
        for name, procs in fleet.where().items()
    }
    (run_path / PROCS).write_text(json.dumps(where, indent=1) + "\n")


def _compute(plan: RunPlan, mesh: str, actor: str) -> Compute:
    """Where ``actor`` computes on ``mesh``: CPU threads (the cores this run may use, shared among
    the processes that compute, the trainer's and every generator copy's, at least one each),
    the GPUs each of the mesh's processes sees, and the share of their memory the actor may take."""
    computing = {plan.topology.actors.trainer.mesh, *plan.generator_meshes}
    threads = max(1, len(os.sched_getaffinity(0)) // sum(plan.meshes[m].size for m in computing))
    share = {"trainer": plan.trainer_memory_share, "generator": plan.vllm_share}.get(actor)
    return Compute(threads, plan.meshes[mesh].gpus, share)
