"""A verifiers taskset through verifiers' own rollout (``actors/environments/verifiers_agent.py``): its harness program
runs as a subprocess of this interpreter, its model calls reach the run's endpoint on a tiny BPE model, the tokens
sampled are what the episode trains on, and the trace's rubric reward is the episode's."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is installed with the envs extra")

from actors.agents.endpoint import ChatServer  # noqa: E402
from actors.agents.task import Agents, AgentTask  # noqa: E402
from actors.generator.engines import Sampling, sampling_seeds  # noqa: E402
from actors.generator.engines.hf import HFEngine  # noqa: E402
from actors.models.facts import TinyModelSpec  # noqa: E402
from actors.models.tiny import build_tiny_model  # noqa: E402

BPE = TinyModelSpec(hidden_size=64, heads=4, kv_heads=2, max_positions=512, tokenizer="bpe")
ARITH = "actors.environments.examples.vf_arith:ArithTaskset"
AGENT = "actors.environments.verifiers_agent:VerifiersAgent"
TURNS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    model = build_tiny_model(tmp_path_factory.mktemp("bpe"), BPE, None, seed=0)
    return HFEngine(str(model), Sampling(max_new_tokens=8))


@pytest.fixture
async def server(engine):
    replies = []

    async def sample(ids, seed, greedy, request):
        replies.append(await engine.continue_from(ids, seed, greedy, request.max_tokens, None, request.stop,
                                                  request.top_logprobs))
        return replace(replies[-1], versions=[0] * len(replies[-1].completion_ids))

    server = ChatServer(engine.tokenizer, sample, positions=BPE.max_positions, sampling=engine.sampling)
    server.replies = replies
    await server.start()
    yield server
    await server.stop()


def arith_agents(**params) -> tuple[AgentTask, Agents]:
    task = AgentTask(AGENT, {"name": "verifiers", "taskset": ARITH, "config": {"count": 3}}, TURNS, 60.0, params)
    return task, Agents(task.episodes())


async def test_verifiers_rollout_goes_through_the_endpoint_and_its_reward_is_the_rubrics(server):
    task, agents = arith_agents(harness=None)  # YAML's `harness: null`: verifiers' null harness, a chat loop
    problem = task.problems(0, 0, 1)[0]
    async with server.episode(sampling_seeds(0, "v1", TURNS), False) as record:
        outcome = await agents.run(server.endpoint(record), problem)
    assert outcome.failure is None and isinstance(outcome.reward, float)
    assert 0.0 <= outcome.reward <= 1.1  # the rubric: correct (weight 1) + brief (weight 0.1)
    assert outcome.reward == pytest.approx(task.inner.reward(problem, record.last_reply))  # as scored offline
    assert record.turns >= 1 and record.tokens.split == 0
    (trajectory,) = record.trajectories()
    trained = [t for t, m in zip(trajectory.completion_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == [t for reply in server.replies for t in reply.completion_ids]


async def test_a_rollout_the_endpoint_refuses_fails_its_episode_with_the_endpoints_message(server):
    task, agents = arith_agents(harness=None)
    async with server.episode(sampling_seeds(0, "v2", TURNS), False) as record:
        endpoint = replace(server.endpoint(record), model="another-model")  # the run serves one model, not this one
        outcome = await agents.run(endpoint, task.problems(0, 0, 1)[0])
    assert outcome.reward is None and "upstream 404" in outcome.failure and "model_not_found" in outcome.failure


def test_only_verifiers_problems_and_harnesses_that_run_outside_a_container_are_taken():
    with pytest.raises(ValueError, match="installs its program into a container runtime"):
        arith_agents(harness="codex")
    with pytest.raises(ValueError, match="'bash' is refused: .* outside the python tool's sandbox"):
        arith_agents(harness="bash")
    with pytest.raises(TypeError, match="plays verifiers tasksets"):
        Agents(AgentTask(AGENT, {"name": "reverse"}).episodes())
