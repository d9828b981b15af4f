"""Assembling a routing worker from the settings (services/main.py runs it)."""

from __future__ import annotations

import gc
import logging
from typing import Any

from sluice.services.routing.observability import RoutingMetrics, ServiceObjectives
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice.services.telemetry import serve_metrics

from sluice.config import Settings
from sluice.eventlog.kafka import KafkaEventLog
from sluice.router.factory import make_policy_from_config
from sluice.router.policy import RoutingPolicy
from sluice.router.registry import ReplicaRegistry

log = logging.getLogger(__name__)

DRAIN_S = 10.0   # on SIGTERM, how long runs in progress may take to finish before leases lapse


def registry_from_config(config: Settings) -> ReplicaRegistry:
    """[[replicas]], with the KV block size of [replica] (the local replicas' engine) for tables
    that do not give their own: reused prompt blocks × block size = cached prompt tokens; and
    whether the replica takes cache_salt_id ([replica] under the entry's own `replica` keys)."""
    tables = [{"block_size": config.replica.block_size,
               "cache_salt_id": config.replica_section_for(entry).cache_salt_id, **entry.as_table()}
              for entry in config.replicas]
    return ReplicaRegistry.from_config({"replicas": tables})


def policy_from_config(config: Settings) -> RoutingPolicy:
    return make_policy_from_config({"policy": config.routing.policy,
                                    "policy_options": config.routing.policy_options})


def build_worker(config: Settings, events: KafkaEventLog, sessions: Any,
                 owner: str | None = None) -> RoutingWorker:
    settings = WorkerSettings.from_config(config, owner or new_owner_id())
    return RoutingWorker(settings, sessions, events, policy_from_config(config),
                         registry_from_config(config), dsn=config.database.url,
                         metrics=RoutingMetrics(objectives=ServiceObjectives.from_config(config)))


def observe_routing_process(config: Settings, worker: RoutingWorker) -> None:
    """Once per routing process, after start-up: the /metrics endpoint and gc.freeze() (tracing is
    set up for every role by services/main.py).

    gc.freeze() moves everything start-up allocated (modules, tokenizers, the prefix index's
    first tables) out of the collector's sight: the router bench measured the cyclic GC adding
    ~40 us to the p99 of a routing decision, most of it re-scanning those long-lived objects."""
    port = config.routing.metrics_port
    if port:
        host = config.routing.listen.rsplit(":", 1)[0]
        serve_metrics(worker.metrics.registry, port, host)
    gc.collect()
    gc.freeze()
