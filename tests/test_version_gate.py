"""The Generator's VersionGate: concurrent requests share a weight version; a change waits for them, and
interrupts an agent's running turns, which go on with the new weights.

Plain asyncio, no actors: the gate is the ordering rule the concurrent endpoints rely on
(the actor-level behaviour, with real weights, is in test_actors and test_router).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from actors.basics.compute import Compute
from actors.contract.rollouts import ReplyRequest
from actors.environments import Turn
from actors.environments.openenv_task import EpisodeSpec, OpenEnvConfig
from actors.generator.actor import Generator
from actors.generator.config import GeneratorConfig
from actors.generator.engines.hf import HFEngine
from actors.generator.gate import VersionGate
from actors.models.facts import TinyModelSpec
from actors.models.tiny import build_tiny_model
from actors.tasks import Problem
from actors.weights.record import WeightVersion

V0, V1 = (WeightVersion(v, checksum=v, nbytes=8, store="/store") for v in (0, 1))


async def test_requests_for_the_held_version_overlap_and_a_new_version_waits_for_them():
    gate, events, switches = VersionGate(), [], []

    def switch(weights: WeightVersion) -> float:
        switches.append(weights.version)
        return 0.25

    async def request(name: str, weights: WeightVersion, seconds: float) -> float:
        async with gate.use(weights, switch) as load_seconds:
            events.append(f"{name} start")
            await asyncio.sleep(seconds)
            events.append(f"{name} end")
        return load_seconds

    first = asyncio.create_task(request("a", V0, 0.05))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(request("b", V0, 0.05))
    await asyncio.sleep(0.01)
    newer = asyncio.create_task(request("c", V1, 0.01))
    await asyncio.sleep(0.01)
    late = asyncio.create_task(request("d", V0, 0.01))  # arrives after the switch was asked for: queues behind it
    loads = await asyncio.gather(first, second, newer, late)

    assert events.index("b start") < events.index("a end")  # same version: concurrent
    assert events.index("c start") > max(events.index("a end"), events.index("b end"))  # no sampling across a change
    assert events.index("d start") > events.index("c end")
    assert switches == [0, 1, 0] and loads == [0.25, 0.0, 0.25, 0.25]
    assert gate.held == V0


async def test_a_failed_switch_holds_nothing_and_lets_the_next_request_try():
    gate = VersionGate()

    def broken(weights: WeightVersion) -> float:
        raise RuntimeError("store gone")

    with pytest.raises(RuntimeError, match="store gone"):
        async with gate.use(V1, broken):
            pass
    assert gate.held is None
    async with gate.use(V0, lambda weights: 0.0):
        assert gate.held == V0


async def test_a_request_for_another_version_interrupts_the_running_turns_that_may_stop_early():
    """An agent's turn passes an interrupt: a request for a new version sets it at once, so the switch waits for
    the turn's next token boundary (here: the turn ends when told), not for its end."""
    gate = VersionGate()
    running = threading.Event()

    async def turn(interrupt: threading.Event) -> None:
        async with gate.use(V0, lambda weights: 0.0, interrupt):
            await asyncio.to_thread(interrupt.wait, 5.0)  # sampling, until interrupted

    async def update() -> None:
        async with gate.use(V1, lambda weights: 0.0):
            pass

    first = asyncio.create_task(turn(running))
    await asyncio.sleep(0.01)
    assert not running.is_set()
    await asyncio.wait_for(asyncio.gather(first, update()), 2.0)  # the turn would wait 5 s uninterrupted
    assert running.is_set() and gate.held == V1


async def test_a_turn_that_enters_while_a_switch_waits_behind_it_is_told_at_once():
    """A turn queued ahead of an update enters first, but with its interrupt already set: the update waits for one
    token of it, not its whole turn."""
    gate, told = VersionGate(), threading.Event()

    async def turn() -> bool:
        async with gate.use(V0, lambda weights: 0.0, told):
            return told.is_set()

    async def update() -> None:
        async with gate.use(V1, lambda weights: 0.0):
            pass

    async with gate.use(V1, lambda weights: 0.0):  # V1 held and in use: the turn for V0 waits
        entering = asyncio.create_task(turn())
        await asyncio.sleep(0.01)
        updating = asyncio.create_task(update())  # queued behind the turn
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(entering, 1.0)
    await asyncio.wait_for(updating, 1.0)
    assert gate.held == V1


async def test_settled_waits_for_a_pending_switch():
    """A turn about to pick the newest version first lets a queued update land, so it picks the new one."""
    gate, order = VersionGate(), []

    async def update() -> None:
        async with gate.use(V1, lambda weights: 0.0):
            order.append("switched")

    async def settle() -> None:
        await gate.settled()
        order.append(f"settled with v{gate.held.version}")

    async with gate.use(V0, lambda weights: 0.0):
        tasks = asyncio.gather(update(), settle())
        await asyncio.sleep(0.01)
        assert order == []
    await tasks
    assert order == ["switched", "settled with v1"]


def two_version_generator(tmp_path) -> tuple[Generator, HFEngine]:
    """A Generator with a real hf engine, outside an actor, whose versions 0 and 1 are two state dicts: the weight
    store is left out (its versions' checks are test_weights'), a switch loads the version straight into the
    engine."""
    path = build_tiny_model(tmp_path, TinyModelSpec(), "abcdef=", seed=0)
    generator = Generator(str(path), GeneratorConfig(mesh="generators", max_new_tokens=6), Compute())
    engine = generator.engine = HFEngine(str(path), generator.cfg.sampling)
    generator.tokenizer = engine.tokenizer
    torch.manual_seed(0)
    states = {0: {k: v.clone() for k, v in engine.model.state_dict().items()}}
    states[1] = {k: v + 0.3 * torch.randn_like(v) for k, v in states[0].items()}
    generator._switch = lambda weights: engine.load_weights(states[weights.version]) or 0.0
    generator.weights.check_intact = lambda weights: None
    return generator, engine


async def updated_at_the_third_token(generator: Generator, engine: HFEngine, turn: asyncio.Task):
    """``turn`` (running on ``generator``, from V0) paused in the forward pass that samples its third token while
    version 1 arrives (``Generator.hold``'s body, without the actor runtime), then let go; what ``turn`` returns."""
    reached, proceed, calls = threading.Event(), threading.Event(), []

    def third_token_waits(module, args):
        calls.append(1)
        if len(calls) == 3:
            reached.set()
            proceed.wait(10.0)

    async def hold(weights: WeightVersion) -> None:
        async with generator.gate.use(weights, generator._switch):
            generator._follow(weights)

    hook = engine.model.register_forward_pre_hook(third_token_waits)
    try:
        await asyncio.to_thread(reached.wait, 10.0)
        update = asyncio.create_task(hold(V1))
        await asyncio.sleep(0.05)  # the update queues behind the turn and interrupts it
        proceed.set()
        done = await asyncio.wait_for(turn, 30.0)
        await update
    finally:
        hook.remove()
    return done


async def test_an_agent_turn_interrupted_by_a_weight_update_goes_on_with_the_new_weights(tmp_path):
    """A Generator's agent turn: an update arriving mid-turn stops it at a token boundary, the new weights load, and
    the turn goes on from its tokens with them; each token keeps the version that sampled it."""
    generator, engine = two_version_generator(tmp_path)
    for text in ("abc=", "fedcba=", "e=", "ab", "ddd"):  # one whose continuation goes past the interrupt
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        whole = await engine.continue_from(ids, 0, greedy=True)
        if len(whole.completion_ids) >= 4:
            break
    assert len(whole.completion_ids) >= 4

    generator._follow(V0)
    turn = asyncio.create_task(generator._turn(ids, 0, True, ReplyRequest()))
    reply = await updated_at_the_third_token(generator, engine, turn)

    n = len(reply.completion_ids)
    assert reply.completion_ids[:3] == whole.completion_ids[:3] and reply.versions == [0] * 3 + [1] * (n - 3)
    rest = await engine.continue_from(ids + whole.completion_ids[:3], 0, greedy=True, max_new_tokens=3)  # V1's
    assert reply.completion_ids[3:] == rest.completion_ids and n > 3
    assert reply.after_update() == [False] * 3 + [True] * (n - 3)
    assert len(reply.logprobs) == n and generator.gate.held == V1


class OneReply:
    """An environment whose episodes take one reply: ``observation`` opens each, any reply ends it, rewarded 1."""

    name = "one reply"

    def __init__(self, observation: str):
        self.observation = observation

    @contextlib.asynccontextmanager
    async def episode(self, episode_id: str):
        yield self

    async def reset(self, seed: int) -> Turn:
        return Turn(self.observation, 0.0, False)

    async def step(self, action: str) -> Turn:
        return Turn("", 1.0, True)


async def test_an_environment_episode_turn_is_interrupted_by_a_weight_update_as_an_agents_is(tmp_path):
    """An OpenEnv episode's turns take the agent's path (one multi-turn driver): a weight update arriving inside a
    turn interrupts it, the turn goes on with the new weights, and the episode counts its tokens sampled after it."""
    generator, engine = two_version_generator(tmp_path)
    spec = EpisodeSpec(OpenEnvConfig("http://127.0.0.1:1"), max_turns=1, greedy=True)
    problem = lambda text: Problem(text, "a", data='{"seed": 3}')  # noqa: E731  (an OpenEnv task's: its seed)
    for text in ("abc=", "fedcba=", "e=", "ab", "ddd"):  # an opening whose reply goes past the interrupt
        generator._follow(V0)
        trajectory, _ = await generator._play_one(OneReply(text), spec, problem(text), 0, 0)
        if len(trajectory.completion_ids) >= 4:
            break
    assert len(trajectory.completion_ids) >= 4

    episode = asyncio.create_task(generator._play_one(OneReply(text), spec, problem(text), 0, 0))
    played, outcome = await updated_at_the_third_token(generator, engine, episode)
    n = len(played.completion_ids)
    assert played.versions == [0] * 3 + [1] * (n - 3) and played.completion_ids[:3] == trajectory.completion_ids[:3]
    assert outcome.failure is None and outcome.reward == 1.0
    assert outcome.updated_in_turn == n - 3 > 0 and outcome.updated_tokens == n - 3
