"""Assembling a routing process from config: the pieces __main__ and services/main.py share."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Mapping
from typing import Any

import grpc.aio
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.services import replica_client
from sluice.services.routing.observability import RoutingMetrics, ServiceObjectives
from sluice.services.routing.servicer import add_routing_servicer
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice.services.telemetry import TelemetrySettings, serve_metrics, setup_tracing, shutdown_tracing

from sluice.eventlog.kafka import KafkaEventLog
from sluice.router.policy import make_policy_from_config
from sluice.router.registry import ReplicaRegistry

log = logging.getLogger(__name__)

DRAIN_S = 10.0   # on SIGTERM, how long runs in progress may take to finish before leases lapse


def registry_from_config(config: Mapping[str, Any]) -> ReplicaRegistry:
    """[[replicas]], with the KV block size of [replica] (the local replicas' engine) for tables
    that do not give their own: reused prompt blocks × block size = cached prompt tokens."""
    block_size = config.get("replica", {}).get("block_size")
    tables = [dict(table) for table in config.get("replicas", [])]
    if block_size:
        for table in tables:
            table.setdefault("block_size", int(block_size))
    return ReplicaRegistry.from_config({"replicas": tables})


def build_worker(config: Mapping[str, Any], events: KafkaEventLog, sessions: Any,
                 owner: str | None = None) -> RoutingWorker:
    settings = WorkerSettings.from_config(config, owner or new_owner_id())
    return RoutingWorker(settings, sessions, events, make_policy_from_config(config["routing"]),
                         registry_from_config(config), dsn=str(config["database"]["dsn"]),
                         metrics=RoutingMetrics(objectives=ServiceObjectives.from_config(config)))


def observe_routing_process(config: Mapping[str, Any], worker: RoutingWorker) -> None:
    """Once per routing process, after start-up: tracing, the /metrics endpoint, and gc.freeze().

    gc.freeze() moves everything start-up allocated (modules, tokenizers, the prefix index's
    first tables) out of the collector's sight: the router bench measured the cyclic GC adding
    ~40 us to the p99 of a routing decision, most of it re-scanning those long-lived objects."""
    setup_tracing(TelemetrySettings.from_config(config), "sluice-routing")
    port = int(config["routing"].get("metrics_port", 0))
    if port:
        host = str(config["routing"].get("listen", "127.0.0.1")).rsplit(":", 1)[0]
        serve_metrics(worker.metrics.registry, port, host)
    gc.collect()
    gc.freeze()


async def run_routing_process(config: Mapping[str, Any], listen: str | None = None,
                              label: str | None = None) -> None:
    """One routing process until SIGTERM/SIGINT: worker loops, plus the Routing API if `listen`."""
    engine = make_engine(str(config["database"]["dsn"]))
    events = KafkaEventLog.from_config(config)
    await events.start()
    worker = build_worker(config, events, make_sessionmaker(engine), new_owner_id(label))
    server: grpc.aio.Server | None = None
    if listen:
        server = grpc.aio.server()
        add_routing_servicer(server, worker)
        server.add_insecure_port(listen)
        await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    observe_routing_process(config, worker)
    log.info("routing worker %s up (policy %s, replicas %s, api %s)", worker.settings.owner,
             worker.policy.name, [spec.name for spec in worker.registry.specs()], listen or "off")
    print(f"routing worker {worker.settings.owner} ready", flush=True)
    try:
        await worker.serve(drain_s=DRAIN_S)
    finally:
        if server is not None:
            await server.stop(grace=1.0)
        await events.close()
        await replica_client.close_channels()
        await engine.dispose()
        shutdown_tracing()
