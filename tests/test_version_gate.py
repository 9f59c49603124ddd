"""The Generator's VersionGate: concurrent requests share a weight version; a change waits for them.

Plain asyncio, no actors: the gate is the ordering rule the concurrent endpoints rely on
(the actor-level behaviour, with real weights, is in test_actors and test_router).
"""

from __future__ import annotations

import asyncio

import pytest

from actors.generator.gate import VersionGate
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
