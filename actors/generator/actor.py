"""The Generator actor: samples G completions per prompt with exactly the weights it was told to use.

Weights arrive as a ``WeightVersion`` (a few bytes) naming a slot of the trainer's
shared-memory store; the tensors themselves never travel as endpoint arguments. A
request for a version the store no longer (or not yet) holds raises instead of
sampling with whatever is loaded, and the slot is checked again after sampling, so a
batch sampled while its weights were overwritten is refused too.

Given the task and the Rewarder's config (the Rewarder placed on the generator's mesh), a
generator also rewards what it writes, in the same call (``actors/rewarder/functions.py``).

Endpoints are concurrent, so an engine that batches continuously (``vllm``) sees every
request in flight at once. Requests naming the held version run together; one naming
another version waits until they finish, then the weights change (see ``VersionGate``). An agent's turn is
the exception that does not make an update wait: the update interrupts it at a token boundary, and it goes on
with the new weights, each token keeping the version that sampled it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from monarch.actor import Actor, concurrent_endpoint

from actors import registry
from actors.agents.chat_tokens import ChatTokens
from actors.agents.task import AGENTS_AT_ONCE, NO_DEMONSTRATION, Agents, AgentSpec
from actors.basics.compute import Compute
from actors.basics.proc_info import ProcInfo, this_proc
from actors.contract.rollouts import EpisodeOutcome, ReplyRequest, Reward, Trajectory
from actors.environments import Environments
from actors.environments.episode import run_episode
from actors.environments.openenv_task import EpisodeSpec, OpenEnvConfig, episode_seed
from actors.environments.token_policy import TokenPolicy
from actors.generator.capacity import Capacity
from actors.generator.config import GeneratorConfig
from actors.generator.engines import piece_seed, sampling_seeds
from actors.generator.gate import VersionGate
from actors.generator.request import PlayRequest, SampleRequest
from actors.models.chat import render
from actors.models.lora_config import LoRAConfig
from actors.models.source import check_before_loading
from actors.rewarder.config import RewarderConfig
from actors.rewarder.functions import RewardFunctions, RewardReply
from actors.tasks import Problem, TaskConfig
from actors.weights.follower import WeightFollower
from actors.weights.record import WeightVersion


@dataclass
class Generation:
    """Trajectories in prompt order, ``per_prompt`` of each, as columns.

    A few large lists pickle several times faster than one object per trajectory, and this
    reply sits on every step's critical path; ``trajectories`` rebuilds the objects on arrival.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    loss_masks: list[list[bool]]
    texts: list[str]
    token_versions: list[list[int] | None]  # per trajectory, its ``versions``
    per_prompt: int
    version: int
    seconds: float  # the whole endpoint, weight load included
    load_seconds: float  # of which adopting a new weight version (0 when already held)
    outcomes: list[EpisodeOutcome] | None = None  # per trajectory, when they are environment episodes
    rewards: RewardReply | None = None  # per trajectory, when this generator rewards what it writes

    @classmethod
    def of(
        cls,
        rows: list[Trajectory],
        per_prompt: int,
        version: int,
        seconds: float,
        load_seconds: float,
        outcomes: list[EpisodeOutcome] | None = None,
        rewards: RewardReply | None = None,
    ):
        _check_rows(rows, outcomes)
        columns = ("prompt_ids", "completion_ids", "logprobs", "loss_mask", "text", "versions")
        columns = [[getattr(t, c) for t in rows] for c in columns]
        return cls(*columns, per_prompt, version, seconds, load_seconds, outcomes, rewards)

    def trajectories(self) -> list[list[Trajectory]]:
        """Per prompt, its ``per_prompt`` trajectories."""
        columns = (self.prompt_ids, self.completion_ids, self.logprobs, self.loss_masks, self.texts, self.token_versions)
        rows = list(map(Trajectory, *columns))
        return self._per_prompt(rows)

    def episode_outcomes(self) -> list[list[EpisodeOutcome]]:
        """Per prompt, how each of its episodes ended (empty when these are no episodes)."""
        return self._per_prompt(self.outcomes or [])

    def row_rewards(self) -> list[list[Reward]]:
        """Per prompt, each trajectory's reward (empty when this generator does not reward)."""
        return self._per_prompt(self.rewards.rewards() if self.rewards else [])

    @property
    def reward_seconds(self) -> float:
        return self.rewards.seconds if self.rewards else 0.0

    def _per_prompt(self, rows: list) -> list[list]:
        return [rows[i : i + self.per_prompt] for i in range(0, len(rows), self.per_prompt)]


class Generator(Actor):
    def __init__(
        self,
        model_path: str,
        cfg: GeneratorConfig,
        compute: Compute,
        task: TaskConfig | None = None,
        rewarder: RewarderConfig | None = None,
        *,
        adapter: LoRAConfig | None = None,
    ):
        """``task`` and ``rewarder``: given when the Rewarder is placed on this generator's mesh. ``adapter``: the
        trainer's LoRA config, when it trains adapters: the engine then holds the base once and each version
        it loads is the adapters' tensors only."""
        self.model_path, self.cfg, self.compute = model_path, cfg, compute  # built in ``start`` (actors/basics/proc_info.py)
        self.adapter = adapter
        self.reward_setup = (task, rewarder) if rewarder is not None else None
        self.reward_functions: RewardFunctions | None = None
        self.weights = WeightFollower()
        self.gate = VersionGate()
        self._clients: dict[OpenEnvConfig, Environments] = {}  # environment clients, by the environment they play
        self._agent_code: Agents | None = None  # an agent task's code and endpoint (``_agents``), made once
        self._server = None
        self._starting_agents = asyncio.Lock()
        self._newest: WeightVersion | None = None  # the newest version requested or pushed: agents' turns use it

    @concurrent_endpoint
    async def start(self) -> ProcInfo:
        """Load the engine; its errors (a bad model, an engine the model cannot run on) reach the caller whole."""
        from transformers import AutoTokenizer

        torch.set_num_threads(self.compute.threads)
        check_before_loading(self.model_path)  # here, so a restarted generator checks the cache again
        self.engine = registry.load("engine", self.cfg.engine)(
            self.model_path, self.cfg.sampling, self.compute, self.adapter
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)  # the policy's chat template renders prompts
        if self.reward_setup is not None:
            self.reward_functions = RewardFunctions(*self.reward_setup)
        return this_proc()

    async def __cleanup__(self, exc: Exception | None) -> None:
        """Close the engine while the process's other actors still run (the run stops a trainer beside this
        generator after it: ``mesh/runtime/run.py``), and end the agent host with every episode it runs."""
        if (close := getattr(getattr(self, "engine", None), "close", None)) is not None:
            close()
        if self._agent_code is not None:
            await self._agent_code.close()

    def _rewards(self, problems: list[Problem], rows: list[Trajectory], per_prompt: int) -> RewardReply | None:
        """The rewards of ``rows`` (``per_prompt`` of each problem), when this generator rewards.

        Computed right here, on the actor's event loop: a thread's hand-off would cost more than a
        verifier's string checks, which is what a Rewarder belongs beside the generator for (reward
        functions that take long, a judge model or a sandbox, belong on a mesh of their own).
        """
        if self.reward_functions is None:
            return None
        repeated = [problem for problem in problems for _ in range(per_prompt)]
        return self.reward_functions.reward(repeated, [t.text for t in rows])

    def _prompts(self, problems: list[Problem], hints: list[str | None] | None = None) -> list[str]:
        hints = hints or [None] * len(problems)
        return [render(self.tokenizer, p.prompt, p.system_prompt, hint) for p, hint in zip(problems, hints)]

    def _switch(self, weights: WeightVersion) -> float:
        return self.weights.hold(weights, self.engine.load_weights)

    @concurrent_endpoint
    async def generate(self, request: SampleRequest) -> Generation:
        """The samples ``request`` asks for, rewarded here when the rewarder runs in this process."""
        start, weights = time.perf_counter(), request.weights
        prompts = self._prompts(request.problems, request.hints)
        async with self.gate.use(weights, self._switch) as load_seconds:
            groups = await self.engine.generate(prompts, request.group_size, request.seeds, request.greedy)
            await asyncio.to_thread(self.weights.check_intact, weights)  # may wait for the byte check
        rows = [t for group in groups for t in group]
        rewards = self._rewards(request.problems, rows, request.group_size)
        seconds = time.perf_counter() - start
        return Generation.of(rows, request.group_size, weights.version, seconds, load_seconds, rewards=rewards)

    @concurrent_endpoint
    async def play(self, request: PlayRequest) -> Generation:
        """The episodes ``request`` asks for, all played at once: against its environment seed (the environment
        bounds how many hold a session), or by the agent through this process's endpoint. Each is one trajectory
        with the environment's (or the agent's) tokens masked out of the loss; its seed fixes each episode's
        sampling, turn by turn (with ``spec.greedy`` every turn is the argmax continuation instead)."""
        start, spec = time.perf_counter(), request.spec
        self._follow(request.weights)  # every turn takes the gate, with the newest weights (``_turn``)
        if isinstance(spec, AgentSpec):
            one = functools.partial(self._act_one, await self._agents(spec), spec)
        else:
            one = functools.partial(self._play_one, self._environments(spec), spec)
        trajectories, outcomes = zip(*await self._played(one, request))
        seconds = time.perf_counter() - start
        version = request.weights.version
        return Generation.of(list(trajectories), request.group_size, version, seconds, 0.0, list(outcomes))

    async def _play_one(
        self, environments: Environments, spec: EpisodeSpec, problem: Problem, seed: int, j: int
    ) -> tuple[Trajectory, EpisodeOutcome]:
        """One episode against its environment, its turns sampled as an agent's are (``_turn``: the newest
        weights, a weight update going on inside a turn), stitched by the one stitcher."""
        turn_seeds = sampling_seeds(seed, f"episode {j}", spec.max_turns)

        async def sample(ids: list[int], turn: int) -> Trajectory:
            return await self._turn(ids, turn_seeds[turn], spec.greedy, ReplyRequest())

        policy = TokenPolicy(ChatTokens(self.tokenizer), sample)
        episode = await run_episode(
            environments,
            policy,
            episode_id=f"{seed}-{j}",
            seed=episode_seed(problem),
            max_turns=spec.max_turns,
            system_prompt=spec.system_prompt,
        )
        first, split = policy.trajectory(), policy.split
        failure = episode.failure or Trajectory.untrainable([first, *split])
        updated, in_turn = _versions_of([first, *split])
        return first, EpisodeOutcome(episode.reward, episode.turns, episode.done, failure, split, updated, in_turn)

    @staticmethod
    async def _played(one: Callable, request: PlayRequest) -> list:
        return await asyncio.gather(
            *(
                one(problem, seed, j)
                for problem, seed in zip(request.problems, request.seeds)
                for j in range(request.group_size)
            )
        )

    async def _act_one(
        self, agents: Agents, spec: AgentSpec, problem: Problem, seed: int, j: int
    ) -> tuple[Trajectory, EpisodeOutcome]:
        """One run of the agent on ``problem``, its turns sampled through this process's endpoint with seeds of
        (``seed``, ``j``), recorded as the tokens sampled (``actors/agents/chat_tokens.py``)."""
        turn_seeds = sampling_seeds(seed, f"episode {j}", spec.max_turns)
        replies = None
        if spec.demonstrating:
            try:
                replies = agents.demonstration(problem)
            except Exception as error:  # the user's demonstration code: it fails this demonstration only
                return _unplayed(f"task.demonstration raised {type(error).__name__}: {error}")
            if replies is None:
                return _unplayed(NO_DEMONSTRATION)
        async with agents.place(), self._server.episode(turn_seeds, spec.greedy, replies) as record:
            outcome = await agents.run(self._server.endpoint(record), problem)
        failure = record.redact(record.failure or outcome.failure) or record.problem()
        rows = record.trajectories()
        reward = 0.0
        if failure is None:
            reward = outcome.reward if outcome.reward is not None else agents.score(problem, record.last_reply)
        else:
            rows = [Trajectory([], [], [], [], "")]  # a failed episode never trains: nothing of it travels
        first, *split = rows
        updated, in_turn = _versions_of(rows)
        return first, EpisodeOutcome(reward, record.turns, failure is None, failure, tuple(split), updated, in_turn)

    async def _turn(self, ids: list[int], seed: int, greedy: bool, request: ReplyRequest) -> Trajectory:
        """One turn of an agent's episode, sampled with the newest weights this process knows, within what its
        ``request`` asks (the engine stops at its ``max_tokens`` and ``stop`` strings). A weight update
        interrupts it at a token boundary and it goes on with the new weights from its tokens so far; each token
        keeps the version that sampled it. The sampling runs to its end even when its request is abandoned,
        holding the weights it uses until then: no weight change may reach the engine under a request it still
        runs."""
        return await asyncio.shield(asyncio.ensure_future(self._pieces(ids, seed, greedy, request)))

    async def _pieces(self, ids: list[int], seed: int, greedy: bool, request: ReplyRequest) -> Trajectory:
        limit = min(request.max_tokens or self.cfg.max_new_tokens, self.cfg.max_new_tokens)
        eos = self.tokenizer.eos_token_id
        tokens, logprobs, versions, top = [], [], [], []
        for piece in itertools.count():
            await self.gate.settled()
            weights, interrupt = self._newest, threading.Event()
            async with self.gate.use(weights, self._switch, interrupt):
                sampled = await self.engine.continue_from(
                    ids + tokens, piece_seed(seed, piece), greedy, limit - len(tokens), interrupt, request.stop,
                    request.top_logprobs,
                )
                await asyncio.to_thread(self.weights.check_intact, weights)  # may wait for the byte check
            tokens += sampled.completion_ids
            logprobs += sampled.logprobs
            versions += [weights.version] * len(sampled.completion_ids)
            top += sampled.top_logprobs or []
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            ended = len(tokens) >= limit or (tokens and tokens[-1] == eos) or any(s in text for s in request.stop)
            if not interrupt.is_set() or ended:  # a stop string may end where a piece did: the joined text says
                break
        reply = replace(Trajectory.single_turn(ids, tokens, logprobs, text), versions=versions)
        return replace(reply, top_logprobs=top) if request.top_logprobs else reply

    async def _demonstrated_turn(self, ids: list[int], reply_ids: list[int]) -> Trajectory:
        """A demonstration's turn: its reply, with the newest weights' logprobs, as ``_turn`` samples one."""
        return await asyncio.shield(asyncio.ensure_future(self._scored(ids, reply_ids)))

    async def _scored(self, ids: list[int], reply_ids: list[int]) -> Trajectory:
        await self.gate.settled()
        weights = self._newest
        async with self.gate.use(weights, self._switch):
            reply = await self.engine.score(ids, reply_ids)
            await asyncio.to_thread(self.weights.check_intact, weights)  # may wait for the byte check
        return replace(reply, versions=[weights.version] * len(reply.completion_ids))

    def _follow(self, weights: WeightVersion) -> None:
        """Agents' turns use ``weights`` from now on, unless a newer version of its store is known already. A
        version of another store is a restarted trainer's, newer whatever its number (it went back to its
        checkpoint's), and the lost trainer's store is gone."""
        newest = self._newest
        if newest is None or weights.store != newest.store or weights.version > newest.version:
            self._newest = weights

    async def _agents(self, spec: AgentSpec) -> Agents:
        """The agent code, loaded once, and this process's endpoint, started once (concurrent requests wait for it)."""
        async with self._starting_agents:
            if self._agent_code is None:
                from transformers import AutoConfig

                from actors.agents.endpoint import ChatServer

                positions = AutoConfig.from_pretrained(self.model_path).max_position_embeddings
                server = ChatServer(
                    self.tokenizer, self._turn, positions, self.cfg.sampling, self._demonstrated_turn
                )
                await server.start()
                self._server, self._agent_code = server, Agents(spec)
        return self._agent_code

    @concurrent_endpoint
    async def capacity(self, spec: EpisodeSpec | AgentSpec) -> Capacity:
        """How many of ``spec``'s episodes this process plays at once: its agent host's places, or its share of the
        environment's sessions (``spec`` is its share). The controller's admission sizes what it starts to it
        (``mesh/controller/admission.py``): the places' whole groups and one more, whose episodes wait for places as
        they free with nothing open."""
        if isinstance(spec, AgentSpec):
            return Capacity(AGENTS_AT_ONCE, "agent places")
        return Capacity(spec.environment.max_concurrent, "environment sessions")

    @concurrent_endpoint
    async def agent_guarantees(self, spec: AgentSpec) -> str:
        """What holds for this process's agents (``actors/agents/guests.py``), as its agent host says: the run
        says it at its start."""
        return await (await self._agents(spec)).guarantees()

    def _environments(self, spec: EpisodeSpec) -> Environments:
        """One client per environment, kept across calls: it holds the session limit."""
        if spec.environment not in self._clients:
            from actors.environments.openenv import OpenEnv

            self._clients[spec.environment] = OpenEnv(spec.environment)
        return self._clients[spec.environment]

    @concurrent_endpoint
    async def logprobs_of(self, problems: list[Problem], texts: list[str], weights: WeightVersion) -> Generation:
        """Completions this policy did not sample (teacher traces), with this version's logprobs (and
        their rewards, when this generator rewards)."""
        start = time.perf_counter()
        async with self.gate.use(weights, self._switch) as load_seconds:
            traces = await self.engine.logprobs_of(self._prompts(problems), texts)
            await asyncio.to_thread(self.weights.check_intact, weights)  # may wait for the byte check
        rewards = self._rewards(problems, traces, 1)
        return Generation.of(traces, 1, weights.version, time.perf_counter() - start, load_seconds, rewards=rewards)

    @concurrent_endpoint
    async def hold(self, weights: WeightVersion) -> float:
        """Adopt ``weights`` once the requests in flight finish (the trainer's push of a new
        version, so a generator is ready before its next request); the seconds it took."""
        async with self.gate.use(weights, self._switch) as load_seconds:
            self._follow(weights)  # once adopted: never a lost trainer's version, whose store is gone
            return load_seconds

    @concurrent_endpoint
    async def held_version(self) -> int | None:
        return None if self.gate.held is None else self.gate.held.version


def _check_rows(rows: list[Trajectory], outcomes: list[EpisodeOutcome] | None) -> None:
    """Every row this generator sends can train, but a failed episode's (never trained): a row that cannot is this
    process's defect, named here rather than in the trainer."""
    for number, row in enumerate(rows):
        failed = outcomes is not None and outcomes[number].failure is not None
        if not failed and (defect := row.defect()) is not None:
            raise ValueError(f"the generator made row {number}, which cannot train: {defect}")


def _versions_of(rows: list[Trajectory]) -> tuple[int, int]:
    """Of an episode's sampled tokens, those a newer version than its oldest sampled (it went on with newer weights),
    and those sampled after a weight update interrupted their turn."""
    versions = [version for row in rows for version in row.sampled_versions()]
    oldest = min(versions, default=None)
    return sum(version != oldest for version in versions), sum(sum(row.after_update()) for row in rows)


def _unplayed(failure: str) -> tuple[Trajectory, EpisodeOutcome]:
    """An episode that never started, and why."""
    return Trajectory([], [], [], [], ""), EpisodeOutcome(0.0, 0, False, failure)
