"""Agents with a ``python`` tool, written for the OpenAI API as any agent would be (``task: {agent: ...}``).

``make_number`` (``topologies/agent_tools.yaml``, a tiny model on this CPU): the model writes an
arithmetic expression for a target number, the tool computes it, and the model sees the value
and tries again. The agent pays 1 for a first try that computes the target, ``retry_reward`` for
a later one.

``python_solver`` (a real model, ``task: math``): the model may write a ```` ```python ```` block;
the tool runs it and the output comes back as the next message, until the model answers
without code or runs out of tool calls. It returns no reward: the task scores the last reply.

Each has a demonstration (``task: {demonstration: ...}``): the replies of an episode that uses the tool
well, which the run has the agent play as a warm start and replays to the model (channel 3).
``python_demonstration`` writes, for a problem with a worked solution of one operation per line (the
shipped ``math`` set's ``solution`` column), a python block that computes the answer, then the answer alone
after the tool's output.

Every tool call runs in its own sandboxed process (``actors.sandbox.tool``): the model's
code sees nothing of the host but the interpreter and a scratch directory (no network, no file of the run's,
no answer), and a call that hangs is killed. Importing this module checks the sandbox once
(``check_sandbox``), so a machine that cannot run it (no user namespaces, say) fails where the agents load,
at the run's start and with the cause and its fix, rather than in every episode's tool call.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from actors.sandbox.tool import SandboxLimits, check_sandbox, run_python
from actors.tasks import Problem

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
SOLUTION_STEP = re.compile(r"^\s*([\d\s+*/().-]+?)\s*=\s*(-?\d+)\s*$")  # "17 - 12 = 5": one worked step
TOOL_LIMITS = SandboxLimits(timeout_s=5.0, memory_bytes=256 * 2**20, output_bytes=2048)
SOLVER_PROMPT = (
    "Solve the problem. You may run Python: write a ```python code block and you will get what it prints. "
    "Finish with the answer alone on the last line."
)

check_sandbox()


@dataclass(frozen=True)
class MakeNumber:
    """Write an expression whose value is the target: ``7=`` -> ``3+4`` (or ``7``). The task's own reward
    (used only where an agent returns none) is the exact digits of the target."""

    high: int = 9
    alphabet: str = "0123456789+*=?-\n"  # what the model writes and what the agent shows it

    def problems(self, seed: int, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"{seed}/{step}")
        targets = [rng.randint(0, self.high) for _ in range(count)]
        return [Problem(prompt=f"{n}=", answer=str(n)) for n in targets]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)


RETRIES = 2  # a request whose connection is dropped before its answer (a sibling's flood of idle connections on a
# loaded host) is sent again: the endpoint records a turn only once its answer is delivered


async def make_number(endpoint, problem: Problem, tries: int = 2, retry_reward: float = 0.5) -> float:
    """Up to ``tries`` expressions for the target, each computed by the python tool and its value shown back
    (``?`` when it does not compute). Pays the closeness of the best value: 1 for the target at the first try,
    ``retry_reward`` at a later one, less the further off it is."""
    from openai import AsyncOpenAI

    messages, best, target = [{"role": "user", "content": problem.prompt}], 0.0, int(problem.answer)
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=RETRIES) as client:
        for attempt in range(tries):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
            expression = reply.choices[0].message.content or ""
            value = await computed(expression)
            if value is not None:
                closeness = max(0.0, 1.0 - abs(value - target) / 10)
                best = max(best, closeness * (1.0 if attempt == 0 else retry_reward))
            if value == target:
                break
            messages.append({"role": "assistant", "content": expression})
            messages.append({"role": "user", "content": f"{'?' if value is None else value}\n{problem.prompt}"})
    return best


async def computed(expression: str) -> int | None:
    """The integer the python tool prints for ``expression``; None when it prints none."""
    computed = await run_python(f"print(int({expression}))", TOOL_LIMITS)
    text = computed.output.strip()
    return int(text) if computed.failure is None and text.lstrip("-").isdigit() else None


async def python_solver(endpoint, problem: Problem, tool_calls: int = 2) -> None:
    """The model solves ``problem``, its ```` ```python ```` blocks run by the tool, up to ``tool_calls`` times."""
    from openai import AsyncOpenAI

    messages = [{"role": "system", "content": SOLVER_PROMPT}, {"role": "user", "content": problem.prompt}]
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=RETRIES) as client:
        for call in range(tool_calls + 1):
            reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
            text = reply.choices[0].message.content or ""
            code = CODE_BLOCK.search(text)
            if code is None or call == tool_calls:
                return None
            computed = await run_python(code.group(1), TOOL_LIMITS)
            said = computed.output if computed.failure is None else f"{computed.output}\nerror: {computed.failure}"
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": f"Output:\n{said.strip()}"})
    return None


def make_number_demonstration(problem: Problem) -> list[str]:
    """The target itself, the first try: an expression whose value it is."""
    return [problem.answer]


def python_demonstration(problem: Problem) -> list[str] | None:
    """A python block that prints the answer from the problem's numbers, then the answer alone; None when
    the problem's worked solution is not steps of arithmetic on numbers (``solution_code``)."""
    code = solution_code(problem.solution or "")
    return None if code is None else [f"```python\n{code}\n```", problem.answer]


def solution_code(solution: str) -> str | None:
    """One ``print`` of the worked solution's steps as a single expression: ``7 + 10 = 17`` then
    ``17 - 12 = 5`` is ``print((7 + 10) - 12)`` (each earlier result stands in its step's expression; ``/`` is
    ``//`` where it divides exactly, so the output is the answer's digits). None when a line other than the
    final ``#### answer`` is no such step."""
    results: dict[str, str] = {}
    expression = None
    for line in filter(str.strip, solution.splitlines()):
        if line.startswith("####"):
            continue
        step = SOLUTION_STEP.match(line)
        if step is None:
            return None
        expression = re.sub(r"\d+", lambda n: results.get(n.group(), n.group()), step.group(1))
        expression = expression.replace(" / ", " // ")
        results[step.group(2)] = f"({expression})"
    return None if expression is None else f"print({expression})"
