"""One trainer rank of one DiLoCo replica over the torchft transport, as its own OS process (torchft's
Manager is per process). Driven by tests/test_diloco_torchft.py: ``python diloco_torchft_worker.py PLAN``,
where PLAN is a JSON object; results and events are files in ``PLAN["dir"]``, written atomically.

The rank keeps an outer state {"theta0", "round"} (the caller's side of the protocol): each round it
averages ``delta_for(replica, rank, round)`` and applies an outer SGD with lr 1 (θ₀ ← θ₀ − mean) to the
``w`` tensor; a heal replaces the state, round included, so the next round follows the live replica's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def delta_for(replica: int, rank: int, round: int) -> dict[str, torch.Tensor]:
    """A share whose mean over replicas 0 and 1 is exact in every dtype (float32, float64, bfloat16);
    each rank's share has its own names and shapes."""
    return {
        f"w{rank}": torch.full((8, 4 + rank), float(2 * replica + 1) * round + 0.25 * rank),
        f"b{rank}": torch.arange(5, dtype=torch.float64) * (replica + 1) + rank,
        f"h{rank}": torch.full((3,), 0.5 * (replica + 1), dtype=torch.bfloat16),
    }


def initial_state(rank: int) -> dict:
    return {"theta0": torch.zeros(8, 4 + rank), "round": 0}


def save(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def touch(path: Path) -> None:
    save(path, None)


def wait_for(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.02)


def main(plan: dict) -> None:
    from actors.diloco.torchft import TorchFTTransport, host_replica_store, this_host

    out = Path(plan["dir"])
    tag, replica, rank, world = plan["tag"], plan["replica"], plan["rank"], plan["world"]
    state = initial_state(rank)

    def state_dict() -> dict:
        return state

    def load_state_dict(new: dict) -> None:
        save(out / f"{tag}_loaded.pt", new)
        state.clear()
        state.update({"theta0": new["theta0"].clone(), "round": new["round"]})

    port_file = out / f"store_port_replica{replica}"
    kwargs = {}
    if rank == 0:
        host, port = this_host(), 0
        if plan.get("host_store"):  # the helper; otherwise the transport hosts the store on a free port
            store = host_replica_store(0, host)
            port, kwargs["store"] = store.port, store
    else:
        wait_for([port_file])
        host, port = this_host(), int(port_file.read_text())
    transport = TorchFTTransport(
        plan["lighthouse"],
        replica,
        rank,
        world,
        host,
        port,
        state_dict,
        load_state_dict,
        timeout_s=30.0,
        **kwargs,
    )
    if rank == 0:
        port_file.with_suffix(".tmp").write_text(str(transport.store_port))
        os.replace(port_file.with_suffix(".tmp"), port_file)
    touch(out / f"ready_{tag}")

    for i in range(1, plan["calls"] + 1):
        waits = plan.get("wait_before", {}).get(str(i), [])
        wait_for([out / w for w in waits], timeout=plan.get("wait_timeout", 60.0))
        time.sleep(plan.get("sleep_before", {}).get(str(i), 0.0))
        round = state["round"] + 1
        touch(out / f"entering_{tag}_{i}")
        result = transport.average(round, delta_for(replica, rank, round))
        # the outer step (SGD, lr 1) on θ₀; a heal during the call replaced the state
        state["theta0"] = state["theta0"] - result.mean[f"w{rank}"]
        state["round"] += 1
        save(
            out / f"{tag}_call{i}.pt",
            {
                "called_round": round,
                "committed": transport.rounds_committed,
                "mean": result.mean,
                "members": result.members,
                "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received,
                "seconds": result.seconds,
                "state": {"theta0": state["theta0"].clone(), "round": state["round"]},
            },
        )
    transport.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
