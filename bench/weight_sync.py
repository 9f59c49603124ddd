"""Weight sync of a Qwen2-0.5B-shaped bf16 state dict between two Monarch procs, per transport.

    python bench/weight_sync.py            # 7 shm rounds, 4 rdma rounds (about 1 min on 2 cores)
    python bench/weight_sync.py --quick    # 3 and 2

"Weight sync" is the wall time from the trainer's publish start (in one proc) until the
generator holds the new version (in another proc, its views adopted), the small record
travelling between them through the controller as in a run; both ends read the host's
monotonic clock. The baseline is ``Tensor.copy_`` of the same bytes (one flat 1 GB
tensor, destination pages touched beforehand) in the publisher's proc, measured in the
same rounds, interleaved with the transports. Random weights, built directly (no download).

- ``shm``: the same-host transport. Target >= 0.6x memcpy. Also shown: the same plus
  waiting for the follower's background checksum verification (it overlaps sampling in
  a run; ``check_intact`` collects it before any sample leaves).
- ``rdma``: the across-hosts transport, here over Monarch's TCP fallback (no ibverbs):
  the pull into the follower's spare buffer and its verification, both before the swap.
- GPU (only with CUDA): ``cuda_ipc`` for 0.5B and 1.5B; target <= 0.5 s for 1.5B.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script
from monarch.actor import Actor, endpoint, this_host
from monarch.rdma import RDMATcpFallbackWarning, get_rdma_backend

from actors.weights.follower import WeightFollower
from actors.weights.record import WeightVersion
from actors.weights.store import WeightPublisher

OUT = Path(__file__).resolve().parent / "out"
VOCAB = 151936


@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder's tensor shapes (tied embeddings, no separate LM head)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int  # kv heads x head dim


QWEN2_05B = Shape("0.5B", 896, 4864, 24, 128)
QWEN2_15B = Shape("1.5B", 1536, 8960, 28, 256)


def tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Names and shapes as in the HF checkpoint: 290 tensors for 0.5B."""
    h, i, kv = s.hidden, s.intermediate, s.kv_dim
    layer = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.q_proj.bias": (h,),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    shapes = {"model.embed_tokens.weight": (VOCAB, h)}
    for n in range(s.layers):
        shapes |= {f"model.layers.{n}.{key}": shape for key, shape in layer.items()}
    return shapes | {"model.norm.weight": (h,)}


def random_state(s: Shape, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat bf16 buffer of random weights and the state dict as views of it (the memcpy source)."""
    shapes = tensor_shapes(s)
    flat = torch.empty(sum(torch.Size(shape).numel() for shape in shapes.values()), dtype=torch.bfloat16, device=device)
    flat.normal_(generator=torch.Generator(device).manual_seed(0))
    state, offset = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        state[name] = flat[offset : offset + n].view(shape)
        offset += n
    return flat, state


def median(values: list[float]) -> float:
    return statistics.median(values)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Source(Actor):
    """The trainer's side: a state dict, one publisher per transport, and the memcpy baseline."""

    def __init__(self, shape: Shape, device: str, store: str, transports: list[str]):
        warnings.simplefilter("ignore", RDMATcpFallbackWarning)  # the report names the backend
        self.device = device
        self.flat, self.state = random_state(shape, device)
        self.publishers = {t: WeightPublisher(f"{store}-{t}", self.state, slots=2, transport=t) for t in transports}
        self.copy = torch.empty_like(self.flat)
        self.copy.copy_(self.flat)  # first touch of the destination's pages outside the timed copies
        self.version = 0

    @endpoint
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @endpoint
    def publish(self, transport: str) -> tuple[WeightVersion, float]:
        """New weights (one element per tensor changes, as a stand-in for an optimizer step), then publish."""
        for tensor in self.state.values():
            tensor.view(-1)[:1].add_(1)
        synchronize(self.device)
        self.version += 1
        start = time.monotonic()
        return self.publishers[transport].publish(self.state, self.version), start

    @endpoint
    def memcpy(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        self.copy.copy_(self.flat)
        synchronize(self.device)
        return time.perf_counter() - start


class Sink(Actor):
    """The generator's side: per transport, a follower adopting each version as a generator's engine would."""

    def __init__(self):
        self.followers: dict[str, WeightFollower] = {}
        self.models: dict[str, dict[str, torch.Tensor]] = {}

    @endpoint
    def hold(self, weights: WeightVersion) -> float:
        """Adopt ``weights``; the monotonic time at which the views are in place."""
        follower = self.followers.setdefault(weights.transport, WeightFollower())
        follower.hold(weights, self.models.setdefault(weights.transport, {}).update)
        return time.monotonic()

    @endpoint
    def verified(self, weights: WeightVersion) -> float:
        """Wait for the background verification (``check_intact``); the monotonic time it ended."""
        self.followers[weights.transport].check_intact(weights)
        return time.monotonic()


@dataclass
class Figures:
    transport: str
    model: str
    gigabytes: float
    rounds: int
    sync_s: float  # publish start -> views held in the other proc
    verified_s: float  # ... -> background verification collected (= sync_s where verified before the swap)
    memcpy_s: float

    @property
    def ratio(self) -> float:
        return self.memcpy_s / self.sync_s


def measure(shape: Shape, device: str, transports: list[str], rounds: dict[str, int]) -> list[Figures]:
    """Interleaved rounds: each round syncs every transport due and copies once; round 0 warms up."""
    store = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    procs = this_host().spawn_procs(per_host={"procs": 2})
    try:
        source = procs.slice(procs=0).spawn("source", Source, shape, device, f"{store}/weights", transports)
        sink = procs.slice(procs=1).spawn("sink", Sink)
        gigabytes = source.nbytes.call_one().get() / 1e9
        times = {t: ([], []) for t in transports}
        copies = []
        for r in range(max(rounds.values()) + 1):
            for t in transports:
                if r > rounds[t]:
                    continue
                weights, start = source.publish.call_one(t).get()
                held = sink.hold.call_one(weights).get()
                verified = sink.verified.call_one(weights).get()
                if r:
                    times[t][0].append(held - start)
                    times[t][1].append(verified - start)
            if r:
                copies.append(source.memcpy.call_one().get())
            print(f"  {shape.name} round {r} done", flush=True)
        return [
            Figures(t, shape.name, gigabytes, rounds[t], median(times[t][0]), median(times[t][1]), median(copies))
            for t in transports
        ]
    finally:
        procs.stop().get()
        shutil.rmtree(store, ignore_errors=True)


def report(f: Figures, label: str, target: str) -> str:
    return (
        f"{label} {f.model} bf16 ({f.gigabytes:.2f} GB): {f.sync_s * 1e3:.0f} ms ({f.gigabytes / f.sync_s:.1f} GB/s), "
        f"memcpy {f.memcpy_s * 1e3:.0f} ms ({f.gigabytes / f.memcpy_s:.1f} GB/s): {f.ratio:.2f}x memcpy ({target}); "
        f"until verified {f.verified_s * 1e3:.0f} ms ({f.memcpy_s / f.verified_s:.2f}x); median of {f.rounds} rounds"
    )


def main(args) -> None:
    print(f"# {machine()}; {datetime.date.today()}")
    shm_rounds, rdma_rounds = (3, 2) if args.quick else (7, 4)
    cpu = measure(QWEN2_05B, "cpu", ["shm", "rdma"], {"shm": shm_rounds, "rdma": rdma_rounds})
    backend = get_rdma_backend()
    lines = [
        report(cpu[0], "shm", "target >= 0.6x"),
        report(cpu[1], f"rdma ({backend})", "report"),
    ]
    gpu: list[Figures] = []
    if torch.cuda.is_available():
        for shape in (QWEN2_05B, QWEN2_15B):
            gpu += measure(shape, "cuda:0", ["cuda_ipc"], {"cuda_ipc": shm_rounds})
        lines += [report(f, "cuda_ipc", "target <= 0.5 s for 1.5B") for f in gpu]
    else:
        lines.append("cuda_ipc: skipped (no CUDA device here; the GPU figures need a GPU machine)")
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    result = {
        "date": str(datetime.date.today()),
        "machine": machine(),
        "rdma_backend": backend,
        "figures": [asdict(f) | {"ratio_vs_memcpy": f.ratio} for f in cpu + gpu],
    }
    (OUT / "weight_sync.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 shm and 2 rdma rounds")
    main(parser.parse_args())
