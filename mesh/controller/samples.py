"""The rollout recorder: what the model wrote at a step and how it was scored, as rows of ``samples.jsonl``.

One line per recorded row, in batch order (a prompt's whole group before the next prompt's)::

    {"step": 12, "group": 3, "kind": "sample", "teacher": null, "version": 11, "age": 1,
     "prompt": "abc=", "completion": "cba", "answer": "cba", "prompt_tokens": 4, "completion_tokens": 4,
     "reward": 1.0, "reward_parts": {"exact": 1.0}, "hint": null, "advantage": 0.93}

``kind`` is the row's ``RowKind`` (``sample``, ``warm_start``, ``replay``), ``teacher`` the binding that
wrote a teacher's trace, ``version`` the policy that sampled it and ``age`` the trainer's version minus
that when it trained on it. A full recording (``logging.samples.full``) holds every row of every step,
each with what training reads of it besides (``trajectory``: its token ids, the sampler's logprobs and the
loss mask; ``distill``: the distill teacher's top-k; ``reference_logprobs``; ``episode``: the episode a row is (part
of), whose rows share one advantage; ``problem``: the whole prompt; ``row``
and ``rows``: its place in the step's batch and how many rows that has), so that ``--retrain``
(``mesh/runtime/retrain.py``) can rebuild each step's batch exactly, and tell a row deleted, repeated or cut short.

The rows are built from the step's ``Collected`` on the run directory's logging thread (``RunDir.record``),
never on the training loop's critical path: the loop only decides whether a step is recorded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from mesh.controller.collected import Collected
from mesh.controller.inflight import encode_row


@dataclass(frozen=True)
class SampleRecording:
    """Which rows are recorded: those of every ``every``-th step, the first ``per_step`` of each
    (``None``: all of them), with token ids and logprobs when ``full``."""

    every: int
    per_step: int | None
    full: bool

    def due(self, step: int) -> bool:
        return step % self.every == 0


def sample_records(
    step: int, collected: Collected, advantages: Tensor, ages: list[int], recording: SampleRecording
) -> list[dict]:
    """The rows of step ``step`` that ``recording`` keeps, as ``samples.jsonl`` lines (in batch order:
    ``advantages`` and ``ages`` hold one value per row of ``collected.rows()``)."""
    records = []
    advantage = advantages.tolist()
    rows = sum(len(group.rows) for group in collected.groups)
    for group in collected.groups:
        for row in group.rows:
            i = len(records)
            if recording.per_step is not None and i >= recording.per_step:
                return records
            trajectory, reward = row.trajectory, row.reward
            record = {
                "step": step,
                "group": group.index,
                "kind": row.kind.value,
                "teacher": row.teacher,
                "version": row.oldest_version,
                "age": ages[i],
                "prompt": group.problem.prompt,
                "completion": trajectory.text,
                "answer": group.problem.answer,
                "prompt_tokens": len(trajectory.prompt_ids),
                "completion_tokens": len(trajectory.completion_ids),
                "reward": reward.total,
                "reward_parts": reward.parts,
                "hint": reward.hint,
                "advantage": advantage[i],
            }
            if recording.full:  # ``row``, ``rows``: its place in the step's batch, and the batch's size
                record |= {"row": i, "rows": rows}
                saved = encode_row(row)
                record |= {key: saved[key] for key in ("trajectory", "distill", "reference_logprobs", "episode")}
                record |= {"problem": dataclasses.asdict(group.problem), "distill_teacher": collected.distill_teacher}
            records.append(record)
    return records
