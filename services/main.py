"""`python -m sluice.services.main`: Sluice's gateway services, one process, several instances allowed.

Roles (each process may take several):

    gateway   Admission, Runs, UsageService and Admin on every address in --listen
              (default: [admission].listen, [runs].listen, [usage].listen), and the
              HTTP edge (seed 002's REST + SSE API and the OpenAI-compatible API over
              the same services) on [http].listen unless [http].enabled is false;
              stateless, so run as many instances as you like on other ports.
    routing   a routing worker (claims accepted runs, drives replicas, reaps
              expired leases) and, with --routing-api, the Routing API on
              [routing].listen. Several routing processes share the work.
    autoscaler  one pool's autoscaler (--pool P; sluice.autoscaler): a role of its own, taken
              alone; the same process as `python -m sluice.autoscaler --pool P`.

`--role all` (the default) is the all-in-one development process: gateway +
routing worker + Routing API. Replicas are separate processes
(`python -m sluice.replica.serve --name r0`). Every role starts through
sluice.config.bootstrap.start_process: a bad configuration stops it before it binds anything.

A box scales its gateway by processes: with [gateway].reuse_port = true several gateway
processes listen on the same address (SO_REUSEPORT) and the kernel spreads new connections
over them; false (the default) makes a second process on a taken port fail at start instead.
The process runs on [gateway].event_loop (uvloop unless set to asyncio). [gateway].grpc_server
picks what serves the gateway's gRPC: h2 (the default: services/h2server.py, gRPC over Sluice's own
HTTP/2 on the event loop, plaintext only: with [tls] on the gateway serves grpc.aio) or aio. The
Routing API stays on grpc.aio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import grpc.aio
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.pg import HotPool
from sluice.services import eventloop, replica_client
from sluice.services.admin_servicer import add_admin_servicer
from sluice.services.admission import add_admission_servicer
from sluice.services.admitted_here import RecentAdmissions
from sluice.services.canary_guard import CanaryGuard
from sluice.services.edge.server import EdgeServer
from sluice.services.edge.settings import HttpSettings
from sluice.services.edge.templates import ModelCards
from sluice.services.edge.web import EdgeServices
from sluice.services.gateway_metrics import GatewayMetrics
from sluice.services.h2server import H2Server
from sluice.services.operability import DependencyMonitor, add_operability, kafka_probe, postgres_probe
from sluice.services.routing.app import DRAIN_S, build_worker, observe_routing_process
from sluice.services.routing.registry_sync import follow_durable_registry
from sluice.services.routing.servicer import add_routing_servicer
from sluice.services.routing.worker import new_owner_id
from sluice.services.runs import add_runs_servicer
from sluice.services.telemetry import TelemetrySettings, serve_metrics, setup_telemetry, shutdown_tracing
from sluice.services.usage import add_usage_servicer

from sluice.config import Settings
from sluice.config.bootstrap import start_process
from sluice.config.settings import LOOPBACK_HOSTS, GatewaySection, ReplicaTlsSection, TlsSection
from sluice.eventlog.kafka import KafkaEventLog, configured_bootstrap
from sluice.v1 import admin_pb2, admission_pb2, routing_pb2, runs_pb2, usage_pb2

log = logging.getLogger("sluice")

ROLES = ("all", "gateway", "routing", "autoscaler")


def gateway_addresses(config: Settings) -> list[str]:
    """The configured per-service addresses, deduplicated in order."""
    addresses = [config.admission.listen, config.runs.listen, config.usage.listen]
    return list(dict.fromkeys(addresses))


GATEWAY_SERVICES = tuple(module.DESCRIPTOR.services_by_name[name].full_name for module, name in (
    (admission_pb2, "Admission"), (runs_pb2, "Runs"), (usage_pb2, "UsageService"), (admin_pb2, "Admin")))
ROUTING_SERVICES = (routing_pb2.DESCRIPTOR.services_by_name["Routing"].full_name,)


async def drain(monitor: DependencyMonitor) -> None:
    """Health NOT_SERVING everywhere before the servers stop, so balancers stop sending new work."""
    await monitor.stop()
    for server in monitor.servers:
        await server.drain()


def grpc_server(reuse_port: bool) -> grpc.aio.Server:
    """A gRPC server whose listening sockets are shared with other processes only when asked:
    gRPC sets SO_REUSEPORT by default, which would let a second process bind a taken port silently."""
    return grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])


def gateway_server(gateway: GatewaySection, tls: TlsSection) -> grpc.aio.Server:
    """The gateway's gRPC server, as [gateway].grpc_server says; grpc.aio whenever TLS is on. An
    H2Server offers what grpc.aio.Server's callers here use (registration, ports, start, stop)."""
    if gateway.grpc_server == "h2" and not tls.enabled:
        return cast(grpc.aio.Server, H2Server(reuse_port=gateway.reuse_port))
    return grpc_server(gateway.reuse_port)


PLAINTEXT_OFF_LOOPBACK = ("refusing plaintext gRPC on {address}: configure [tls] cert_file/key_file"
                          " (or set [tls].plaintext_off_loopback = true to accept the risk)")


def server_credentials(tls: TlsSection) -> grpc.ServerCredentials | None:
    """TLS (mutual when a client CA is configured) from [tls]; None for plaintext."""
    if not tls.enabled:
        return None
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)


def replica_credentials(section: ReplicaTlsSection) -> grpc.ChannelCredentials | None:
    """How this process connects to Triton replicas ([replica_tls]): TLS verifying ca_file, with a
    client certificate for mutual TLS; None for plaintext."""
    if not section.ca_file:
        return None
    client_key = Path(section.client_key_file).read_bytes() if section.client_key_file else None
    client_chain = Path(section.client_cert_file).read_bytes() if section.client_cert_file else None
    return grpc.ssl_channel_credentials(Path(section.ca_file).read_bytes(), client_key, client_chain)


def _bind(server: grpc.aio.Server, addresses: Sequence[str], tls: TlsSection) -> None:
    credentials = server_credentials(tls)
    for address in addresses:
        if credentials is None and address.rpartition(":")[0] not in LOOPBACK_HOSTS \
                and not tls.plaintext_off_loopback:
            raise SystemExit(PLAINTEXT_OFF_LOOPBACK.format(address=address))
        try:
            bound = (server.add_insecure_port(address) if credentials is None
                     else server.add_secure_port(address, credentials))
        except RuntimeError:          # recent grpc raises where older versions returned 0
            bound = 0
        if bound == 0:
            raise SystemExit(f"cannot listen on {address}: the port is taken or the address is invalid")


async def serve(config: Settings, roles: set[str], listen: Sequence[str],
                routing_listen: str | None = None, label: str | None = None) -> None:
    """Serve `roles` until SIGTERM/SIGINT: the gateway on `listen`; a routing worker (owner id
    labelled `label`) with the Routing API on `routing_listen` when one is given."""
    replica_client.use_tls(replica_credentials(config.replica_tls))
    engine = make_engine(config.database.url)
    sessions = make_sessionmaker(engine)
    events = KafkaEventLog.from_config(config)
    await events.start()
    servers: list[grpc.aio.Server] = []
    runs_service = None
    admission = None
    edge: EdgeServer | None = None
    worker = build_worker(config, events, sessions, new_owner_id(label)) if "routing" in roles else None
    gateway_metrics = GatewayMetrics() if "gateway" in roles else None
    registries = [metrics.registry for metrics in (gateway_metrics, worker and worker.metrics) if metrics]
    # Before any server: a Submit's span (and the traceparent its run row keeps) needs the tracer.
    setup_telemetry(TelemetrySettings.from_config(config), "sluice-" + "+".join(sorted(roles)), registries)
    registry_sync = None
    # One pool of raw asyncpg connections for the gateway's hot statements (Admission, Runs), opened
    # on first use; the routing worker keeps its own (worker.pool).
    hot = HotPool(config.database.url) if "gateway" in roles else None
    # grpc.health.v1 of every server here follows PostgreSQL and Kafka, and turns NOT_SERVING on drain.
    probed = hot or (worker.pool if worker is not None else HotPool(config.database.url))
    monitor = DependencyMonitor({"postgresql": postgres_probe(probed),
                                 "kafka": kafka_probe(configured_bootstrap(config.kafka))})
    try:
        if worker is not None:
            registry_sync = await follow_durable_registry(worker.registry, sessions, config.database.url,
                                                          worker.replicas_changed)
        if "gateway" in roles:
            gateway = gateway_server(config.gateway, config.tls)
            # The runs this process admits land on partitions its live tail follows (and only those
            # and the ones its streams read are fetched): each gateway reads its own runs' events.
            run_ids = await events.home_run_ids(config.gateway.event_partitions)
            # A run's first Stream, right after its Submit here, skips the ledger lookup.
            admitted = RecentAdmissions()
            admission = add_admission_servicer(gateway, sessions, config, gateway_metrics, hot, run_ids,
                                               admitted)
            runs_service = add_runs_servicer(gateway, sessions, config, events, hot, admitted)
            usage = add_usage_servicer(gateway, sessions, config)
            add_admin_servicer(gateway, sessions, config)
            monitor.servers.append(add_operability(gateway, GATEWAY_SERVICES))
            _bind(gateway, listen, config.tls)
            await gateway.start()
            servers.append(gateway)
            if config.gateway.metrics_port and gateway_metrics is not None:
                serve_metrics(gateway_metrics.registry, config.gateway.metrics_port,
                              config.admission.listen.rpartition(":")[0])
            http = HttpSettings.from_config(config)
            if http.enabled:
                edge = EdgeServer(EdgeServices(admission, runs_service, usage, sessions,
                                               ModelCards(sessions, http.model_card_ttl_s), http))
                await edge.start()
                print(f"HTTP edge (seed 002 + OpenAI API) listening on {edge.address}", flush=True)
            # What start-up allocated (modules, protobuf descriptors, tokenizers, SQLAlchemy's
            # metadata) never dies: frozen, the collector's full passes stop walking it on every
            # Submit-driven collection, as in the routing process (services/routing/app.py).
            gc.collect()
            gc.freeze()
            # Printed once every door is open: the demo and tests wait for this line.
            print(f"gateway (admission, runs, usage) listening on {', '.join(listen)}", flush=True)
        if worker is not None and routing_listen:
            api = grpc_server(reuse_port=False)
            add_routing_servicer(api, worker)
            monitor.servers.append(add_operability(api, ROUTING_SERVICES))
            _bind(api, [routing_listen], config.tls)
            await api.start()
            servers.append(api)
        await monitor.probe_once()
        monitor.start()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stopping.set)
        if worker is not None:
            observe_routing_process(config, worker)   # /metrics, gc.freeze()
            log.info("routing worker %s up (policy %s, replicas %s, api %s)", worker.settings.owner,
                     worker.policy.name, [spec.name for spec in worker.registry.specs()],
                     routing_listen or "off")
            print(f"routing worker {worker.settings.owner} ready (policy {worker.policy.name})", flush=True)
            serving = asyncio.create_task(worker.serve(drain_s=DRAIN_S))
            guarding = None
            if config.routing.canary_check_interval_s > 0:
                # Judges active canaries and rolls a breaching one back (services/canary_guard.py).
                guard = CanaryGuard(sessions, config.routing.canary_check_interval_s, worker.metrics.registry)
                guarding = asyncio.create_task(guard.serve(stopping))
            await stopping.wait()
            await drain(monitor)
            worker.stop()
            await serving           # serve() drains runs in progress before returning
            if guarding is not None:
                await guarding
        else:
            await stopping.wait()
            await drain(monitor)
    finally:
        await monitor.stop()
        if edge is not None:
            await edge.stop()
        if registry_sync is not None:
            await registry_sync.close()
        for server in servers:
            await server.stop(grace=1.0)
        if runs_service is not None:
            await runs_service.close()
        if admission is not None:
            await admission.close()
        await probed.close()
        await events.close()
        await replica_client.close_channels()
        await engine.dispose()
        shutdown_tracing()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.services.main", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", action="append", choices=ROLES,
                        help="what this process serves (repeatable; default all)")
    parser.add_argument("--listen", action="append", default=None,
                        help="gateway address (repeatable; default the configured ones)")
    parser.add_argument("--routing-api", action="store_true",
                        help="with role routing: also serve the Routing API on [routing].listen")
    parser.add_argument("--name", default=None, help="label in the routing worker's lease owner id")
    parser.add_argument("--pool", default=None, help="with role autoscaler: the pool it scales")
    args = parser.parse_args(argv)
    chosen = set(args.role or ["all"])
    if "autoscaler" in chosen:
        if chosen != {"autoscaler"} or not args.pool:
            parser.error("--role autoscaler is taken alone, with --pool")
        from sluice.autoscaler.__main__ import run
        run(args.pool)
        return
    config = start_process("+".join(sorted(chosen)))
    routing_api = args.routing_api
    if "all" in chosen:
        chosen = {"gateway", "routing"}
        routing_api = True
    eventloop.run(serve(config, chosen, args.listen or gateway_addresses(config),
                        config.routing.listen if routing_api else None, args.name), config.gateway.event_loop)


if __name__ == "__main__":
    main()
