"""LoRA against full weights: what a push moves, the trainer's peak memory, and samples to a reward.

    python bench/lora.py                 # push at tiny and 0.5B shapes, trainer memory at 0.5B, tiny runs to a reward
    python bench/lora.py --quick         # fewer rounds, no runs

- **Push**: the bytes and time of one version through the real weight store, LoRA's adapters against the
  full state dict, at ``tiny.yaml``'s shape and at Qwen2.5-0.5B's (``gpu_lora.yaml``'s; random weights, fp32
  on this CPU). Publish is ``WeightPublisher.publish`` (copy and checksum into a shm slot); load is the
  ``hf`` engine's: a ``WeightFollower`` holds the version and the model takes it (the full state dict's
  views assigned, or the adapters copied into the PEFT model). The ratio is full over LoRA.
- **Trainer memory**: the peak RSS of a process that builds the native loop at the 0.5B shape and takes
  two steps on the same small batch, full against LoRA (each in a fresh process).
- **Samples to a reward**: ``tiny.yaml`` against ``tiny_lora.yaml`` (both 250 steps of 256 samples), the
  samples until the 10-step mean reward first reaches 0.7.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script

from actors.models.facts import TinyModelSpec
from actors.models.lora import adapter_state, load_adapter_state, with_adapter
from actors.models.lora_config import LoRAConfig
from actors.models.tiny import causal_lm
from actors.weights.follower import WeightFollower
from actors.weights.store import WeightPublisher
from actors.weights.storedir import create_store, remove_store
from mesh.topology.schema import load_topology

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TINY = TinyModelSpec(arch="qwen2", hidden_size=64, layers=2, heads=4, kv_heads=2)
HALF_B = TinyModelSpec(arch="qwen2", hidden_size=896, intermediate_size=4864, layers=24, heads=14, kv_heads=2)
SHAPES = {"tiny": (TINY, LoRAConfig(rank=16, alpha=32)), "0.5B": (HALF_B, LoRAConfig(rank=32, alpha=64))}
VOCAB = 16  # the reverse task's character vocabulary, as the topologies build it


@dataclass
class Push:
    shape: str
    weights: str  # full | lora
    bytes: int
    publish_s: float
    load_s: float


def pushes(shape: str, rounds: int) -> list[Push]:
    """Median publish and load time of ``rounds`` versions, full weights then LoRA's adapters."""
    spec, lora = SHAPES[shape]
    torch.manual_seed(0)
    full = causal_lm(spec, VOCAB).eval()
    receiver = causal_lm(spec, VOCAB).eval()
    full_state = {name: t.detach() for name, t in full.state_dict().items()}
    results = [_push(shape, "full", full_state, lambda state: receiver.load_state_dict(state, assign=True), rounds)]
    adapted, receiver = with_adapter(full, lora), with_adapter(receiver, lora)
    state = adapter_state(adapted)
    results.append(_push(shape, "lora", state, lambda state: load_adapter_state(receiver, state), rounds))
    return results


def _push(shape: str, weights: str, state: dict[str, torch.Tensor], load, rounds: int) -> Push:
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    store = create_store(root)
    publisher, follower = WeightPublisher(store, state, slots=2), WeightFollower()
    publish, hold = [], []
    try:
        for version in range(rounds + 1):  # version 0 warms up
            for tensor in state.values():  # a stand-in for an optimizer step
                tensor.view(-1)[:1].add_(1e-3)
            start = time.perf_counter()
            record = publisher.publish(state, version)
            published = time.perf_counter()
            follower.hold(record, load)
            follower.check_intact(record)
            if version:
                publish.append(published - start)
                hold.append(time.perf_counter() - published)
        return Push(shape, weights, publisher.nbytes, statistics.median(publish), statistics.median(hold))
    finally:
        publisher.close()
        remove_store(store)
        root.rmdir()


PEAK = """
import re, sys, torch
sys.path.insert(0, {tests!r})
from test_actors import a_batch
from actors.inner_loops.config import TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models.lora_config import LoRAConfig
torch.manual_seed(0)
lora = LoRAConfig(rank=32, alpha=64) if {lora} else None
loop = NativeLoop({model!r}, TrainerConfig(mesh="t", lora=lora), 0, 1)
batch = a_batch({model!r}, channels=False)
for _ in range(2):
    loop.train_step(batch)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


def trainer_peak(model_dir: str, lora: bool) -> int:
    """Peak RSS in bytes of a fresh process that builds the native loop and takes two steps: its own
    high-water mark (VmHWM), not ``ru_maxrss``, which Linux carries over from this process through
    fork and exec (and this one held the 0.5B pushes)."""
    code = PEAK.format(tests=str(ROOT / "tests"), lora=lora, model=model_dir)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


def samples_to_reward(topology: str, target: float, window: int = 10) -> tuple[int | None, float]:
    """A run of ``topology``: the samples until the ``window``-step mean reward first reaches ``target``,
    and the run's wall time."""
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        command = [sys.executable, "-m", "mesh.run", str(ROOT / "topologies" / topology), "--no-progress"]
        subprocess.run([*command, f"--set=logging.root={root}"], check=True, cwd=ROOT, capture_output=True)
        wall = time.perf_counter() - start
        (metrics,) = Path(root).glob("*/metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    loop = load_topology(ROOT / "topologies" / topology).loop
    rewards = [row["reward/mean"] for row in rows]
    for step in range(window, len(rewards) + 1):
        if statistics.mean(rewards[step - window : step]) >= target:
            return step * loop.prompts_per_step * loop.group_size, wall
    return None, wall


def main(args) -> None:
    print(f"# {machine()}; {datetime.date.today()}")
    rounds = 3 if args.quick else 9
    figures: dict = {"date": str(datetime.date.today()), "machine": machine(), "pushes": []}
    for shape in SHAPES:
        full, lora = pushes(shape, rounds)
        figures["pushes"] += [asdict(full), asdict(lora)]
        print(
            f"push {shape}: full {full.bytes / 1e6:.2f} MB in {full.publish_s * 1e3:.1f} + {full.load_s * 1e3:.1f} ms, "
            f"lora {lora.bytes / 1e6:.3f} MB in {lora.publish_s * 1e3:.2f} + {lora.load_s * 1e3:.2f} ms "
            f"(publish + load, median of {rounds}): {full.bytes / lora.bytes:.1f}x fewer bytes, "
            f"{(full.publish_s + full.load_s) / (lora.publish_s + lora.load_s):.1f}x less time"
        )
    with tempfile.TemporaryDirectory() as directory:
        from actors.models.tiny import build_tiny_model

        model = str(build_tiny_model(Path(directory), HALF_B, "abc=", seed=0))
        full, lora = trainer_peak(model, False), trainer_peak(model, True)
    figures["trainer_peak_bytes"] = {"full": full, "lora": lora}
    print(f"trainer peak RSS at 0.5B (native, fp32, two steps): full {full / 1e9:.2f} GB, lora {lora / 1e9:.2f} GB "
          f"({full / lora:.2f}x)")
    if not args.quick:
        reached = {name: samples_to_reward(name, 0.7) for name in ("tiny.yaml", "tiny_lora.yaml")}
        figures["samples_to_0.7"] = reached
        for name, (samples, wall) in reached.items():
            print(f"{name}: 10-step mean reward >= 0.7 after {samples} samples (run {wall:.0f} s)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "lora.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds per push, no runs")
    main(parser.parse_args())
