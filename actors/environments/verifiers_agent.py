"""verifiers' own rollout of a taskset, its model calls served by the run: a verifiers environment trains the way
PRIME-RL trains it, through the harness program the environment is written for, not a re-implementation of it.

Used as ``task: {agent: actors.environments.verifiers_agent:VerifiersAgent, problems: {name: verifiers,
taskset: ..., config: {...}}, params: {harness: null}}``. Each episode rebuilds its problem's verifiers task from
the problem's data (``VerifiersTask.task_of``) and runs ``vf.make_agent(config).run(task)``: the harness program
talks to verifiers' interception server, which records each turn on the trace and relays it to the episode's
endpoint (the config's client is ``endpoint.base_url``, whose path names the episode, and ``endpoint.model``; the
episode's own key goes through a variable of its own, ``MESH_ENDPOINT_API_KEY_<random>``, as verifiers reads keys).
The endpoint records the tokens the model sampled, which train; the finished trace's rubric reward (verifiers'
weighted sum, ``trace.reward``) is the episode's reward. A rollout that ends in an error (the endpoint refused a request, the
harness program failed) fails its episode, with verifiers' errors as its cause.

The harness program runs on the generator's host. verifiers would prepare it with ``uv`` (``pip install uv`` when
missing, then ``uv sync --script`` of the program's declared dependencies from PyPI, again in each new process,
since nothing is locked), so a generator without network could not run it. Here it runs in verifiers' subprocess
runtime with the generator's own interpreter, once that interpreter is checked to have the packages the program
declares (its PEP 723 block). The one harness taken is ``null`` (a chat loop, no tools), verifiers' chat program,
which declares only verifiers' own dependencies. ``bash`` is refused: its shell and edit tools would run
model-written commands as programs of the agent's process, on the generator's host, with its network and every file
it can read, outside the python tool's sandbox. The other harnesses install third-party programs into a container
and are refused too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import shlex
import sys
import tomllib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import verifiers.v1 as vf
from packaging.requirements import Requirement
from verifiers.v1.clients import EvalClientConfig
from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime
from verifiers.v1.utils.loaders import harness_class

from actors.agents.endpoint import Endpoint
from actors.environments.verifiers import VerifiersTask
from actors.tasks import Problem, Task

KEY_VARIABLE = "MESH_ENDPOINT_API_KEY"  # verifiers' subprocess runtime keeps names with API_KEY from its programs
SCRIPT_METADATA = re.compile(r"^# /// script\s*$\n(?P<body>(?:^#(?:| .*)$\n)+)^# ///\s*$", re.MULTILINE)


class VerifiersAgent:
    """Each episode: verifiers' rollout of the problem's task with ``harness`` (``null``), its reward."""

    def __init__(self, problems: Task, harness: str | None = "null"):
        harness = "null" if harness is None else harness  # YAML reads `harness: null` as None
        if not isinstance(problems, VerifiersTask):
            raise TypeError(
                f"VerifiersAgent plays verifiers tasksets, but the task's problems are a {type(problems).__name__}; "
                "set problems: {name: verifiers, taskset: ..., config: {...}}"
            )
        if harness == "bash":
            raise ValueError(
                "verifiers harness 'bash' is refused: its shell and edit tools run model-written commands as programs "
                "of the agent's process, on the generator's host, with the network and every file that process can "
                "read, outside the python tool's sandbox (actors/sandbox/tool.py), which offers a Python "
                "interpreter only. Use harness: null (a chat loop), or give the agent a python tool "
                "(actors/agents/examples/tool_agents.py)"
            )
        if harness_class(harness).NEEDS_CONTAINER:
            raise ValueError(
                f"verifiers harness {harness!r} installs its program into a container runtime, and the generator runs "
                "harness programs as its own subprocesses; use harness: null (a chat loop)"
            )
        self.problems, self.harness = problems, harness

    async def __call__(self, endpoint: Endpoint, problem: Problem) -> float:
        variable = f"{KEY_VARIABLE}_{uuid.uuid4().hex}"  # each episode has a key of its own: a variable of its own
        os.environ[variable] = endpoint.api_key
        try:
            agent = vf.make_agent(self._config(endpoint, variable))
            async with _host_runtime() as runtime:
                trace = await agent.run(self.problems.task_of(problem), runtime=runtime)
        finally:
            del os.environ[variable]
        if not trace.ok:
            errors = "; ".join(f"{error.type}: {error.message}" for error in trace.errors) or "no error recorded"
            raise RuntimeError(
                f"verifiers' rollout with the {self.harness} harness stopped ({trace.stop_condition}): {errors}. An "
                "'upstream' error is the run's endpoint refusing a request (its message says what to send instead); "
                "a HarnessError is the harness program failing (its output is quoted)"
            )
        return float(trace.reward)

    def _config(self, endpoint: Endpoint, key_variable: str) -> vf.AgentConfig:
        client = EvalClientConfig(base_url=endpoint.base_url, api_key_var=key_variable)
        return vf.AgentConfig(
            harness={"id": self.harness}, runtime=SubprocessConfig(), model=endpoint.model, client=client
        )


class HostRuntime(SubprocessRuntime):
    """verifiers' subprocess runtime whose harness programs run with this interpreter: no ``uv``, no downloads."""

    async def prepare_uv_script(
        self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True
    ) -> list[str]:
        return [sys.executable, _program(script.decode() if isinstance(script, bytes) else script)]


@asynccontextmanager
async def _host_runtime() -> AsyncIterator[HostRuntime]:
    """A runtime for one rollout (its working directory), torn down after it."""
    runtime = HostRuntime(SubprocessConfig())
    try:
        await runtime.start()
        yield runtime
    finally:
        await runtime.stop()


@functools.cache
def _program(script: str) -> str:
    """The path of a harness program, written once per process where verifiers keeps them, after checking that this
    interpreter has the packages the program declares."""
    missing = _missing(script)
    if missing:
        raise RuntimeError(
            f"the harness program needs {', '.join(missing)}, which this Python environment lacks or has at another "
            "version: the generator runs verifiers' harness programs with its own interpreter (no uv, no downloads); "
            f"install them in the generator's environment (pip install {' '.join(map(shlex.quote, missing))})"
        )
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(script.encode()).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    staged.write_text(script)
    staged.replace(path)  # atomic: a concurrent reader sees the whole program
    return str(path)


def _missing(script: str) -> list[str]:
    """The dependencies in the script's PEP 723 block that this interpreter does not have installed as required."""
    block = SCRIPT_METADATA.search(script)
    metadata = tomllib.loads("\n".join(line[2:] for line in block["body"].splitlines()) if block else "")
    missing = []
    for dependency in metadata.get("dependencies", []):
        requirement = Requirement(dependency)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            missing.append(dependency)
    return missing
