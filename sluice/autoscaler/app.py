"""The autoscaler process: `python -m sluice.autoscaler --pool P` (or sluice.services.main --role
autoscaler --pool P), one per pool, bootstrapped like every role (sluice.config.bootstrap).

It needs PostgreSQL only (the ledger and the replica registry), not Kafka. On SIGTERM it drains its
replicas (bounded by [autoscaler].stop_grace_s x 3) and stops them, so its exit interrupts no run
that could finish in that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from sluice.autoscaler.control import ScalerConfig
from sluice.autoscaler.k8s import KubernetesProvider, PodTarget
from sluice.autoscaler.k8s_api import KubeAccess, KubeApi
from sluice.autoscaler.local import LocalProcessProvider
from sluice.autoscaler.provider import DEFAULT_KV_BLOCKS, Provider, replica_section
from sluice.autoscaler.service import LoopSettings, PoolAutoscaler
from sluice.config import Settings
from sluice.config.settings import AutoscalerPoolTable, ConfigError
from sluice.ledger.db import make_engine, make_sessionmaker

log = logging.getLogger("sluice.autoscaler")

ERR_NO_POOL = "no [autoscaler.pools.{pool}] table in the configuration (pools configured: {known})"


def pool_table(config: Settings, pool: str) -> AutoscalerPoolTable:
    table = config.autoscaler.pools.get(pool)
    if table is None:
        raise ConfigError(ERR_NO_POOL.format(pool=pool, known=", ".join(config.autoscaler.pools) or "none"))
    return table


def scaler_config(config: Settings, table: AutoscalerPoolTable) -> ScalerConfig:
    """The pool's table as the control law takes it; the TTFT objective is [telemetry]'s."""
    knobs = table.model_dump(exclude={"replica"})
    return ScalerConfig(**knobs, ttft_slo_s=config.telemetry.ttft_slo_ms / 1000.0)


def loop_settings(config: Settings) -> LoopSettings:
    section = config.autoscaler
    return LoopSettings(interval_s=section.interval_s, window_s=section.window_s,
                        slope_windows=section.slope_windows, drain_settle_s=section.drain_settle_s)


def local_provider(config: Settings, table: AutoscalerPoolTable) -> LocalProcessProvider:
    section = config.autoscaler
    return LocalProcessProvider(config, table.replica, config.data_dir() / "logs" / "autoscaler",
                                start_timeout_s=section.start_timeout_s, stop_grace_s=section.stop_grace_s)


def kubernetes_provider(config: Settings, table: AutoscalerPoolTable, pool: str,
                        access: KubeAccess | None = None) -> KubernetesProvider:
    """The pool's Deployment ([autoscaler.kubernetes]); its replicas' KV geometry from the pool's
    replica keys."""
    section = config.autoscaler
    k8s = section.kubernetes
    replica = replica_section(config, table.replica)
    target = PodTarget(deployment=k8s.deployment.replace("{pool}", pool), selector=k8s.selector,
                       grpc_port=k8s.port, metrics_port=k8s.metrics_port, block_size=replica.block_size,
                       kv_capacity_blocks=replica.num_blocks or DEFAULT_KV_BLOCKS)
    api = KubeApi(access or KubeAccess.resolve(k8s))
    return KubernetesProvider(api, target, start_timeout_s=section.start_timeout_s, poll_s=k8s.poll_s)


def make_provider(config: Settings, table: AutoscalerPoolTable, pool: str) -> Provider:
    if config.autoscaler.provider == "kubernetes":
        return kubernetes_provider(config, table, pool)
    return local_provider(config, table)


async def serve(config: Settings, pool: str) -> None:
    table = pool_table(config, pool)
    scaler = scaler_config(config, table)
    engine = make_engine(config.database.url)
    provider = make_provider(config, table, pool)
    autoscaler = PoolAutoscaler(pool, scaler, provider, make_sessionmaker(engine), loop_settings(config))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stopping.set)
    print(f"autoscaler {pool} ready (min {scaler.min_replicas}, max {scaler.max_replicas}, "
          f"warm pool {scaler.warm_pool})", flush=True)
    try:
        await autoscaler.run(stopping)
    finally:
        await autoscaler.close(drain_timeout_s=config.autoscaler.stop_grace_s * 3)
        await provider.close()
        await engine.dispose()
