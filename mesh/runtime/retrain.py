"""``python -m mesh.run x.yaml --retrain RUN_DIR``: train on a fully recorded run's batches, in order.

To compare a change to the loss on exactly the same data, the run in RUN_DIR recorded every row of
every step (``logging.samples: {full: true}``, ``mesh/controller/samples.py``): its token ids, the
sampler's logprobs, its reward, the distill teacher's top-k and the reference's logprobs, with the
prompt group it belongs to. A retraining rebuilds each step's batch from them and trains this topology's
trainer on it, step by step. Nothing is sampled, rewarded, traced or scored: only the trainer's mesh
starts (``RunPlan.retraining``), no weights are pushed and nothing is evaluated; the batches' policy
ages are the recorded ones.

samples.jsonl is read back as strictly as a checkpoint's batches in flight (``mesh/controller/inflight.py``'s
models): whoever can write a run directory can write it, and a token id past the vocabulary, logprobs
shorter than the completion or a NaN would otherwise crash the trainer steps later or be trained on
silently. Every mistake is a ``TopologyError`` (exit 2) naming the file, the line and the fix, before
anything starts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from actors.basics.disk import is_regular, lines, open_regular
from actors.contract.rollouts import RolloutGroup, Row
from actors.inner_loops.checkpoint import STRICT, first_problem
from mesh.checkpoints.fingerprint import FingerprintError, topology_fingerprint
from mesh.controller.collected import Collected
from mesh.controller.inflight import Saved, SavedProblem, SavedRow, bounds
from mesh.records.rundir import LONGEST_ROW, SAMPLES_FILE
from mesh.topology.plan import RunPlan
from mesh.topology.schema import Topology, TopologyError, load_topology

RECORD_AGAIN = "record the run again with --set logging.samples.full=true"
ROW_KEYS = ("kind", "trajectory", "version", "teacher", "distill", "reference_logprobs", "episode")  # a SavedRow's
NO_SECONDS = {"generate": 0.0, "load": 0.0, "reward": 0.0, "teachers": 0.0}  # nothing was collected


class RecordedPlace(Saved):
    """Where a full samples.jsonl line's row belongs (its step, group and place in the step's batch of ``rows``,
    and its lengths as the summary fields say them); the row itself is a ``SavedRow``."""

    model_config = STRICT | ConfigDict(extra="ignore")  # the line's other keys are the row's, read apart
    step: int = Field(ge=0)
    group: int = Field(ge=0)
    row: int = Field(ge=0)
    rows: int = Field(ge=1)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    problem: SavedProblem
    distill_teacher: str | None


def recorded_batches(run_dir: Path, plan: RunPlan) -> list[Collected]:
    """The batches of steps 0 .. ``loop.steps`` - 1 that the run in ``run_dir`` trained on, for ``plan``'s
    trainer; a ``TopologyError`` says what is wrong with them and how to fix it."""
    topology = plan.topology
    recorded = _check_recorded(run_dir, topology)
    steps = _read(run_dir / SAMPLES_FILE, bounds(recorded))
    if sorted(steps) != list(range(len(steps))):
        raise TopologyError(
            f"{run_dir / SAMPLES_FILE} holds steps {min(steps)} to {max(steps)} with gaps or a late start (a resumed "
            "run records from the step it resumed at), but a retraining trains from step 0 on every step; "
            f"{RECORD_AGAIN} in one piece"
        )
    if topology.loop.steps > len(steps):
        raise TopologyError(
            f"{run_dir} recorded {len(steps)} steps and the topology trains {topology.loop.steps}; retrain at most the "
            f"steps it recorded: --set loop.steps={len(steps)}"
        )
    batches = [steps[step] for step in range(topology.loop.steps)]
    if plan.runs("reference") and any(row.reference_logprobs is None for b in batches for row in b.rows()):
        raise TopologyError(
            f"--retrain {run_dir}: the topology scores the KL penalty's reference on a mesh of its own, which a "
            "retraining does not start, and the recording has no reference logprobs; score it on the trainer's ranks: "
            "--set actors.reference.placement=in_trainer"
        )
    return batches


def oldest_age(batches: list[Collected]) -> int:
    """The largest policy age among the recorded rows (batch k trained at step k): the lag a retraining allows."""
    return max(step - row.oldest_version for step, collected in enumerate(batches) for row in collected.rows())


def largest_step(batches: list[Collected]) -> tuple[int, int]:
    """The most rows of one recorded step, and the most tokens of one row (its prompt and completion): what
    the retraining's trainer must hold at once (``mesh.topology.preflight.check_retrained_steps``)."""
    rows = [row.trajectory for collected in batches for row in collected.rows()]
    return max(len(c.rows()) for c in batches), max(len(t.prompt_ids) + len(t.completion_ids) for t in rows)


def _check_recorded(run_dir: Path, topology: Topology) -> Topology:
    """``run_dir`` is a fully recorded run of this topology's model, tokenizer and task; returns the topology
    it was recorded with (which bounds what its rows can hold: ``mesh.controller.inflight.bounds``)."""
    written = run_dir / "topology.yaml"
    if not is_regular(run_dir / SAMPLES_FILE) or not is_regular(written):
        raise TopologyError(
            f"--retrain {run_dir}: not a run directory with a recording (it needs topology.yaml and {SAMPLES_FILE}); "
            f"name the directory a run printed as 'run directory:', recorded with logging.samples.full: true (a link "
            "or a pipe in place of either file is not one)"
        )
    try:
        recorded = load_topology(written, placed_here=False)  # the topology file's reader and its bounds
        mine, theirs = topology_fingerprint(topology).to_json(), topology_fingerprint(recorded).to_json()
    except (TopologyError, FingerprintError) as error:
        raise TopologyError(f"--retrain {run_dir}: its topology.yaml cannot be read back: {error}") from None
    samples = recorded.logging.samples
    if samples is None or not samples.full:
        shown = json.dumps(samples.model_dump(mode="json") if samples is not None else None)
        raise TopologyError(
            f"--retrain {run_dir}: that run was not fully recorded (its logging.samples is {shown}), so "
            f"{SAMPLES_FILE} holds some rows of some steps, and a retraining trains on every row of every step; "
            f"{RECORD_AGAIN}"
        )
    differences = topology_fingerprint(topology).differences(theirs | {"adapter": mine["adapter"]}, "the recording")
    if differences:  # LoRA or not may differ: the rows are the same data for either
        raise TopologyError(
            f"--retrain {run_dir}: it was recorded for another job: {'; '.join(differences)}. Retrain on it with a "
            f"topology of the same model, tokenizer and task (its own is {written})"
        )
    return recorded


def _read(path: Path, context: dict[str, Any]) -> dict[int, Collected]:
    """samples.jsonl's rows, each validated against ``context``, as one ``Collected`` per step: each step with
    exactly the rows it recorded, in order."""
    rows: dict[int, dict[int, list[Row]]] = defaultdict(lambda: defaultdict(list))
    places: dict[int, list[tuple[int, RecordedPlace]]] = defaultdict(list)
    problems, distill_teachers = {}, {}
    try:
        with open_regular(path) as file:
            for number, line in enumerate(lines(file, LONGEST_ROW), 1):
                place, row = _row(path, number, line, context)
                rows[place.step][place.group].append(row)
                places[place.step].append((number, place))
                problems[place.step, place.group] = place.problem.decode()
                distill_teachers[place.step] = place.distill_teacher
    except OSError as error:  # a line too long (``lines``), or the file replaced since it was checked
        raise TopologyError(f"{path} cannot be read: {error}; {RECORD_AGAIN}") from None
    for step, recorded in places.items():
        _check_whole(path, step, recorded)
    return {
        step: Collected(
            [RolloutGroup(problems[step, index], index, tuple(group)) for index, group in groups.items()],
            distill_teachers[step],
            dict(NO_SECONDS),
            {},
        )
        for step, groups in rows.items()
    }


def _check_whole(path: Path, step: int, recorded: list[tuple[int, RecordedPlace]]) -> None:
    """Step ``step``'s lines (number, place) are its rows 0 .. rows - 1, each once and in order: a line deleted,
    repeated or moved, or a file cut short, would train on another batch than the run did."""
    number, first = recorded[0]
    for expected, (number, place) in enumerate(recorded):
        if place.rows != first.rows:
            problem = f"says step {step} has {place.rows} rows where line {recorded[0][0]} says {first.rows}"
        elif place.row < expected:
            problem = f"holds row {place.row} of step {step} again (or out of order)"
        elif place.row > expected:
            problem = f"holds row {place.row} of step {step}, but its row {expected} is missing before it"
        else:
            continue
        raise TopologyError(f"{path} line {number} {problem}; {RECORD_AGAIN}")
    if len(recorded) < first.rows:
        raise TopologyError(
            f"{path} holds {len(recorded)} of the {first.rows} rows step {step} recorded (the last, line {number}, is "
            f"row {len(recorded) - 1}): the rest were deleted or the file was cut short; {RECORD_AGAIN}"
        )


def _not_recorded(path: Path, number: int, problem: str) -> str:
    return (
        f"{path} line {number}, at {problem} It is not a row the recorder wrote with logging.samples.full (or it "
        f"was changed since); {RECORD_AGAIN}"
    )


def _row(path: Path, number: int, line: bytes, context: dict[str, Any]) -> tuple[RecordedPlace, Row]:
    try:
        record: Any = json.loads(line)  # UTF-8 only: a byte that is not is a ValueError
    except (ValueError, RecursionError) as error:  # RecursionError: nested past Python's stack
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise TopologyError(f"{path} line {number} is not JSON ({reason}); {RECORD_AGAIN}") from None
    try:
        place = RecordedPlace.model_validate(record)
    except ValidationError as error:
        raise TopologyError(_not_recorded(path, number, first_problem(error, record))) from None
    reward = {"total": "reward", "parts": "reward_parts", "hint": "hint"}
    saved = {key: record[key] for key in ROW_KEYS if key in record}
    saved["reward"] = {key: record[name] for key, name in reward.items() if name in record}
    try:
        row = SavedRow.model_validate(saved, context=context)
    except ValidationError as error:
        raise TopologyError(_not_recorded(path, number, first_problem(error, saved))) from None
    lengths = len(row.trajectory.prompt_ids), len(row.trajectory.completion_ids)
    if lengths != (place.prompt_tokens, place.completion_tokens):
        problem = (
            f"trajectory: {lengths[0]} prompt and {lengths[1]} completion tokens, but the row recorded "
            f"prompt_tokens {place.prompt_tokens} and completion_tokens {place.completion_tokens} (cut short?)."
        )
        raise TopologyError(_not_recorded(path, number, problem))
    return place, row.decode()
