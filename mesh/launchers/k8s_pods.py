"""Why a mesh's pods are not ready, read from the pods as the ``kubernetes`` client returns them.

A rank is ready when the pod carrying its StatefulSet index (``apps.kubernetes.io/pod-index``,
the rank ``KubernetesJob`` attaches by) has the ``Ready`` condition. One that is not is
described by what a user would look for in ``kubectl describe pod``: its phase, then the
reason a container waits (``ImagePullBackOff``), ended (``OOMKilled``) or the pod is not
scheduled (``Unschedulable`` with the scheduler's message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RANK_LABEL = "apps.kubernetes.io/pod-index"
IMAGE_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")


@dataclass(frozen=True)
class PodWait:
    """One rank without a ready pod: its pod's name (None: no pod yet), phase and reason."""

    rank: int
    pod: str | None
    phase: str = ""
    reason: str = ""
    message: str = ""

    def __str__(self) -> str:
        if self.pod is None:
            return f"rank {self.rank} has no pod yet"
        why = ": ".join(part for part in (self.reason, " ".join(self.message.split())) if part)
        return f"{self.pod} ({self.phase}{', ' + why if why else ''})"


def not_ready_pods(pods: list[Any], hosts: int) -> list[PodWait]:
    """The ranks ``0 .. hosts-1`` of a mesh whose pod is missing or not ready."""
    by_rank = {}
    for pod in pods:
        rank = (pod.metadata.labels or {}).get(RANK_LABEL, "")
        if rank.isdigit():
            by_rank[int(rank)] = pod
    late = []
    for rank in range(hosts):
        pod = by_rank.get(rank)
        if pod is None:
            late.append(PodWait(rank, None))
        elif not is_ready(pod):
            late.append(PodWait(rank, pod.metadata.name, pod.status.phase or "Unknown", *blocking(pod)))
    return late


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def blocking(pod: Any) -> tuple[str, str]:
    """(reason, message) of what keeps the pod from being ready, as far as its status says."""
    for status in pod.status.container_statuses or []:
        state = status.state
        for part in (state and state.waiting, state and state.terminated):
            if part and part.reason:
                return part.reason, part.message or ""
    for condition in pod.status.conditions or []:
        if condition.status == "False" and condition.reason:
            return condition.reason, condition.message or ""
    return "", ""


def readiness_fix(waits: list[PodWait], namespace: str) -> str:
    """What to do about these pods, one clause per kind of cause."""
    reasons = {w.reason for w in waits}
    fixes = []
    if reasons & set(IMAGE_REASONS):
        fixes.append(
            "the image cannot be pulled: check that launcher.image exists and that the namespace can pull it "
            "(an imagePullSecret for a private registry)"
        )
    if "Unschedulable" in reasons:
        fixes.append(
            "no node has what the pods ask for: lower meshes.*.hosts or gpus, or point launcher.node_selector, "
            "tolerations or queue at nodes that have it"
        )
    if any(w.pod is None for w in waits):
        fixes.append(
            "the MonarchMesh operator makes the pods: check that it runs (kubectl -n monarch-system get pods) and "
            f"read kubectl -n {namespace} describe monarchmesh <name>"
        )
    if not fixes or reasons - {"Unschedulable", "", *IMAGE_REASONS}:
        fixes.append(f"read kubectl -n {namespace} describe pod <pod> and kubectl -n {namespace} logs <pod>")
    return "Fix: " + "; ".join(fixes) + "."
