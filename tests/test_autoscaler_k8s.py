"""The kubernetes provider against an in-process API server (tests/support/fake_kube.py) over HTTPS,
reached the way a pod reaches its API server: KUBERNETES_SERVICE_HOST/PORT and a service account
folder (token, ca.crt, namespace). The fake's controller deletes pods as the ReplicaSet ranks them
(not Ready first, then the lowest pod-deletion-cost, then the newest), so "the drained pod is the one
deleted" holds only because the provider annotated it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from sluice.ledger.replicas import ReplicaRepository
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.autoscaler.app import kubernetes_provider, pool_table, scaler_config
from sluice.autoscaler.control import ScalerConfig
from sluice.autoscaler.k8s import CONFLICT_RETRIES, ERR_CONFLICTS, KubernetesProvider, PodTarget
from sluice.autoscaler.k8s_api import (
    CALLS,
    ERR_FORBIDDEN,
    ERR_NO_FILE,
    ERR_NO_SERVER,
    ERR_UNAUTHORIZED,
    KubeAccess,
    KubeApi,
)
from sluice.autoscaler.k8s_objects import DELETION_COST, MIN_DELETION_COST, Pod, Scale
from sluice.autoscaler.provider import ProviderError
from sluice.autoscaler.service import LoopSettings, PoolAutoscaler
from sluice.config import load_settings
from sluice.config.settings import KubernetesSection
from sluice.router.registry import SERVING, WARM
from tests.support.fake_kube import FakeKube, server_ssl

pytest_plugins = ["tests.support.pki"]

NAMESPACE, DEPLOYMENT, POOL, TOKEN = "sluice", "llama-3-70b", "llama-3-70b", "sa-token-1"
LABELS = {"sluice.dev/pool": POOL}
SELECTOR = "sluice.dev/pool=llama-3-70b"
TARGET = PodTarget(deployment=DEPLOYMENT, selector="", grpc_port=8001, metrics_port=8002, block_size=32,
                   kv_capacity_blocks=4096)
MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "autoscaler.yaml"


@dataclass(slots=True)
class Cluster:
    fake: FakeKube
    provider: KubernetesProvider
    account: Path


def service_account(folder: Path, pki: Path, token: str = TOKEN) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "token").write_text(token + "\n")
    (folder / "ca.crt").write_bytes((pki / "ca.pem").read_bytes())
    (folder / "namespace").write_text(NAMESPACE)
    return folder


async def open_cluster(pki: Path, folder: Path, *, replicas: int = 0, ready_after_s: float | None = 0.1,
                       token: str = TOKEN) -> Cluster:
    fake = FakeKube(NAMESPACE, DEPLOYMENT, LABELS, TOKEN, replicas=replicas, ready_after_s=ready_after_s)
    url = await fake.start(server_ssl(pki))
    port = url.rsplit(":", 1)[1]
    account = service_account(folder, pki, token)
    access = KubeAccess.resolve(KubernetesSection(), {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                                      "KUBERNETES_SERVICE_PORT": port}, account)
    provider = KubernetesProvider(KubeApi(access), TARGET, start_timeout_s=5.0, poll_s=0.02)
    return Cluster(fake, provider, account)


@pytest.fixture
async def cluster(pki: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    opened = await open_cluster(pki, tmp_path / "sa")
    try:
        yield opened
    finally:
        await opened.provider.close()
        await opened.fake.close()


def replica_name(pod: str) -> str:
    return f"{POOL}-as-{pod}"


async def test_a_start_raises_the_deployments_replicas_and_returns_once_the_new_pod_is_ready(
        cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    fake.ready_after_s = None                     # the pod turns Ready when the test says
    start = asyncio.create_task(provider.start(POOL))
    await until(lambda: bool(fake.pods), "a pod ordered")
    (pod,) = fake.pods
    await asyncio.sleep(0.2)                      # ten polls: still loading, so start() still waits
    assert not start.done()
    fake.make_ready()
    handle = await asyncio.wait_for(start, 5)
    assert (handle.name, handle.pool) == (replica_name(pod), POOL)
    assert handle.grpc_address == f"{fake.pods[pod].ip}:8001"
    assert handle.metrics_url == f"http://{fake.pods[pod].ip}:8002/metrics"
    assert fake.scale_patches() == [1]
    # optimistic concurrency: the patch carries the resourceVersion of the scale it read
    (patch,) = fake.calls("PATCH", "scale")
    assert patch.body is not None and patch.body["metadata"]["resourceVersion"].isdigit()
    # the pods were found by the selector the scale subresource reports
    assert {r.query["labelSelector"] for r in fake.calls("GET", "pods")} == {SELECTOR}
    assert [h.name for h in provider.list(POOL)] == [handle.name]


async def test_two_starts_at_once_order_two_pods_and_get_one_each(cluster: Cluster):
    first, second = await asyncio.gather(cluster.provider.start(POOL), cluster.provider.start(POOL))
    assert first.name != second.name
    assert cluster.fake.replicas == 2 and len(cluster.fake.pods) == 2
    assert {h.name for h in cluster.provider.list(POOL)} == {first.name, second.name}


async def test_ready_pods_nobody_holds_are_adopted_without_scaling(pki: Path, tmp_path: Path):
    opened = await open_cluster(pki, tmp_path / "sa", replicas=2)     # a predecessor's pods
    try:
        provider, fake = opened.provider, opened.fake
        await provider.refresh(POOL)
        adopted = await provider.adopt(POOL)
        assert sorted(h.name for h in adopted) == sorted(replica_name(pod) for pod in fake.pods)
        assert await provider.adopt(POOL) == []                   # held now
        assert fake.scale_patches() == []
        third = await provider.start(POOL)                         # one more is a scale to 3
        assert fake.scale_patches() == [3] and third.name not in {h.name for h in adopted}
    finally:
        await opened.provider.close()
        await opened.fake.close()


async def test_a_stop_makes_the_drained_pod_cheapest_then_scales_down_by_one_so_exactly_it_is_deleted(
        cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    handles = [await provider.start(POOL) for _ in range(3)]
    drained = handles[1]                         # not the newest: the one a plain scale-down would take
    pod = drained.name.removeprefix(f"{POOL}-as-")
    before = len(fake.requests)
    await provider.stop(drained.name)
    writes = [(r.method, r.path.rsplit("/", 1)[1], r.body) for r in fake.requests[before:]
              if r.method == "PATCH"]
    assert writes[0] == ("PATCH", pod, {"metadata": {"annotations": {DELETION_COST: str(MIN_DELETION_COST)}}})
    assert writes[1][:2] == ("PATCH", "scale") and writes[1][2] is not None
    assert writes[1][2]["spec"] == {"replicas": 2} and len(writes) == 2
    assert fake.deleted == [pod] and fake.replicas == 2
    assert {h.name for h in provider.list(POOL)} == {handles[0].name, handles[2].name}
    await provider.stop(drained.name)            # idempotent: nothing more sent
    assert fake.scale_patches() == [1, 2, 3, 2]


async def test_a_stop_waits_for_a_cold_start_to_be_ready_since_a_scale_down_would_delete_that_pod_first(
        cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    first, second = [await provider.start(POOL) for _ in range(2)]
    fake.ready_after_s = None
    starting = asyncio.create_task(provider.start(POOL))
    await until(lambda: len(fake.pods) == 3, "a third pod ordered")
    stopping = asyncio.create_task(provider.stop(first.name))
    await asyncio.sleep(0.2)
    assert fake.scale_patches() == [1, 2, 3] and not stopping.done()    # no scale-down while one loads
    fake.make_ready()
    third = await asyncio.wait_for(starting, 5)
    await asyncio.wait_for(stopping, 5)
    assert fake.deleted == [first.name.removeprefix(f"{POOL}-as-")]
    assert {h.name for h in provider.list(POOL)} == {second.name, third.name}


async def test_a_conflicting_scale_write_is_read_again_and_retried(cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    fake.conflicts = 2                            # two other writers land between our read and write
    await provider.start(POOL)
    patches = fake.calls("PATCH", "scale")
    assert len(patches) == 3 and fake.replicas == 1
    versions = [r.body["metadata"]["resourceVersion"] for r in patches if r.body is not None]
    assert len(set(versions)) == 3               # each retry carries the version it read anew
    fake.conflicts = CONFLICT_RETRIES
    with pytest.raises(ProviderError) as exhausted:
        await provider.start(POOL)
    assert str(exhausted.value) == ERR_CONFLICTS.format(deployment=DEPLOYMENT, tries=CONFLICT_RETRIES)


async def test_a_forbidden_call_names_the_rbac_rule_the_service_account_lacks(cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    fake.forbid.add(("patch", "deployments/scale"))
    with pytest.raises(ProviderError) as refused:
        await provider.start(POOL)
    message = (f'deployments.apps "{DEPLOYMENT}" is forbidden: User "system:serviceaccount:{NAMESPACE}:'
               f'sluice-autoscaler" cannot patch resource "deployments/scale" in API group "apps" in the '
               f'namespace "{NAMESPACE}"')
    assert str(refused.value) == ERR_FORBIDDEN.format(verb="patch", resource="deployments/scale",
                                                      name=DEPLOYMENT, namespace=NAMESPACE, group="apps",
                                                      message=message)
    assert 'resources: ["deployments/scale"], verbs: ["patch"]' in str(refused.value)
    fake.forbid.clear()
    handle = await provider.start(POOL)
    fake.forbid.add(("patch", "pods"))
    with pytest.raises(ProviderError, match=r'apiGroups: \[""\], resources: \["pods"\], verbs: \["patch"\]'):
        await provider.stop(handle.name)
    assert fake.replicas == 1 and fake.deleted == []   # refused before any scale-down: nothing deleted


async def test_a_rejected_token_says_so(pki: Path, tmp_path: Path):
    opened = await open_cluster(pki, tmp_path / "sa", token="stale")
    try:
        with pytest.raises(ProviderError) as rejected:
            await opened.provider.start(POOL)
        assert str(rejected.value) == ERR_UNAUTHORIZED.format(token_file=opened.account / "token", verb="get",
                                                              resource="deployments/scale")
        (opened.account / "token").write_text(TOKEN)    # rotated: re-read on the next request
        await opened.provider.start(POOL)
    finally:
        await opened.provider.close()
        await opened.fake.close()


def test_access_outside_a_pod_needs_an_api_url_and_a_token(tmp_path: Path):
    with pytest.raises(ProviderError) as nowhere:
        KubeAccess.resolve(KubernetesSection(), {}, tmp_path)
    assert str(nowhere.value) == ERR_NO_SERVER
    explicit = KubernetesSection(api_url="https://k8s.example:6443/", token_file=str(tmp_path / "t"),
                                 namespace="prod")
    with pytest.raises(ProviderError) as tokenless:
        KubeAccess.resolve(explicit, {}, tmp_path)
    assert str(tokenless.value) == ERR_NO_FILE.format(what="token file", path=tmp_path / "t",
                                                      error="No such file or directory", key="token_file")
    (tmp_path / "t").write_text("x")
    access = KubeAccess.resolve(explicit, {}, tmp_path)
    assert (access.api_url, access.namespace, access.ca_file) == ("https://k8s.example:6443", "prod", None)


def test_pods_and_scales_read_as_the_api_server_writes_them():
    pod = Pod.of({"metadata": {"name": "p", "creationTimestamp": "2026-11-30T12:00:00Z",
                               "annotations": {DELETION_COST: "-5"},
                               "deletionTimestamp": "2026-11-30T12:01:00Z"},
                  "status": {"phase": "Running", "podIP": "10.1.2.3",
                             "conditions": [{"type": "PodScheduled", "status": "True"},
                                            {"type": "Ready", "status": "True"}]}})
    assert (pod.ip, pod.ready, pod.terminating, pod.deletion_cost) == ("10.1.2.3", True, True, -5)
    assert not pod.alive and not pod.usable                    # terminating: on its way out
    pending = Pod.of({"metadata": {"name": "q"}, "status": {"phase": "Pending"}})
    assert pending.alive and not pending.ready and not pending.usable
    scale = Scale.of({"metadata": {"resourceVersion": "42"}, "spec": {}, "status": {"selector": SELECTOR}})
    assert (scale.replicas, scale.selector, scale.resource_version) == (0, SELECTOR, "42")


def test_the_manifests_role_grants_exactly_the_calls_the_provider_makes():
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (role,) = [d for d in documents if d["kind"] == "Role"]
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {(call.group, call.resource, call.verb) for call in CALLS}
    (binding,) = [d for d in documents if d["kind"] == "RoleBinding"]
    (account,) = [d for d in documents if d["kind"] == "ServiceAccount"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}
    autoscaler = next(d for name, d in deployments.items() if name.startswith("sluice-autoscaler"))
    assert autoscaler["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    replicas = deployments[DEPLOYMENT]
    selector = replicas["spec"]["selector"]["matchLabels"]
    assert selector.items() <= replicas["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"]
             for p in replicas["spec"]["template"]["spec"]["containers"][0]["ports"]}
    defaults = KubernetesSection()
    assert (ports["grpc"], ports["metrics"]) == (defaults.port, defaults.metrics_port)


def test_the_manifests_configuration_makes_a_kubernetes_provider_for_the_pools_deployment(tmp_path: Path):
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    (tmp_path / "sluice.toml").write_text(config_map["data"]["sluice.toml"])
    config = load_settings(tmp_path / "sluice.toml", environ={})
    assert config.autoscaler.provider == "kubernetes"
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "namespace").write_text(NAMESPACE)
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    access = KubeAccess.resolve(config.autoscaler.kubernetes, in_pod, account)
    assert (access.api_url, access.namespace) == ("https://10.96.0.1:443", NAMESPACE)
    provider = kubernetes_provider(config, pool_table(config, POOL), POOL, access)
    assert provider.target == PodTarget(deployment=DEPLOYMENT, selector="", grpc_port=8001, metrics_port=8002,
                                        block_size=32, kv_capacity_blocks=20000)
    assert scaler_config(config, pool_table(config, POOL)).warm_pool == 2


FLOOR = ScalerConfig(runs_per_replica=4, min_replicas=1, max_replicas=3, warm_pool=1, ttft_slo_s=60.0,
                     cold_start_s=1.0, scale_out_cooldown_s=0.0, scale_in_cooldown_s=0.0)
FAST = LoopSettings(interval_s=0.1, window_s=5.0, slope_windows=3, drain_settle_s=0.0)


async def registry(sessionmaker: async_sessionmaker[AsyncSession]) -> dict[str, tuple[str, str, bool]]:
    async with sessionmaker() as session:
        return {row.name: (row.state, row.grpc_address, row.removed)
                for row in await ReplicaRepository(session).all()}


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        await asyncio.sleep(0.02)


@pytest.mark.integration
async def test_the_autoscaler_registers_pods_adopts_them_after_a_restart_and_deletes_exactly_the_drained_one(
        pki: Path, tmp_path: Path, sessionmaker: async_sessionmaker[AsyncSession]):
    opened = await open_cluster(pki, tmp_path / "sa", replicas=1)      # the manifest's initial replica
    fake = opened.fake
    try:
        # The pod already Ready is adopted and serves (min 1); one more is scaled up for the warm pool.
        first = PoolAutoscaler(POOL, FLOOR, opened.provider, sessionmaker, FAST)
        stopping = asyncio.Event()
        loop = asyncio.create_task(first.run(stopping))
        await until(lambda: [a for _, a, _ in first.actions] == ["adopt serving", "ready warm"],
                    "at the floor")
        stopping.set()
        await loop
        await first.close()
        await opened.provider.close()
        serving_pod, warm_pod = sorted(fake.pods)
        rows = await registry(sessionmaker)
        assert rows == {replica_name(serving_pod): (SERVING, f"{fake.pods[serving_pod].ip}:8001", False),
                        replica_name(warm_pod): (WARM, f"{fake.pods[warm_pod].ip}:8001", False)}
        assert fake.scale_patches() == [2] and fake.deleted == []       # its exit left both pods serving

        # Its successor (min 0, no warm pool) adopts both pods in their rows' states (by default they would
        # both be warm: it holds no serving floor). With no runs it drains the serving one and, drained,
        # stops it: its row is tombstoned and exactly its pod is deleted, though a plain scale-down would
        # take the newer one. The warm one is retired next.
        access = opened.provider.api.access
        provider = KubernetesProvider(KubeApi(access), TARGET, start_timeout_s=5.0, poll_s=0.02)
        second = PoolAutoscaler(POOL, dataclasses.replace(FLOOR, min_replicas=0, warm_pool=0), provider,
                                sessionmaker, FAST)
        await provider.refresh(POOL)
        await second.adopt()
        assert {name: m.state for name, m in second.members.items()} == {
            replica_name(serving_pod): SERVING, replica_name(warm_pod): WARM}
        await second.forget_predecessors()
        assert (await registry(sessionmaker)) == rows                   # nothing forgotten: all adopted
        await second.tick()
        assert [(action, name) for _, action, name in second.actions[-2:]] == [
            ("drain", replica_name(serving_pod)), ("drained, stop", replica_name(serving_pod))]
        await until(lambda: fake.deleted == [serving_pod], "the drained pod deleted")
        rows = await registry(sessionmaker)
        assert rows[replica_name(serving_pod)][2] and not rows[replica_name(warm_pod)][2]
        assert fake.scale_patches() == [2, 1] and list(fake.pods) == [warm_pod]
        await second.tick()
        await until(lambda: fake.deleted == [serving_pod, warm_pod], "the warm pod retired")
        assert fake.replicas == 0
        assert all(removed for _, _, removed in (await registry(sessionmaker)).values())
        await second.close()
        await provider.close()
    finally:
        await fake.close()


async def test_a_drained_pod_that_lost_its_readiness_is_stopped_without_waiting_for_itself(cluster: Cluster):
    fake, provider = cluster.fake, cluster.provider
    first, second = [await provider.start(POOL) for _ in range(2)]
    pod = first.name.removeprefix(f"{POOL}-as-")
    fake.pods[pod].ready = False
    await asyncio.wait_for(provider.stop(first.name), 2.0)
    assert fake.deleted == [pod] and [h.name for h in provider.list(POOL)] == [second.name]
