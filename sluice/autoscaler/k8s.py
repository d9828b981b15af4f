"""KubernetesProvider: one pool's replicas are the pods of one Deployment (deploy/k8s/).

    start(pool)  raise the Deployment's replicas (scale subresource) to the replicas held + those
                 starting, then wait for a pod of its selector that is Ready (the readiness probe is
                 Triton's /v2/health/ready: the engine is loaded) and not yet held; hold it and return
                 <pod IP>:port as the replica. The autoscaler registers it warm (or serving).
    stop(name)   the replica was drained (no run QUEUED or RUNNING on it: the autoscaler only stops
                 drained replicas). Annotate its pod controller.kubernetes.io/pod-deletion-cost =
                 -2^31, scale the Deployment down by one, wait until that pod is terminating.
    list(pool)   the held pods still alive at the last listing (refresh(), once per tick).
    adopt(pool)  Ready pods nobody holds (the Deployment's initial replicas, an autoscaler restart,
                 a hand scale-up): held from now on; the autoscaler registers them with the state
                 their registry row has, else warm. The warm pool is therefore Ready pods not serving.

Which pod a scale-down removes is the ReplicaSet's choice, and it ranks readiness before the
deletion cost: a pod not yet Ready (a cold start under way) goes before the drained one. So stop()
first waits until every pod of the Deployment is Ready (no start in flight), and after the scale-down
checks that the pod removed is the drained one. Pods outlive the autoscaler (`outlives_autoscaler`):
its exit leaves them serving, and its successor adopts them.

Limits: a Deployment in a rollout has two ReplicaSets, and the scale-down is split between them;
scale in only between rollouts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sluice.autoscaler.k8s_api import KubeApi, KubeConflict, KubeError, KubeNotFound
from sluice.autoscaler.k8s_objects import DELETION_COST, MIN_DELETION_COST, Pod
from sluice.autoscaler.provider import OWNED_INFIX, ProviderError, ReplicaHandle

log = logging.getLogger("sluice.autoscaler.k8s")

CONFLICT_RETRIES = 8
ERR_NO_SELECTOR = ("deployment {deployment!r} reports no selector on its scale subresource; "
                   "set [autoscaler.kubernetes].selector")
ERR_CONFLICTS = "deployment {deployment!r}: its scale changed under every one of {tries} patches (409)"
ERR_NOT_READY = ("deployment {deployment!r}: no new Ready pod {seconds:.0f} s after scaling to {replicas}; "
                 "withdrew the start")
ERR_NOT_SETTLED = ("deployment {deployment!r}: pods {pods} not Ready after {seconds:.0f} s; a scale-down now "
                   "would remove one of them instead of the drained {pod}, so {pod} was not stopped")
ERR_WRONG_POD = ("deployment {deployment!r}: scaled down for {pod}, but it is still running after "
                 "{seconds:.0f} s (removed: {removed}); it is left for the autoscaler to adopt")


@dataclass(frozen=True, slots=True)
class PodTarget:
    """Where the pool's replicas are and what each one is."""

    deployment: str
    selector: str               # "" = the one the scale subresource reports
    grpc_port: int              # Triton's gRPC port on every pod
    metrics_port: int           # Triton's metrics port
    block_size: int             # KV tokens per block (the replicas' metrics report it too)
    kv_capacity_blocks: int


@dataclass(frozen=True, slots=True)
class _Held:
    handle: ReplicaHandle
    pod: str


class KubernetesProvider:
    outlives_autoscaler = True

    def __init__(self, api: KubeApi, target: PodTarget, *, start_timeout_s: float = 300.0,
                 poll_s: float = 2.0) -> None:
        self.api = api
        self.target = target
        self._start_timeout_s = start_timeout_s
        self._poll_s = poll_s
        self._selector = target.selector
        self._held: dict[str, _Held] = {}       # replica name -> its pod
        self._stopping: set[str] = set()        # replica names being stopped
        self._starting = 0
        self._pods: dict[str, Pod] = {}         # the last listing, by pod name

    # --- what the autoscaler reads ------------------------------------------------------------

    async def refresh(self, pool: str) -> None:
        await self._list()

    async def adopt(self, pool: str) -> list[ReplicaHandle]:
        """Hold the Ready pods nobody holds; none while a start waits (the pod may be the one it ordered)."""
        if self._starting:
            return []
        return [await self._hold(pool, pod) for pod in list(self._unheld())]

    def list(self, pool: str) -> list[ReplicaHandle]:
        return [held.handle for held in self._held.values()
                if held.handle.pool == pool and (pod := self._pods.get(held.pod)) is not None and pod.alive]

    # --- start --------------------------------------------------------------------------------

    async def start(self, pool: str) -> ReplicaHandle:
        self._starting += 1
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while True:
                # Re-asserted every poll: a scale-down by hand (or a withdrawn start) meanwhile is undone.
                await self._rescale(lambda replicas: max(replicas, self._wanted()))
                await self._list()
                pod = next(self._unheld(), None)
                if pod is not None:
                    return await self._hold(pool, pod)
                if time.monotonic() > deadline:
                    # The pod that never got Ready goes first on a scale-down (the ReplicaSet's ranking).
                    await self._rescale(lambda replicas: replicas - 1 if replicas >= self._wanted()
                                        else replicas)
                    raise ProviderError(ERR_NOT_READY.format(deployment=self.target.deployment,
                                                             seconds=self._start_timeout_s,
                                                             replicas=self._wanted()))
                await asyncio.sleep(self._poll_s)
        finally:
            self._starting -= 1

    def _wanted(self) -> int:
        """Pods the Deployment must have: those held (less those being stopped) and those starting."""
        return len(self._held) - len(self._stopping) + self._starting

    def _unheld(self) -> Iterator[Pod]:
        held = {held.pod for held in self._held.values()}
        return (pod for pod in self._pods.values() if pod.usable and pod.name not in held)

    async def _hold(self, pool: str, pod: Pod) -> ReplicaHandle:
        target = self.target
        handle = ReplicaHandle(name=f"{pool}{OWNED_INFIX}{pod.name}", pool=pool,
                               grpc_address=f"{pod.ip}:{target.grpc_port}",
                               metrics_url=f"http://{pod.ip}:{target.metrics_port}/metrics",
                               block_size=target.block_size, kv_capacity_blocks=target.kv_capacity_blocks)
        self._held[handle.name] = _Held(handle, pod.name)        # before any await: two starts, one pod
        if pod.deletion_cost is not None:
            # A stop that failed half-way left it cheapest: a scale-down could pick it over a drained pod.
            await self.api.annotate_pod(pod.name, {DELETION_COST: None})
        return handle

    # --- stop ---------------------------------------------------------------------------------

    async def stop(self, name: str) -> None:
        held = self._held.get(name)
        if held is None or name in self._stopping:
            return
        self._stopping.add(name)
        try:
            await self._stop(held)
        finally:
            self._stopping.discard(name)
            self._held.pop(name, None)

    async def _stop(self, held: _Held) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        await self._list()
        pod = self._pods.get(held.pod)
        if pod is None or not pod.alive:
            # Gone on its own (node loss, a hand delete): the ReplicaSet would replace it; it is not wanted.
            await self._rescale(lambda replicas: max(replicas - 1, 0))
            return
        await self._settle(held.pod, deadline)
        await self.api.annotate_pod(held.pod, {DELETION_COST: str(MIN_DELETION_COST)})
        try:
            await self._rescale(lambda replicas: max(replicas - 1, 0))
        except BaseException:
            await self._uncost(held.pod)
            raise
        await self._await_removal(held.pod, deadline)

    async def _settle(self, pod_name: str, deadline: float) -> None:
        """Until every other pod of the Deployment is Ready: only then is the drained pod the cheapest to
        remove (were it not Ready itself, it would rank first anyway)."""
        while not_ready := sorted(pod.name for pod in self._pods.values()
                                  if pod.alive and not pod.ready and pod.name != pod_name):
            if time.monotonic() > deadline:
                raise ProviderError(ERR_NOT_SETTLED.format(deployment=self.target.deployment, pods=not_ready,
                                                           seconds=self._start_timeout_s, pod=pod_name))
            await asyncio.sleep(self._poll_s)
            await self._list()

    async def _await_removal(self, pod_name: str, deadline: float) -> None:
        before = {name for name, pod in self._pods.items() if pod.alive}
        while True:
            await self._list()
            pod = self._pods.get(pod_name)
            if pod is None or not pod.alive:
                return
            if time.monotonic() > deadline:
                removed = sorted(before - {name for name, p in self._pods.items() if p.alive})
                await self._uncost(pod_name)
                raise ProviderError(ERR_WRONG_POD.format(deployment=self.target.deployment, pod=pod_name,
                                                         seconds=self._start_timeout_s, removed=removed))
            await asyncio.sleep(self._poll_s)

    async def _uncost(self, pod_name: str) -> None:
        try:
            await self.api.annotate_pod(pod_name, {DELETION_COST: None})
        except KubeNotFound:
            pass
        except KubeError as exc:
            log.error("could not remove the deletion cost of pod %s: %s", pod_name, exc)

    # --- the API ------------------------------------------------------------------------------

    async def _list(self) -> None:
        self._pods = {pod.name: pod for pod in await self.api.list_pods(await self._pod_selector())}

    async def _pod_selector(self) -> str:
        if not self._selector:
            scale = await self.api.get_scale(self.target.deployment)
            if not scale.selector:
                raise ProviderError(ERR_NO_SELECTOR.format(deployment=self.target.deployment))
            self._selector = scale.selector
        return self._selector

    async def _rescale(self, change: Callable[[int], int]) -> None:
        """Read the scale, patch spec.replicas to change(replicas) with the resourceVersion read;
        on 409 (someone wrote it since) read again and retry."""
        deployment = self.target.deployment
        for _ in range(CONFLICT_RETRIES):
            scale = await self.api.get_scale(deployment)
            replicas = change(scale.replicas)
            if replicas == scale.replicas:
                return
            try:
                await self.api.patch_scale(deployment, replicas, scale.resource_version)
            except KubeConflict:
                log.info("deployment %s: scale changed since read (409); reading it again", deployment)
                continue
            log.info("deployment %s: replicas %d -> %d", deployment, scale.replicas, replicas)
            return
        raise ProviderError(ERR_CONFLICTS.format(deployment=deployment, tries=CONFLICT_RETRIES))

    async def close(self) -> None:
        """Leaves every pod running (they outlive the autoscaler); closes the HTTP session."""
        await self.api.close()
