"""The kubernetes provider end to end: the fake API server's pods are real replicas (ProcessKubelet:
`sluice.replica.serve` on the pod's loopback IP 127.0.1.N and the Deployment's fixed ports), a real
routing worker follows the durable registry, runs go through Admission. A pool at zero replicas with
min_replicas 1: the autoscaler scales the Deployment to one, the pod's replica is registered serving
at <pod IP>:port, and a run submitted then completes on it with every token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sluice.ledger.models import RunStatus
from sluice.services.routing.registry_sync import follow_durable_registry
from sluice_client.sdk import SluiceClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.autoscaler.control import ScalerConfig
from sluice.autoscaler.k8s import KubernetesProvider, PodTarget
from sluice.autoscaler.k8s_api import KubeAccess, KubeApi
from sluice.autoscaler.local import free_ports
from sluice.autoscaler.service import LoopSettings, PoolAutoscaler
from sluice.config.settings import KubernetesSection
from sluice.router.registry import SERVING
from tests.support.fake_kube import FakeKube, ProcessKubelet, server_ssl
from tests.support.routing_stack import MODEL, open_stack

pytestmark = pytest.mark.integration
pytest_plugins = ["tests.support.pki"]

NAMESPACE, TOKEN = "sluice", "sa-token"
POOL = MODEL.version
REPLICA = {"engine": "simple", "token_delay_ms": 20}
SCALER = ScalerConfig(runs_per_replica=4, min_replicas=1, max_replicas=1, warm_pool=0, ttft_slo_s=60.0,
                      cold_start_s=6.0, scale_out_cooldown_s=1.0, scale_in_cooldown_s=60.0)
LOOP = LoopSettings(interval_s=0.5, window_s=5.0, slope_windows=3, drain_settle_s=1.0)
TOKENS = 40


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s:.0f} s"
        await asyncio.sleep(0.05)


async def test_a_scale_out_on_kubernetes_registers_the_new_pod_and_a_run_completes_on_it(
        database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], tmp_path: Path, pki: Path):
    grpc_port, http_port, metrics_port = free_ports(3)
    kubelet = ProcessKubelet(POOL, REPLICA, (grpc_port, http_port, metrics_port), tmp_path)
    fake = FakeKube(NAMESPACE, POOL, {"sluice.dev/pool": POOL}, TOKEN, kubelet=kubelet)
    url = await fake.start(server_ssl(pki))
    (tmp_path / "token").write_text(TOKEN)
    access = KubeAccess.resolve(KubernetesSection(api_url=url, token_file=str(tmp_path / "token"),
                                                  ca_file=str(pki / "ca.pem"), namespace=NAMESPACE), {})
    target = PodTarget(deployment=POOL, selector="", grpc_port=grpc_port, metrics_port=metrics_port,
                       block_size=32, kv_capacity_blocks=4096)
    provider = KubernetesProvider(KubeApi(access), target, start_timeout_s=60.0, poll_s=0.1)
    stopping = asyncio.Event()
    try:
        async with open_stack(database_dsn, sessionmaker, [], tmp_path) as stack:
            worker = await stack.start_worker()
            sync = await follow_durable_registry(worker.registry, sessionmaker, database_dsn,
                                                 worker.replicas_changed)
            autoscaler = PoolAutoscaler(POOL, SCALER, provider, sessionmaker, LOOP)
            loop = asyncio.create_task(autoscaler.run(stopping))
            try:
                await until(lambda: [m.state for m in autoscaler.members.values()] == [SERVING], "serving")
                (pod,) = fake.pods
                (name,) = autoscaler.members
                assert name == f"{POOL}-as-{pod}" and fake.scale_patches() == [1]
                assert autoscaler.members[name].handle.grpc_address == f"127.0.1.1:{grpc_port}"
                await until(lambda: {v.name for v in worker.registry.views(POOL, time.time())} == {name},
                            "routed", timeout_s=10.0)
                async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
                    run_id = (await sdk.submit("hello", max_output_tokens=TOKENS)).run_id
                row = await stack.wait_for_status(run_id, {RunStatus.COMPLETED.value}, timeout_s=60.0)
                assert (row.replica, row.output_tokens) == (name, TOKENS)
            finally:
                stopping.set()
                await loop
                await autoscaler.close()
                await sync.close()
    finally:
        await provider.close()
        await kubelet.close()
        await fake.close()
