"""Behaviour is pinned: seeded tiny runs (synchronous and bounded-async, 30 steps, warm start and
evaluation off) reproduce the metrics recorded before the RunPlan/Controller refactor (issue 29)
to 1e-6. A change that moves any of these numbers changed what the loop trains on or how; if it
is meant to, re-record with ``python tests/golden/record.py`` and say why in the commit."""

from __future__ import annotations

import json
import math

import pytest

from golden.record import HERE, RUNS, golden_run

TOLERANCE = 1e-6


def differences(expected, actual, where: str = "") -> list[str]:
    """Every place where ``actual`` differs from ``expected`` by more than the tolerance."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [f"{where}/{k}: missing" for k in expected.keys() - actual.keys()]
        found += [f"{where}/{k}: new" for k in actual.keys() - expected.keys()]
        shared = expected.keys() & actual.keys()
        return found + [d for k in sorted(shared) for d in differences(expected[k], actual[k], f"{where}/{k}")]
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        close = math.isclose(expected, actual, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
        return [] if close else [f"{where}: {expected} -> {actual}"]
    return [] if expected == actual else [f"{where}: {expected!r} -> {actual!r}"]


@pytest.mark.parametrize("name", RUNS)
async def test_seeded_tiny_run_reproduces_its_golden_metrics(tmp_path, name):
    expected = json.loads((HERE / f"{name}.json").read_text())
    actual = await golden_run(RUNS[name], str(tmp_path))
    assert differences(expected, actual) == []


def test_the_comparison_sees_a_change_past_the_tolerance():
    assert differences({"a": [1.0, 2.0]}, {"a": [1.0, 2.0 + 1e-9]}) == []
    assert differences({"a": [1.0, 2.0]}, {"a": [1.0, 2.001]}) == ["/a[1]: 2.0 -> 2.001"]
    assert differences({"a": 1}, {"b": 1}) == ["/a: missing", "/b: new"]
