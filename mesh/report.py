"""``python -m mesh.report RUN_DIR [--no-plot]``: one screen about a run, and its curves in ``RUN_DIR/report.png``.

A run directory holds everything needed to judge a run, spread over files written for other readers
(``metrics.jsonl`` for programs, ``events.jsonl`` for ``mesh.ctl``, ``error.log`` for a traceback). This
reads them all and says, on one screen, what a person asks first: is it live, finished, stopped or failed,
how far it got, whether the reward rose, where a step's time goes, whether anything failed or changed,
and what it saved. It reads only; it starts nothing and needs no torch, so it is quick on a live run. The
readers are ``mesh/records/readers.py``; the text and the figure, ``mesh/records/report.py``.

The state comes from what is in the directory: ``final/`` present is finished; ``control/pid`` naming a
process that is still the run's (``actors.basics.pids.alive_since``) is live (``live?`` when it is on another
host); an ``error.log`` entry for the end of the run is failed; every step trained but no ``final/`` yet is
``finishing?`` (the run exports it after closing its channel; an export that fails is the run's end in
error.log, so this is an export under way, or one a kill cut short);
anything else stopped (a signal, or a kill). A DiLoCo parent (``replicas/``, see ``mesh/runtime/replicas.py``) gets
a row per replica and each replica's curves in ``report.png``.

A live run may be writing a line of ``metrics.jsonl`` as it is read: a last line that is not whole is
left for the next report. Every file is read a line at a time, each line within ``LONGEST_LINE``, keeping
only what the report shows (``Series``), so a run of any length (or a file of any size) is reported in
bounded memory; a file that is not a regular one (a pipe, a device, a link) is refused, never waited on.
Rows past the plan's ``loop.steps`` (another run writing to the directory, or an edited file) are flagged.
A run from an older version lacks some keys: what is missing shows as ``-``. A run that evaluated its
initial weights (``loop.evaluation.at_start``) or checked their gap to their hinted selves (``loop.gap_check``) has a
row for step -1 holding those alone: it counts as an evaluation ("at start"), never as a step.

Exit codes: 0 the report was printed, also for a run with no finished step yet (it says so: a run that
is starting is not an error); 2 nothing could be reported (the directory is missing, is not a run
directory, or a file in it cannot be read or parsed), one line on stderr naming the cause and the fix; 130
stopped by SIGINT (one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mesh.records.readers import Parent, ReportError, load
from mesh.records.report import fit, parent_lines, plot, run_lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        found = load(args.run_dir)
        lines = parent_lines(found) if isinstance(found, Parent) else run_lines(found)
        plotted = plot(found) if not args.no_plot else None
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # reading a long run's files: it only reads, so there is nothing to undo
        print("stopped: SIGINT; the report was not printed", file=sys.stderr)
        return 130
    if plotted is not None:
        lines.append(plotted)
    try:
        print("\n".join(fit(line) for line in lines), flush=True)
    except BrokenPipeError:  # piped into head or a pager that stopped reading: it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mesh.report", description="One screen about a run; its curves in RUN_DIR/report.png."
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory python -m mesh.run printed")
    parser.add_argument("--no-plot", action="store_true", help="print only; do not write report.png")
    return parser


if __name__ == "__main__":
    sys.exit(main())
