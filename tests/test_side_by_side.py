"""Runs side by side on one host: four tiny runs at once, each a two-rank trainer with its process group's store,
all finish while another program holds nearly every ephemeral port and keeps taking the free ones.

No listening socket of a run is chosen free and bound later (``actors/trainer/actor.py``'s store, the served environment,
the agents' endpoint, the torchft stores and lighthouse): each is bound at port 0 by the process that serves it.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from tiny_runs import ROOT, TINY, command_line

RUNS = 4
FREE = 300  # the ephemeral ports the other program leaves free
# Another program on the host, holding every ephemeral port but ``FREE`` (as many processes as its open-file limit
# needs): each takes ports at 0 as a probe for a free port does; the last one, having run the range dry, lets
# ``FREE`` go and then keeps taking a port for each it lets go, the oldest first. A port a run found free and let go
# is then one of few, and likely taken before the run binds it again.
TAKER = r"""
import collections, errno, resource, socket, sys, time
last = sys.argv[1] == "last"
limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64
held = collections.deque()
while len(held) < limit:
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        taken.close()
        break
    held.append(taken)
for _ in range(int(sys.argv[2]) if last else 0):
    held.popleft().close()
print(len(held), flush=True)
while last:
    held.popleft().close()
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        held.append(taken)
    except OSError:
        taken.close()
    time.sleep(0.001)
time.sleep(3600)
"""


@contextmanager
def ports_taken():
    """Every ephemeral port but ``FREE`` held by another program, which keeps taking the free ones."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    takers = []
    try:
        while True:
            last = (high - low + 1) - sum(held for _, held in takers) <= resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            taker = subprocess.Popen([sys.executable, "-c", TAKER, "last" if last else "more", str(FREE)],
                                     stdout=subprocess.PIPE, text=True)
            takers.append((taker, int(taker.stdout.readline())))
            if last:
                break
        yield
    finally:
        for taker, _ in takers:
            taker.kill()
            taker.wait()


@pytest.mark.slow
def test_four_runs_at_once_all_finish_while_ports_are_taken(tmp_path: Path):
    logs = [tmp_path / f"{i}.log" for i in range(RUNS)]
    with ports_taken():
        runs = [
            subprocess.Popen(
                command_line(TINY, tmp_path / str(i), "loop.steps=3", "loop.max_policy_lag=1", f"seed={i}"),
                cwd=ROOT,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
            for i, log in enumerate(logs)
        ]
        codes = [run.wait(timeout=600) for run in runs]
    for code, log in zip(codes, logs):
        assert code == 0, log.read_text()[-3000:]
    assert all(len(list((tmp_path / str(i)).glob("tiny-*/final"))) == 1 for i in range(RUNS))
