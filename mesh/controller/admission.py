"""What starts: the policy lag, the one rule on staleness, and the one admission authority that applies it.

``max_policy_lag: L`` is a rule on the tokens trained, and only there is it enforced: step k trains no token that
a version older than k - L sampled (``PolicyLag.oldest``; older tokens of a row stay as its context). Everything
else that bounds work is derived from it, so none can disagree:

    by step    the scheduler collects the L + 1 steps after the trained ones       (``PolicyLag.steps_ahead``)
    by group   the ``Admission`` starts a group while
                 started  <  (L + v + 1) x P          AReaL's rule; v: versions since the pool's first
                 running  <  C = sum over targets of (floor(places_t / e) + 1)   the generators' places
                 running + failed in a row  <  (L + 1) x P                 a lag window of failures

where P is ``prompts_per_step``, e a group's episodes (``group_size``, one more where the agent demonstrates) and
places_t what generator target t plays at once (``actors/generator/capacity.py``: its agent host's places, or its
share of the environment's sessions). C is the whole groups the places hold and one group more at each target, whose
episodes take places as the episodes before them free them: a group holds its places until its slowest episode
ends, and without that one group an episode's place would idle for a round trip to the controller. An episode that
waits for a place has nothing open (no session, no key, no process), and nothing waits in the router. A group the lag
allows that the generators have no place for waits here, unstarted, counted as ``groups/waiting``; every step logs
``groups/admitted`` (started, not yet taken or given back), ``groups/running`` and ``groups/at_once`` (C).

A group admitted with the newest weights v is at most L versions behind the step it fills, as long as the groups
finish in about the order they started; a slower one trains only its tokens no older than its step's limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.generator.capacity import Capacity
from mesh.controller.collected import Collected


class StalenessError(RuntimeError):
    """A batch older than ``max_policy_lag`` reached the trainer: a controller bug, never trained on."""


@dataclass(frozen=True)
class PolicyLag:
    """``loop.max_policy_lag`` and what is derived from it (see the module docstring)."""

    limit: int

    def oldest(self, step: int) -> int:
        """The oldest version whose tokens step ``step`` trains."""
        return step - self.limit

    @property
    def steps_ahead(self) -> int:
        """Collected by step: the steps collected at once after the trained ones (AReaL's rule counted in steps)."""
        return self.limit + 1

    def admissible(self, versions: int, per_step: int) -> int:
        """AReaL's rule: the groups that may have started once the newest weights are ``versions`` past the
        first, ``(L + v + 1) x P``."""
        return (self.limit + versions + 1) * per_step

    def ages(self, step: int, collected: Collected) -> list[int]:
        """Each row's policy age when step ``step`` trains on it; a batch whose channel-1 rows are older than the
        lag is refused (a replayed trace's logprobs are the trainer's own, whichever version scored it)."""
        rows = collected.rows()
        ages = [step - row.oldest_version for row in rows]
        oldest = max((age for age, row in zip(ages, rows) if row.kind.trains_policy), default=0)
        if oldest > self.limit:
            raise StalenessError(f"step {step}: samples of policy age {oldest} > max_policy_lag")
        return ages


class Admission:
    """The admission authority of a run collected by group: which of the prompt stream's groups start, and when
    (see the module docstring). The pool asks it before each start and tells it what became of each group."""

    def __init__(self, lag: PolicyLag, per_step: int, episodes_per_group: int):
        self.lag, self.per_step, self.episodes_per_group = lag, per_step, episodes_per_group
        self.at_once: int | None = None  # groups the generators play at once, once they reported (``size``)
        self.admitted = 0  # groups started that filled a step or may still fill one
        self.running = 0
        self.newest: int | None = None  # the newest weights' version
        self.first: int | None = None  # the version the stream started with
        self.failed_in_a_row = 0  # groups whose every episode failed, since one did not

    def size(self, capacities: list[Capacity]) -> None:
        """The generators' reported capacity, one per target: the whole groups each target's places hold, and one
        more whose episodes take places as they are freed."""
        self.at_once = sum(c.episodes // self.episodes_per_group + 1 for c in capacities)

    def follow(self, version: int) -> None:
        """Groups start with ``version`` from now on (ignored when not newer)."""
        self.newest = version if self.newest is None else max(self.newest, version)
        self.first = version if self.first is None else self.first

    @property
    def admissible(self) -> int:
        return self.lag.admissible(self.newest - self.first, self.per_step) if self.newest is not None else 0

    def may_start(self) -> bool:
        """Whether one more group starts now."""
        return (
            self.at_once is not None
            and self.admitted < self.admissible
            and self.running < self.at_once
            and self.running + self.failed_in_a_row < self.failure_window
        )

    def started(self) -> None:
        self.admitted += 1
        self.running += 1

    def finished(self, failed: bool) -> None:
        """A group came back: one whose every episode failed gives its place back, but holds one of the failure
        window's until a group succeeds, so fast failures cannot cycle without end while slower groups run."""
        self.running -= 1
        if failed:
            self.admitted -= 1
            self.failed_in_a_row += 1
        else:
            self.failed_in_a_row = 0

    def stopped(self) -> None:
        """A running group was cancelled (a restart or the run's end): it neither filled a step nor will."""
        self.running -= 1
        self.admitted -= 1

    def dropped(self) -> None:
        """A finished group came back too old for any step: its place goes to a fresh one."""
        self.admitted -= 1

    @property
    def failure_window(self) -> int:
        """Groups failing in a row that stop the pool: a lag window of them, ``(L + 1) x P``."""
        return self.lag.admissible(0, self.per_step)

    @property
    def down(self) -> bool:
        """Every place's last group failed and none runs: the environment or the agent fails every episode."""
        return self.running == 0 and self.failed_in_a_row >= self.failure_window

    def restart(self) -> None:
        """Forget the stream (the trainer went back to its checkpoint): the next ``follow`` starts it again."""
        self.admitted = self.running = self.failed_in_a_row = 0
        self.newest = self.first = None

    def metrics(self) -> dict[str, float]:
        """``groups/admitted``, ``running``, ``waiting`` (the lag allows them, the generators have no place for them)
        and ``at_once``, as the step takes its groups."""
        waiting = max(0, self.admissible - self.admitted) if self.running >= (self.at_once or 0) else 0
        return {
            "groups/admitted": self.admitted,
            "groups/running": self.running,
            "groups/waiting": waiting,
            "groups/at_once": self.at_once or 0,
        }
