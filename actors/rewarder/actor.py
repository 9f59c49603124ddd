"""The Rewarder actor: the reward functions (``actors/rewarder/functions.py``) in an actor of their own.

Placed on the generator's mesh it is not spawned: each generator runs the same functions
on what it writes, in the same call.
"""

from __future__ import annotations

from monarch.actor import Actor, endpoint

from actors.basics.proc_info import ProcInfo, this_proc
from actors.rewarder.config import RewarderConfig
from actors.rewarder.functions import RewardFunctions, RewardReply
from actors.tasks import Problem, TaskConfig


class Rewarder(Actor):
    def __init__(self, task: TaskConfig, cfg: RewarderConfig):
        self.task_config, self.cfg = task, cfg  # built in ``start`` (actors/basics/proc_info.py)

    @endpoint
    def start(self) -> ProcInfo:
        self.functions = RewardFunctions(self.task_config, self.cfg)
        return this_proc()

    @endpoint
    def reward(self, problems: list[Problem], completions: list[str]) -> RewardReply:
        """Only problems and texts travel (not whole rollouts): the call sits on every step's critical path."""
        return self.functions.reward(problems, completions)
