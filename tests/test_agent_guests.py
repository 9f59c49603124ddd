"""Agents are guests (``actors/agents/guests.py``): an episode reaches nothing of the generator, its agent host
or its siblings. Real agent hosts and real guest processes (``tests/agent_hostile.py``), without a model: the agents
never call the endpoint. Where the tests run as root they get users of their own; a second host runs as root in a user
namespace that maps uid 0 alone (as a rootless container's may), where agents share the run's user."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.agents import guests
from actors.agents.endpoint import Endpoint
from actors.agents.task import Agents, AgentSpec
from actors.tasks import Problem, TaskConfig

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT = Endpoint("http://127.0.0.1:9/v1", "unused")
OWN_USERS = guests.isolation([]).own_users
needs_own_users = pytest.mark.skipif(not OWN_USERS, reason=guests.isolation([]).guarantees())


def agents(timeout_s: float = 10.0, **params) -> Agents:
    return Agents(AgentSpec("agent_hostile:agent", TaskConfig("math", {}), 2, timeout_s, params))


def guest_processes() -> set[int]:
    """Live processes of a guest uid on this host now (a killed one may stay a zombie a moment)."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        except (OSError, KeyError, ValueError):
            continue
        if state != "Z" and guests.FIRST_GUEST_UID <= uid < guests.FIRST_GUEST_UID + guests.GUEST_UIDS:
            found.add(int(entry))
    return found


async def play(runner: Agents, *ways: str) -> list:
    return await asyncio.gather(*(runner.run(ENDPOINT, Problem(way, "0")) for way in ways))


@needs_own_users
async def test_an_episode_reaches_nothing_of_the_generator_its_host_or_its_siblings():
    """Intruders beside sleeping victims: none reads or writes the generator's, the host's or a sibling's memory,
    environment or fds, or may signal any of them; one that kills its host is refused and its siblings finish."""
    runner = agents()
    try:
        outcomes = await play(runner, *["sleeps"] * 3, "intrudes", "intrudes", "kills its host", "sleeps")
        said = [(o.reward, o.failure) for o in outcomes]
        assert said == [(0.5, None)] * 3 + [(1.0, None)] * 3 + [(0.5, None)], said
    finally:
        await runner.close()


@needs_own_users
async def test_each_episode_is_a_user_of_its_own_with_a_private_tmp_and_no_secret():
    secret = Path("/root/.mesh-test-secret")
    secret.write_text("the run's own")
    secret.chmod(0o600)
    runner = agents(secret=str(secret))
    try:
        uids = [o.reward for o in await play(runner, *["whoami"] * 6)]
        assert len(set(uids)) == 6 and all(guests.FIRST_GUEST_UID <= u < guests.FIRST_GUEST_UID + guests.GUEST_UIDS
                                           for u in uids), uids
        tmp, reads = await play(runner, "private tmp", "reads a secret")
        assert tmp.reward == 1.0, "an episode's /tmp and /dev/shm hold what it wrote alone"
        assert reads.reward == 1.0, reads.failure
    finally:
        secret.unlink()
        await runner.close()


@needs_own_users
async def test_what_a_killed_host_left_is_killed_before_its_uid_is_used_again():
    """A host killed while its episode's daemon runs leaves that daemon (as its uid) behind; the next host finds
    the uid its predecessor died holding and kills every process of it before anything else."""
    runner, before = agents(), guest_processes()
    try:
        host = await runner.host()
        running = asyncio.ensure_future(runner.run(ENDPOINT, Problem("daemon, then waits", "0")))
        for _ in range(200):
            if len(guest_processes() - before) >= 2:  # the episode and its daemon
                break
            await asyncio.sleep(0.02)
        host.process.kill()
        assert "killed by signal 9" in (await running).failure
        await asyncio.sleep(0.2)  # the episode goes with its host (its parent-death signal); its daemon stays
        left = guest_processes() - before
        assert left, "the daemon did not outlive its host, so nothing is left to clean"
        assert (await runner.run(ENDPOINT, Problem("sleeps", "0"))).reward == 0.5  # a new host
        for _ in range(100):  # killed as it started; the kernel may take a moment to end them
            if not left & guest_processes():
                break
            await asyncio.sleep(0.02)
        assert not left & guest_processes(), "the new host left its predecessor's processes running"
    finally:
        await runner.close()


async def test_every_process_an_episode_starts_ends_with_it_and_its_output_is_bounded(capfd):
    """A daemon that double-forks out of its episode's group and session is gone when the episode ends; an episode
    that prints 13 MiB reaches the log with its first bytes and the count of the rest."""
    runner = agents()
    try:
        daemon, chatty = await play(runner, "daemon", "chatty")
        assert daemon.failure is None and chatty.reward == 1.0
        for _ in range(100):
            if not Path(f"/proc/{int(daemon.reward)}").exists():
                break
            await asyncio.sleep(0.02)
        assert not Path(f"/proc/{int(daemon.reward)}").exists(), "a process outlived its episode"
        err = capfd.readouterr().err
        assert "[13627405 more bytes of its output not shown]" in err and len(err) < 2**16
    finally:
        await runner.close()


async def test_the_host_waits_on_no_episode_and_an_episode_holds_no_fd_of_the_host_or_a_sibling():
    """Eight episodes that close their outcome pipe and hang beside one that sleeps a second: all end in time, as the
    host reads every episode without blocking (it once waited up to a second on each such episode). Each episode
    holds two pipes, its output and its outcome, none of its host's or its siblings'."""
    runner = agents(timeout_s=3.0)
    try:
        await runner.host()
        holds = asyncio.ensure_future(play(runner, "holds", "holds"))
        start = asyncio.get_running_loop().time()
        *closed, sleeper = await play(runner, *["closes its pipe"] * 8, "sleeps")
        assert sleeper.reward == 0.5 and asyncio.get_running_loop().time() - start < 3.0 + 2
        assert all(o.failure == "the agent did not finish within task.timeout_s (3 s)" for o in closed), closed
        assert [o.reward for o in await holds] == [2.0, 2.0]
    finally:
        await runner.close()


def test_nothing_the_host_says_is_used_before_it_is_checked():
    """What the generator reads from its agent host is JSON of one schema within a size: a pickle, an oversized
    frame, a reward that is not a finite number or a failure too long are refused, never run or used."""
    import pickle

    from actors.agents import wire

    with pytest.raises(wire.WireError, match="not JSON"):
        wire.parse(pickle.dumps(("key", {"reward": 1.0})))
    with pytest.raises(wire.WireError, match="over the 65536 allowed"):
        wire.Frames(wire.MAX_REPLY).feed(wire.LENGTH.pack(2**20) + b"{")
    for bad in ({"key": 1, "reward": "1", "failure": None}, {"key": 1, "reward": None, "failure": "x" * 5000},
                {"key": 1, "reward": 1.0}, {"key": "1", "reward": 1.0, "failure": None}):
        with pytest.raises(wire.WireError):
            wire.ended_of(bad)
    assert wire.ended_of({"key": 3, "reward": 1, "failure": None}) == (3, 1.0, None)
    frames = wire.Frames(wire.MAX_REPLY)
    whole = wire.frame({"ended": {"key": 3, "reward": None, "failure": "x"}})
    assert frames.feed(whole[:5]) == [] and frames.feed(whole[5:]) == [("ended", {"key": 3, "reward": None,
                                                                                   "failure": "x"})]


SHARED = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path[:0] = [{tests!r}, {root!r}]
    from actors.agents.task import Agents, AgentSpec
    from actors.agents.endpoint import Endpoint
    from actors.tasks import Problem, TaskConfig

    async def main():
        runner = Agents(AgentSpec("agent_hostile:agent", TaskConfig("math", {{}}), 2, 10.0, {{}}))
        endpoint = Endpoint("http://127.0.0.1:9/v1", "unused")
        told = [await runner.guarantees()]
        for ways in (["intrudes", "sleeps", "sleeps"], ["kills its host", "sleeps"], ["sleeps"]):
            outcomes = await asyncio.gather(*(runner.run(endpoint, Problem(w, "0")) for w in ways))
            told.append([[o.reward, o.failure] for o in outcomes])
        await runner.close()
        print(json.dumps(told))

    asyncio.run(main())
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and util-linux unshare")
def test_where_agents_share_the_run_s_user_the_run_says_so_and_what_holds():
    """Root in a user namespace that maps uid 0 alone cannot give episodes users of their own. The host says so, and
    what then holds does: an agent reads nothing of its host's, the generator's or its siblings' memory or fds, and
    signals none of them where Landlock scopes its episode; where it cannot, one that kills its host fails the
    episodes the host held, and the next episode has a new host."""
    script = SHARED.format(tests=str(ROOT / "tests"), root=str(ROOT))
    result = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", script],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    guarantees, intruded, killed, after = json.loads(result.stdout.splitlines()[-1])
    assert guarantees.startswith("the generator's user namespace maps too few uids"), guarantees
    reached = intruded[0][1] or ""
    assert "mem" not in reached and "environ" not in reached and "fd" not in reached, reached
    if guests.landlock_abi() >= 6:
        assert "cannot signal a process" in guarantees and intruded[0] == [1.0, None] and killed[0] == [1.0, None]
    else:
        assert "can signal its agent host" in guarantees and "signals" in reached
        assert all(failure and "the agent host was killed by signal 9" in failure for _, failure in killed), killed
    assert after == [[0.5, None]]
