"""The multi-turn episode loop in text: the policy replies, the environment answers, until done.

The policy is any ``async (messages) -> str``: the messages are the chat so far in the
``{"role", "content"}`` form chat templates read, and the reply is the model's next
action. This keeps the loop free of tokens, so it runs against a scripted policy in
tests and against the generator in a run; the generator's version keeps the token ids
of each turn instead of re-tokenizing the text (see the package docstring).

An episode's reward is the **sum of its step rewards** (the undiscounted return), the
convention of OpenEnv's per-step rewards and of verifiers' OpenEnv taskset: an
environment that rewards only the end gets that reward, one that shapes along the
way gets the total. An environment failure ends its episode with ``failure`` set
(the reward of such an episode means nothing and it should not train); the policy's
own exceptions propagate, since they are the run's problem, not the environment's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.environments import Environments, EpisodeError

Policy = Callable[[list[dict[str, str]]], Awaitable[str]]


@dataclass
class Episode:
    """One episode's record. ``transcript`` holds every message in order, ``(role, text)``:
    the system prompt if any, then the observations (``observation_role``) and the policy's
    replies (``assistant``), the final observation included. ``step_rewards`` has one entry per
    step the environment answered; ``turns`` counts the policy's replies."""

    episode_id: str
    environment: str
    transcript: list[tuple[str, str]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    done: bool = False  # the environment ended it (else the turn limit, or a failure, did)
    failure: str | None = None

    @property
    def reward(self) -> float:
        return sum(self.step_rewards, 0.0)

    @property
    def turns(self) -> int:
        return sum(role == "assistant" for role, _ in self.transcript)

    @property
    def truncated(self) -> bool:
        """Cut by the turn limit: not ended by the environment, and no failure."""
        return not self.done and self.failure is None

    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.transcript]


async def run_episode(
    environments: Environments,
    policy: Policy,
    *,
    episode_id: str,
    seed: int,
    max_turns: int,
    system_prompt: str | None = None,
    observation_role: str = "user",
) -> Episode:
    """Play one episode in its own session: reset with ``seed``, then up to ``max_turns`` replies."""
    episode = Episode(episode_id, environments.name)
    if system_prompt:
        episode.transcript.append(("system", system_prompt))
    try:
        async with environments.episode(episode_id) as env:
            turn = await env.reset(seed)
            episode.transcript.append((observation_role, turn.observation))
            while not turn.done and episode.turns < max_turns:
                action = await policy(episode.messages())
                episode.transcript.append(("assistant", action))
                turn = await env.step(action)
                episode.step_rewards.append(turn.reward)
                episode.transcript.append((observation_role, turn.observation))
            episode.done = turn.done
    except EpisodeError as error:
        episode.failure = str(error)
    return episode


async def run_episodes(
    environments: Environments, policy: Policy, seeds: list[int], *, max_turns: int, name: str = "episode", **options
) -> list[Episode]:
    """One episode per seed, all started at once (``environments`` bounds how many hold a session),
    ids ``{name}-{i}``, in seed order; ``options`` go to ``run_episode``."""
    return await asyncio.gather(
        *(
            run_episode(environments, policy, episode_id=f"{name}-{i}", seed=seed, max_turns=max_turns, **options)
            for i, seed in enumerate(seeds)
        )
    )
