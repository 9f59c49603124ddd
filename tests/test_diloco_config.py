"""The ``diloco`` section and the command line around it: what a replica is, and every mistake refused
in one paragraph (exit 2) before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh.run import main
from mesh.runtime.replicas import Replica
from mesh.topology.describe import describe
from mesh.topology.preflight import load_plan
from mesh.topology.schema import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
TINY, TINY_DILOCO = ROOT / "topologies" / "tiny.yaml", ROOT / "topologies" / "tiny_diloco.yaml"
LIGHTHOUSE = "diloco.lighthouse=http://lighthouse:29510"


def test_a_topology_without_diloco_is_one_run_on_the_topology_seed():
    plan = load_plan(TINY)
    assert plan.topology.diloco is None and not plan.starts_replicas and plan.runs_here == 1
    assert plan.diloco_replica is None and plan.prompt_seed == plan.topology.seed


def test_each_replica_draws_its_own_prompt_stream_and_replica_0_the_topologys():
    assert load_plan(TINY_DILOCO).starts_replicas
    seeds = [load_plan(TINY_DILOCO, [f"diloco.replica={i}", LIGHTHOUSE]).prompt_seed for i in (0, 1)]
    assert seeds[0] == load_topology(TINY_DILOCO).seed and seeds[1] != seeds[0]
    one = load_plan(TINY_DILOCO, ["diloco.replicas=1"])
    assert not one.starts_replicas and one.diloco_replica == 0  # a run of one replica is replica 0


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["diloco.sync_every=300"], "never sync"),
        (["diloco.replica=2", LIGHTHOUSE], "outside this run's replicas 0..1"),
        (["diloco.replica=1"], "meets the others only through diloco.lighthouse"),
        (["diloco.transport=object_store", "diloco.replica=1"], "diloco.store"),
        (["diloco.transport=object_store", "diloco.store=ftp://host/x"], "s3://bucket/prefix or file:///"),
        (["diloco.store=file:///tmp/x"], "with torchft, drop it"),
        (["diloco.transport=object_store", LIGHTHOUSE], "with the object_store transport, drop it"),
        (["diloco.outer_optimizer.momentum=0"], "Nesterov is a kind of momentum"),
        (["diloco.outer_optimizer.lr=0"], "lr must be a number > 0"),
        (["diloco.round_timeout=0"], "round_timeout"),
        (["diloco.replicas=0"], "replicas must be in 1..1024"),
        (["diloco.fragments=3", "diloco.transport=object_store"], "divide sync_every (10)"),
        (["diloco.fragments=2"], "object_store only"),
    ],
)
def test_diloco_mistakes_are_refused_naming_the_fix(overrides, words):
    with pytest.raises(TopologyError) as info:
        load_topology(TINY_DILOCO, overrides)
    assert words in str(info.value)


def test_replica_flag_names_the_run_and_needs_a_diloco_section(capsys):
    assert main([str(TINY), "--replica", "1", "--dry-run"]) == 2
    assert "has no diloco section" in capsys.readouterr().err
    assert main([str(TINY_DILOCO), "--replica", "1", "--set", LIGHTHOUSE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "name: tiny-diloco-r1" in out and "this run is replica 1 of 2" in out


def test_dry_run_lists_the_replicas_runs_and_how_they_sync(capsys):
    assert main([str(TINY_DILOCO), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "this run starts 2 replicas, each its own run tiny-diloco-r<I>" in out
    assert "every 10 steps" in out and "SGD lr 0.7, momentum 0.9, Nesterov" in out
    assert "syncer" not in describe(load_plan(TINY))
    streaming = describe(load_plan(TINY_DILOCO, ["diloco.fragments=2", "diloco.transport=object_store"]))
    assert "one of 2 fragments every 5 steps (streaming; each fragment every 10 steps)" in streaming


def test_a_run_of_replicas_is_resumed_replica_by_replica(capsys, tmp_path):
    assert main([str(TINY_DILOCO), "--resume", str(tmp_path)]) == 2
    assert "resumed replica by replica" in capsys.readouterr().err


def test_the_parent_reads_only_new_metrics_lines_and_rereads_a_rewound_file(tmp_path):
    run = tmp_path / "replicas" / "tiny-diloco-r1-20261123-000000"
    run.mkdir(parents=True)
    metrics = run / "metrics.jsonl"
    replica = Replica(1, None, tmp_path / "replica_1.log", tmp_path / "replicas", "tiny-diloco-r1")
    metrics.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')  # the last line is being written
    replica.read()
    assert replica.step == 2
    with metrics.open("a") as f:
        f.write('ard/mean": 0.5}\n')
    replica.read()
    assert [r["step"] for r in replica.records] == [0, 1, 2] and replica.records[-1]["reward/mean"] == 0.5
    rewound = run / "metrics.jsonl.partial"  # a restarted trainer's run rewinds the file by replacing it
    rewound.write_text('{"step": 0}\n')
    rewound.replace(metrics)
    replica.read()
    assert [r["step"] for r in replica.records] == [0]


def test_a_replica_whose_metrics_cannot_be_read_is_said_once_and_not_followed(tmp_path, capsys):
    run = tmp_path / "replicas" / "tiny-diloco-r0-20261123-000000"
    run.mkdir(parents=True)
    os.mkfifo(run / "metrics.jsonl")  # a pipe would hang a plain read
    replica = Replica(0, None, tmp_path / "replica_0.log", tmp_path / "replicas", "tiny-diloco-r0")
    replica.read()
    replica.read()
    err = capsys.readouterr().err
    assert err.count("replica 0's progress is no longer shown") == 1 and "named pipe" in err
    assert replica.records == [] and replica.step == 0
