"""``python -m mesh.export CHECKPOINT OUT [--merge]``: a checkpoint as a Hugging Face model directory.

What it writes and checks: ``mesh/checkpoints/export.py``. Exit codes: 0 written, 2 bad input or an OUT that
cannot be written (one paragraph on stderr), 130 / 143 stopped by SIGINT / SIGTERM (one line).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from mesh.checkpoints.export import ExportError, describe, export
from mesh.supervision.interrupts import Signalled, signals_raise


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with signals_raise(ignore_later=True):  # so that removing OUT.partial is not cut short
            out = export(Path(args.checkpoint), Path(args.out), args.merge)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Signalled as signalled:
        name = signal.Signals(signalled.signum).name
        print(f"stopped: {name} while exporting; nothing was written to {args.out}", file=sys.stderr)
        return 128 + signalled.signum
    print(f"wrote {out}: {describe(out)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line, apart from ``main`` so that tests parse the commands the docs show."""
    parser = argparse.ArgumentParser(
        prog="python -m mesh.export",
        description="Write a checkpoint's policy as a Hugging Face model directory (for transformers, vllm serve, "
        "the Hub).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/<run>/checkpoints/step_000125")
    parser.add_argument("out", help="the directory to write (new, or empty)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: merge the adapters into the base and write the whole model (default: PEFT's adapter "
        "directory, pointing at its base); a full-weights checkpoint is the whole model either way",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
