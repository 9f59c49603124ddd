"""tiny.yaml end to end on a real Kubernetes cluster, the way k8s/README.md runs it: render,
``kubectl apply``, wait for the controller Job to complete, delete everything.

Needs ``KUBECONFIG`` pointing at a cluster with the MonarchMesh operator installed, a
ReadWriteMany storage class, ``kubectl`` on PATH, and ``COMPOSER_MESH_IMAGE``: the image
built from ``k8s/Dockerfile`` at this commit, pullable by the cluster (``K8S_NAMESPACE``,
default ``default``, is where it runs). Skipped, saying which is missing, otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mesh.run import main

TINY = Path(__file__).resolve().parents[1] / "topologies" / "tiny.yaml"
JOB_TIMEOUT_S = 1800  # image pulls on fresh nodes, then a short CPU run

pytestmark = pytest.mark.k8s


def missing() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is not set: no Kubernetes cluster to run on"
    if shutil.which("kubectl") is None:
        return "kubectl is not on PATH"
    if not os.environ.get("COMPOSER_MESH_IMAGE"):
        return "COMPOSER_MESH_IMAGE is not set: build k8s/Dockerfile and push it where the cluster pulls from"
    return None


def kubectl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_tiny_runs_to_completion_on_the_cluster(tmp_path):
    namespace = os.environ.get("K8S_NAMESPACE", "default")
    sets = [
        "launcher.kind=k8s",
        f"launcher.image={os.environ['COMPOSER_MESH_IMAGE']}",
        f"launcher.namespace={namespace}",
        "loop.steps=3",
        "loop.warm_start.steps=1",
        "loop.evaluation.every=0",
        "checkpointing.every=0",
    ]
    objects = tmp_path / "objects"
    assert main([str(TINY), *[a for s in sets for a in ("--set", s)], "--render", str(objects)]) == 0
    applied = kubectl("apply", "-f", str(objects))
    assert applied.returncode == 0, applied.stderr
    try:
        done = kubectl("-n", namespace, "wait", "--for=condition=complete", "job/tiny-controller",
                       f"--timeout={JOB_TIMEOUT_S}s", timeout=JOB_TIMEOUT_S + 60)  # fmt: skip
        logs = kubectl("-n", namespace, "logs", "job/tiny-controller").stdout
        assert done.returncode == 0, f"{done.stderr}\n{logs}"
        assert "run directory: /runs/tiny-" in logs
    finally:
        kubectl("delete", "--wait=false", "-f", str(objects))
