"""Benchmark: an OpenEnv game whose turns weight updates interrupt: how many tokens, and their mismatch.

    python bench/env_turns.py            # by step and by group, lag 1, 12 steps each
    python bench/env_turns.py --steps 6

``topologies/env_multiturn.yaml`` (the guess game, a tiny model on the hf engine) with replies of up to
``REPLY_TOKENS`` tokens instead of one digit, so that a turn takes long enough for the trainer's next version to
land inside it. Each OpenEnv turn samples with the newest weights the generator holds; an update interrupts it at a
token boundary and it goes on with the new weights (``Generator._turn``, the agents' turn path), each token keeping
the version that sampled it. Reported per mode: the share of the model's tokens sampled after an update inside their
own turn (``episodes/tokens_after_update_in_turn``) and after one at all, and the trainer-vs-sampler mismatch of the
in-turn tokens (``train/policy/mismatch_k3_after_update``, median over the steps that had any) beside that of every
token (``mismatch_k3``), with trained samples/s, groups dropped and tokens never trained.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

from agent_collect import OUT, ROOT, metrics_of, summary  # bench/ is on sys.path when this runs as a script
from common import machine

TOPOLOGY = ROOT / "topologies" / "env_multiturn.yaml"
REPLY_TOKENS = 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(machine())
    results = {}
    for mode in ("step", "group"):
        settings = [f"loop.collect={mode}", f"loop.steps={args.steps}", "loop.evaluation.every=0"]
        settings += [f"actors.generator.max_new_tokens={REPLY_TOKENS}", "checkpointing.every=0"]
        rows = metrics_of(TOPOLOGY, settings, Path(tempfile.mkdtemp(prefix=f"env-turns-{mode}-")))
        results[mode] = summary(rows)
        print(f"by {mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[mode].items()), flush=True)
    OUT.mkdir(exist_ok=True)
    record = {"machine": machine(), "date": datetime.date.today().isoformat(), "runs": results}
    (OUT / "env_turns.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
