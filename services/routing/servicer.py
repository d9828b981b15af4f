"""Routing gRPC API: the replica registry of the routing process that serves it, and Explain.

Served by a routing worker process (`python -m sluice.services.routing --listen ...`),
so an edit changes where that process routes from its next claim on. The registry RPCs take an
admin-scoped key (DESIGN.md "Keys and scopes": replicas are admin's); Explain takes a tenant API
key and predicts within that tenant's trust scope (services/trust_scope.py).
"""

from __future__ import annotations

import time

import grpc
import grpc.aio
from sluice.ledger import audit
from sluice.ledger.audit import Actor
from sluice.ledger.models import KeyScope, Model
from sluice.services.auth import authenticate, identify, require_scope
from sluice.services.errors import InvalidArgument, NotFound, Unavailable, grpc_errors
from sluice.services.routing.claims import in_flight_by_replica
from sluice.services.routing.worker import RoutingWorker
from sluice.services.trust_scope import cache_salt, scope_of
from sluice.services.validation import FieldLimits, add_checked_service

from sluice.router.policy import RouteRequest
from sluice.router.registry import RegistryError, ReplicaSpec
from sluice.v1 import routing_pb2, routing_pb2_grpc

REPLICA_NAME_MISSING = "replica name is empty: name the replica to add, replace or remove"
REPLICA_ADDRESS_MISSING = "replica {name!r} has no grpc_address: send the Triton gRPC host:port"
UNKNOWN_MODEL_VERSION = "unknown model version {version!r}: Explain takes an exact model version"
NO_REPLICA = "no healthy replica serves model {version!r} now"
ROUTING_UPSERT = "routing.replica.upsert"   # audit actions: one routing process's own registry
ROUTING_REMOVE = "routing.replica.remove"


class RoutingServicer(routing_pb2_grpc.RoutingServicer):
    def __init__(self, worker: RoutingWorker) -> None:
        self.worker = worker

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> Actor:
        """Anyone who reaches this port could otherwise send runs to a replica of their own."""
        async with self.worker.sessions() as session:
            caller = await identify(session, context.invocation_metadata())
        require_scope(caller, "the replica registry", KeyScope.ADMIN)
        return Actor(caller.key_id, caller.key_prefix)

    async def _audited(self, actor: Actor, action: str, name: str, before: ReplicaSpec | None,
                       after: ReplicaSpec | None) -> None:
        """The audit row is committed before the edit is applied, as the Admin service's edits
        commit with theirs: no edit without its row. The target names this process, since the edit
        changes only its registry (the Admin service's replica edits are the fleet-wide ones)."""
        async with self.worker.sessions() as session, session.begin():
            target = f"{name} @ {self.worker.settings.owner}"
            await audit.record(session, actor, action, target, before, after)

    @grpc_errors
    async def ListReplicas(self, request: routing_pb2.ListReplicasRequest,
                           context: grpc.aio.ServicerContext) -> routing_pb2.ListReplicasResponse:
        await self._require_admin(context)
        async with self.worker.sessions() as session:
            in_flight = await in_flight_by_replica(session)
        now = time.time()
        health = self.worker.health
        replicas = [self._message(spec, in_flight.get(spec.name, 0), health.is_healthy(spec.name, now))
                    for spec in self.worker.registry.specs()]
        return routing_pb2.ListReplicasResponse(replicas=replicas, policy=self.worker.policy.name)

    @grpc_errors
    async def UpsertReplica(self, request: routing_pb2.Replica,
                            context: grpc.aio.ServicerContext) -> routing_pb2.Replica:
        actor = await self._require_admin(context)
        if not request.name:
            raise InvalidArgument(REPLICA_NAME_MISSING)
        if not request.grpc_address:
            raise InvalidArgument(REPLICA_ADDRESS_MISSING.format(name=request.name))
        table: dict[str, object] = {"name": request.name, "pool": request.pool,
                                    "grpc_address": request.grpc_address, "metrics_url": request.metrics_url,
                                    "long_context": request.long_context}
        if request.block_size:
            table["block_size"] = request.block_size
        if request.kv_capacity_blocks:
            table["kv_capacity_blocks"] = request.kv_capacity_blocks
        try:
            spec = ReplicaSpec.from_table(table)
        except RegistryError as exc:
            raise InvalidArgument(str(exc)) from exc
        await self._audited(actor, ROUTING_UPSERT, spec.name, self.worker.registry.get(spec.name), spec)
        self.worker.registry.upsert(spec)
        self.worker.replicas_changed()
        return self._message(spec, 0, True)

    @grpc_errors
    async def RemoveReplica(self, request: routing_pb2.RemoveReplicaRequest,
                            context: grpc.aio.ServicerContext) -> routing_pb2.RemoveReplicaResponse:
        actor = await self._require_admin(context)
        if not request.name:
            raise InvalidArgument(REPLICA_NAME_MISSING)
        before = self.worker.registry.get(request.name)
        if before is not None:
            await self._audited(actor, ROUTING_REMOVE, request.name, before, None)
        removed = self.worker.registry.remove(request.name) is not None
        self.worker.replicas_changed()
        return routing_pb2.RemoveReplicaResponse(removed=removed)

    @grpc_errors
    async def Explain(self, request: routing_pb2.ExplainRequest,
                      context: grpc.aio.ServicerContext) -> routing_pb2.ExplainResponse:
        async with self.worker.sessions() as session:
            # The caller's tenant fixes the trust scope the prediction is made in, as admission
            # fixes a run's (DESIGN.md "Trust scopes"): nobody learns what another scope has cached.
            tenant = await authenticate(session, context.invocation_metadata())
            model = await session.get(Model, request.model_version)
        if model is None:
            raise NotFound(UNKNOWN_MODEL_VERSION.format(version=request.model_version))
        route = RouteRequest(request_id="explain", model_version=model.version,
                             token_ids=tuple(request.token_ids), max_output_tokens=1,
                             conversation_id=request.conversation_id or None,
                             cache_salt=cache_salt(scope_of(tenant.id, tenant.shared_cache_scope)))
        decision = self.worker.explain(route, model.worker_pool)
        if decision is None:
            raise Unavailable(NO_REPLICA.format(version=model.version))
        return routing_pb2.ExplainResponse(replica=decision.replica, outcome=decision.outcome,
                                           predicted_cached_tokens=decision.predicted_cached_tokens)

    @staticmethod
    def _message(spec: ReplicaSpec, in_flight: int, healthy: bool) -> routing_pb2.Replica:
        return routing_pb2.Replica(name=spec.name, pool=spec.pool, grpc_address=spec.grpc_address,
                                   metrics_url=spec.metrics_url, block_size=spec.block_size,
                                   kv_capacity_blocks=spec.kv_capacity_blocks, long_context=spec.long_context,
                                   healthy=healthy, in_flight=in_flight)


def add_routing_servicer(server: grpc.aio.Server, worker: RoutingWorker) -> RoutingServicer:
    """Register the Routing API of `worker` on `server` (for services/main.py and __main__)."""
    servicer = RoutingServicer(worker)
    add_checked_service(server, routing_pb2.DESCRIPTOR.services_by_name["Routing"], servicer, FieldLimits())
    return servicer
