"""A stand-in for a Kubernetes API server at the ``kubernetes`` client's HTTP boundary.

No API server can run on the machines these tests run on, so ``FakeApiServer.request``
replaces ``kubernetes.client.rest.RESTClientObject.request``: everything above it (the
typed APIs, serialization, ``ApiException``, Monarch's ``KubernetesJob``) is the real
client. It answers as an API server does for the calls the launcher makes: MonarchMesh
create/get/patch/delete (409 on a second create, 404 ``Status`` objects naming a missing
namespace or, without the CRD, the resource), pod lists by label selector, and 403 for a
verb the test forbids. Creating a MonarchMesh also does the operator's part: one pod per
replica, labelled with its mesh and rank, in the state ``pod_status(name, rank)`` gives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import RESTResponse

MESHES = re.compile(r"^/apis/monarch\.pytorch\.org/v1alpha1/namespaces/([^/]+)/monarchmeshes(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
VERBS = {"POST": "create", "GET": "get", "PATCH": "patch", "DELETE": "delete"}
REASONS = {200: "OK", 201: "Created", 403: "Forbidden", 404: "Not Found", 409: "Conflict"}
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: fake, cluster: {server: "http://fake-apiserver.invalid"}}]
users: [{name: fake, user: {token: not-a-secret}}]
contexts: [{name: fake, context: {cluster: fake, user: fake}}]
current-context: fake
"""


def ready(name: str, rank: int) -> dict[str, Any]:
    return {"phase": "Running", "podIP": f"10.0.0.{rank + 1}", "conditions": [{"type": "Ready", "status": "True"}]}


class FakeApiServer:
    def __init__(self, namespaces: tuple[str, ...] = ("default",), crd: bool = True):
        self.namespaces, self.crd = set(namespaces), crd
        self.forbidden: set[str] = set()  # MonarchMesh verbs answered 403
        self.meshes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.pod_status: Callable[[str, int], dict[str, Any]] = ready

    def request(self, method, url, query_params=None, headers=None, body=None, post_params=None, **_) -> RESTResponse:
        path = urlparse(url).path
        self.calls.append((method, path))
        status, payload = self.answer(method, path, dict(query_params or []), body)
        raw = urllib3.HTTPResponse(
            body=json.dumps(payload).encode(), status=status, reason=REASONS[status], preload_content=True
        )
        response = RESTResponse(raw)
        if not 200 <= status <= 299:
            raise ApiException(http_resp=response)
        return response

    def answer(self, method: str, path: str, query: dict, body: Any) -> tuple[int, dict]:
        if match := PODS.match(path):
            return 200, {"apiVersion": "v1", "kind": "PodList", "items": self.list_pods(query.get("labelSelector", ""))}
        match = MESHES.match(path)
        if match is None or not self.crd:
            return status(404, "the server could not find the requested resource")
        namespace, name = match.groups()
        if namespace not in self.namespaces:
            return status(404, f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})
        if VERBS[method] in self.forbidden:
            return status(
                403,
                f'monarchmeshes.monarch.pytorch.org is forbidden: User "system:serviceaccount:{namespace}:runner" '
                f'cannot {VERBS[method]} resource "monarchmeshes" in API group "monarch.pytorch.org" in the namespace '
                f'"{namespace}"',
            )
        return self.mesh_call(method, name or body["metadata"]["name"], body)

    def mesh_call(self, method: str, name: str, body: Any) -> tuple[int, dict]:
        if method == "POST" and name in self.meshes:
            return status(409, f'monarchmeshes.monarch.pytorch.org "{name}" already exists')
        if method in ("POST", "PATCH"):
            self.meshes[name] = body
            self.operate(name, body)
            return (201 if method == "POST" else 200), body
        if name not in self.meshes:
            return status(404, f'monarchmeshes.monarch.pytorch.org "{name}" not found', {"name": name})
        if method == "DELETE":
            self.pods = {k: p for k, p in self.pods.items() if not k.startswith(f"{name}-")}
            return 200, self.meshes.pop(name)
        return 200, self.meshes[name]

    def operate(self, name: str, mesh: dict[str, Any]) -> None:
        """The operator's StatefulSet, as far as the launcher sees it: its pods."""
        for rank in range(mesh["spec"]["replicas"]):
            labels = {
                "app.kubernetes.io/name": "monarch-worker",
                "monarch.pytorch.org/mesh-name": name,
                "apps.kubernetes.io/pod-index": str(rank),
            }
            metadata = {"name": f"{name}-{rank}", "namespace": mesh["metadata"]["namespace"], "labels": labels}
            spec = mesh["spec"]["podTemplate"]["spec"]
            self.pods[metadata["name"]] = {"metadata": metadata, "spec": spec, "status": self.pod_status(name, rank)}

    def list_pods(self, selector: str) -> list[dict[str, Any]]:
        wanted = dict(pair.split("=", 1) for pair in selector.split(",") if pair)
        return [p for p in self.pods.values() if wanted.items() <= p["metadata"]["labels"].items()]


def status(code: int, message: str, details: dict | None = None) -> tuple[int, dict]:
    """The ``Status`` object an API server answers a refused request with."""
    reason = {403: "Forbidden", 404: "NotFound", 409: "AlreadyExists"}[code]
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return code, body | {"code": code} | ({"details": details} if details else {})
