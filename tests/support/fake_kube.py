"""An in-process Kubernetes API server with exactly the endpoints the kubernetes provider calls, and a
ReplicaSet "controller" that creates and deletes pods when the scale changes.

    GET/PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (merge patch; a resourceVersion
                                                                        older than the scale's: 409)
    GET       /api/v1/namespaces/{ns}/pods?labelSelector=k=v[,k=v]
    PATCH     /api/v1/namespaces/{ns}/pods/{name}                      (merge patch of annotations)

The controller scales down as the ReplicaSet does (pkg/controller/replicaset getPodsToDelete, the
ranks that matter here): not Ready before Ready, then the lower pod-deletion-cost, then the newer
pod. A new pod is Pending without an IP, and turns Running and Ready `ready_after_s` later (or when
the test calls make_ready with `ready_after_s` None). Faults: `forbid` (verb, resource) pairs answer
403 with the API server's Status text, `conflicts` makes the next scale patches lose a race (another
writer bumps the resourceVersion first). Every request is recorded (`requests`), every deleted pod too.
Bearer token checked (401 otherwise); served over HTTPS when given a certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import ssl
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from sluice.autoscaler.k8s_objects import DELETION_COST
from sluice.autoscaler.local import READY_MARKER, spawn_replica

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
POD_PATH = "/api/v1/namespaces/{ns}/pods/{name}"
EPOCH = datetime(2026, 11, 30, tzinfo=UTC)


@dataclass(slots=True)
class FakePod:
    name: str
    labels: dict[str, str]
    created: int                               # creation order (sets creationTimestamp)
    ip: str = ""
    ready: bool = False
    annotations: dict[str, str] = field(default_factory=dict)
    resource_version: int = 0

    def body(self) -> dict[str, Any]:
        stamp = (EPOCH + timedelta(seconds=self.created)).strftime("%Y-%m-%dT%H:%M:%SZ")
        status: dict[str, Any] = {"phase": "Running" if self.ip else "Pending",
                                  "conditions": [{"type": "Ready", "status": str(self.ready)}]}
        if self.ip:
            status["podIP"] = self.ip
        return {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": self.name, "labels": self.labels, "annotations": self.annotations,
                             "creationTimestamp": stamp, "resourceVersion": str(self.resource_version)},
                "status": status}

    def rank(self) -> tuple[int, int, int]:
        """Deleted first when smallest: not Ready, cheapest, newest."""
        return (int(self.ready), int(self.annotations.get(DELETION_COST, "0")), -self.created)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: dict[str, Any] | None


class Kubelet(Protocol):
    """Runs the fake's pods for real: told when one is created or deleted; calls FakeKube.set_ready."""

    def created(self, fake: FakeKube, pod: FakePod) -> None: ...
    def deleted(self, pod: FakePod) -> None: ...


class FakeKube:
    def __init__(self, namespace: str, deployment: str, labels: dict[str, str], token: str, *,
                 replicas: int = 0, ready_after_s: float | None = 0.2,
                 pod_ips: list[str] | None = None, kubelet: Kubelet | None = None) -> None:
        self.namespace, self.deployment, self.labels, self.token = namespace, deployment, labels, token
        self.ready_after_s = ready_after_s
        self.pod_ips = pod_ips                 # given: the pods' IPs in creation order
        self.kubelet = kubelet                 # given: pods are processes, Ready when it says
        self.pods: dict[str, FakePod] = {}
        self.deleted: list[str] = []
        self.requests: list[Request] = []
        self.forbid: set[tuple[str, str]] = set()    # (RBAC verb, resource) answered 403
        self.conflicts = 0                     # scale patches still to lose a race
        self.replicas = 0
        self._version = itertools.count(1)
        self.scale_version = next(self._version)
        self._created = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._set_replicas(replicas, ready_now=True)

    # --- the server ---------------------------------------------------------------------------

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> str:
        app = web.Application()
        app.router.add_route("*", SCALE_PATH.format(ns="{ns}", name="{name}"), self._scale)
        app.router.add_get(PODS_PATH.format(ns="{ns}"), self._list_pods)
        app.router.add_patch(POD_PATH.format(ns="{ns}", name="{name}"), self._patch_pod)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def calls(self, method: str, kind: str) -> list[Request]:
        """Recorded requests of one kind: 'scale', 'pods' (the listing) or 'pod' (one pod)."""
        return [r for r in self.requests if r.method == method and _kind(r.path) == kind]

    def scale_patches(self) -> list[int]:
        return [r.body["spec"]["replicas"] for r in self.calls("PATCH", "scale") if r.body is not None]

    def make_ready(self) -> None:
        for pod in self.pods.values():
            self._ready(pod)

    # --- handlers -----------------------------------------------------------------------------

    async def _record(self, request: web.Request, verb: str, resource: str, name: str) -> web.Response | None:
        body = await request.json() if request.can_read_body else None
        self.requests.append(Request(request.method, request.path, dict(request.query), body))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if request.match_info["ns"] != self.namespace:
            return _status(404, "NotFound", f"namespace {request.match_info['ns']!r} not found")
        if (verb, resource) in self.forbid:
            group = "apps" if resource.startswith("deployments") else ""
            return _status(403, "Forbidden",
                           f'{resource.split("/")[0]}{".apps" if group else ""} "{name}" is forbidden: '
                           f'User "system:serviceaccount:{self.namespace}:sluice-autoscaler" cannot {verb} '
                           f'resource "{resource}" in API group "{group}" in the namespace '
                           f'"{self.namespace}"')
        return None

    async def _scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        verb = {"GET": "get", "PATCH": "patch"}.get(request.method, request.method.lower())
        refused = await self._record(request, verb, "deployments/scale", name)
        if refused is not None:
            return refused
        if name != self.deployment:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "PATCH":
            body = self.requests[-1].body or {}
            if self.conflicts > 0:
                self.conflicts -= 1
                self.scale_version = next(self._version)      # another writer got there first
            wanted = body.get("metadata", {}).get("resourceVersion")
            if wanted is not None and wanted != str(self.scale_version):
                return _status(409, "Conflict",
                               f'Operation cannot be fulfilled on deployments.apps "{name}": '
                                                "the object has been modified; please apply your changes to "
                                                "the latest version and try again")
            self._set_replicas(int(body["spec"]["replicas"]))
        elif request.method != "GET":
            return _status(405, "MethodNotAllowed", request.method)
        return web.json_response(self._scale_body())

    async def _list_pods(self, request: web.Request) -> web.Response:
        refused = await self._record(request, "list", "pods", "")
        if refused is not None:
            return refused
        terms = request.query.get("labelSelector", "").split(",")
        wanted = dict(term.split("=", 1) for term in terms if term)
        items = [pod.body() for pod in self.pods.values()
                 if all(pod.labels.get(key) == value for key, value in wanted.items())]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": items,
                                  "metadata": {"resourceVersion": str(next(self._version))}})

    async def _patch_pod(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        refused = await self._record(request, "patch", "pods", name)
        if refused is not None:
            return refused
        pod = self.pods.get(name)
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        body = self.requests[-1].body or {}
        for key, value in (body.get("metadata", {}).get("annotations") or {}).items():
            if value is None:
                pod.annotations.pop(key, None)
            else:
                pod.annotations[key] = str(value)
        pod.resource_version = next(self._version)
        return web.json_response(pod.body())

    # --- the controller -----------------------------------------------------------------------

    def _scale_body(self) -> dict[str, Any]:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": self.deployment, "namespace": self.namespace,
                             "resourceVersion": str(self.scale_version)},
                "spec": {"replicas": self.replicas},
                "status": {"replicas": len(self.pods),
                           "selector": ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))}}

    def _set_replicas(self, replicas: int, ready_now: bool = False) -> None:
        self.replicas = replicas
        self.scale_version = next(self._version)
        while len(self.pods) < replicas:
            created = next(self._created)
            pod = FakePod(name=f"{self.deployment}-7f9c-{created:05d}", labels=dict(self.labels),
                          created=created,
                          resource_version=next(self._version))
            self.pods[pod.name] = pod
            if self.kubelet is not None:
                self.kubelet.created(self, pod)
            elif ready_now:
                self._ready(pod)
            elif self.ready_after_s is not None:
                asyncio.get_running_loop().call_later(self.ready_after_s, self._ready, pod)
        while len(self.pods) > replicas:
            victim = min(self.pods.values(), key=FakePod.rank)
            del self.pods[victim.name]
            self.deleted.append(victim.name)
            if self.kubelet is not None:
                self.kubelet.deleted(victim)

    def set_ready(self, pod: FakePod) -> None:
        self._ready(pod)

    def _ready(self, pod: FakePod) -> None:
        if pod.name not in self.pods or pod.ready:
            return
        pod.ip = pod.ip or (self.pod_ips[pod.created - 1] if self.pod_ips else f"127.0.1.{pod.created}")
        pod.ready = True
        pod.resource_version = next(self._version)


def _kind(path: str) -> str:
    if path.endswith("/scale"):
        return "scale"
    return "pods" if path.endswith("/pods") else "pod"


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def server_ssl(pki: Path) -> ssl.SSLContext:
    """An HTTPS context for the fake from tests.support.pki's folder (server.pem for 127.0.0.1)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(pki / "server.pem"), str(pki / "server.key"))
    return context



class ProcessKubelet:
    """Each pod is a real `python -m sluice.replica.serve` on its own loopback address (127.0.1.N, the
    pod IP) and the Deployment's fixed ports, reported Ready once it printed its ready line (the
    readiness probe); a deleted pod's process group gets SIGTERM, then SIGKILL."""

    def __init__(self, pool: str, replica: dict[str, Any], ports: tuple[int, int, int],
                 log_dir: Path) -> None:
        self.pool, self.replica, self.log_dir = pool, replica, log_dir
        self.grpc_port, self.http_port, self.metrics_port = ports
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._probes: set[asyncio.Task[None]] = set()
        self._ended: list[subprocess.Popen[bytes]] = []        # deleted pods' processes, reaped at close

    def created(self, fake: FakeKube, pod: FakePod) -> None:
        pod.ip = f"127.0.1.{pod.created}"
        entry = {"name": pod.name, "pool": self.pool, "grpc_address": f"{pod.ip}:{self.grpc_port}",
                 "http_port": self.http_port, "metrics_port": self.metrics_port, "replica": self.replica}
        env = {**os.environ, "SLUICE_REPLICAS": json.dumps([entry]),
               "SLUICE_TLS__PLAINTEXT_OFF_LOOPBACK": "true"}    # 127.0.1.N: loopback, not in the list
        log_path = self.log_dir / f"pod-{pod.name}.log"
        self.processes[pod.name] = spawn_replica(pod.name, env, log_path)
        probe = asyncio.get_running_loop().create_task(self._probe(fake, pod, log_path))
        self._probes.add(probe)
        probe.add_done_callback(self._probes.discard)

    async def _probe(self, fake: FakeKube, pod: FakePod, log_path: Path) -> None:
        while pod.name in self.processes:
            if READY_MARKER in await asyncio.to_thread(log_path.read_text, errors="replace"):
                fake.set_ready(pod)
                return
            await asyncio.sleep(0.1)

    def deleted(self, pod: FakePod) -> None:
        process = self.processes.pop(pod.name, None)
        if process is not None:
            self._ended.append(process)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)

    async def close(self) -> None:
        for task in list(self._probes):
            task.cancel()
        self._ended.extend(self.processes.values())
        self.processes.clear()
        for process in self._ended:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait)
