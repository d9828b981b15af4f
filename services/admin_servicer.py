"""The Admin API's gRPC edge: protobuf in, AdminService call, protobuf out (errors mapped once,
by `grpc_errors`). Timestamps travel as RFC 3339 strings in UTC, "" for none."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import grpc.aio
from sluice.ledger.admin import KeyRecord, Limits, ModelRecord, NewModel, Prices, TenantRecord
from sluice.ledger.audit import AuditRecord
from sluice.ledger.replicas import ReplicaRecord
from sluice.ledger.repositories import BudgetState
from sluice.services.admin import AdminService, CreatedKey, TenantView
from sluice.services.admin_traffic_servicer import TrafficAdminMethods
from sluice.services.errors import grpc_errors
from sluice.services.routing.app import registry_from_config
from sluice.services.validation import FieldLimits, add_checked_service
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.v1 import admin_pb2, admin_pb2_grpc, routing_pb2


def _time(value: dt.datetime | None) -> str:
    return "" if value is None else value.astimezone(dt.UTC).isoformat()


def tenant_message(tenant: TenantRecord, budget: BudgetState | None = None) -> admin_pb2.Tenant:
    message = admin_pb2.Tenant(
        id=str(tenant.id),
        name=tenant.name,
        allowed_tiers=list(tenant.allowed_tiers),
        max_concurrent_runs=tenant.max_concurrent_runs or 0,
        tokens_per_minute=tenant.tokens_per_minute or 0,
        suspended=tenant.suspended_at is not None,
        created_at=_time(tenant.created_at),
        kv_token_budget=tenant.kv_token_budget or 0,
        batch_allowed=tenant.batch_allowed,
    )
    if budget is not None:
        message.budget.CopyFrom(budget_message(budget))
    return message


def budget_message(budget: BudgetState) -> admin_pb2.Budget:
    return admin_pb2.Budget(
        period=f"{budget.period_start:%Y-%m}",
        token_budget=budget.token_budget,
        cost_budget_micros=budget.cost_budget_micros,
        reserved_tokens=budget.reserved_tokens,
        used_tokens=budget.used_tokens,
        reserved_cost_micros=budget.reserved_cost_micros,
        used_cost_micros=budget.used_cost_micros,
    )


def key_message(key: KeyRecord) -> admin_pb2.ApiKey:
    return admin_pb2.ApiKey(
        id=str(key.id),
        prefix=key.prefix,
        tenant=key.tenant or "",
        scope=key.scope.value,
        label=key.label,
        created_at=_time(key.created_at),
        last_used_at=_time(key.last_used_at),
        expires_at=_time(key.expires_at),
        revoked_at=_time(key.revoked_at),
        rotated_from=str(key.rotated_from) if key.rotated_from else "",
    )


def created_key_message(created: CreatedKey) -> admin_pb2.CreatedApiKey:
    message = admin_pb2.CreatedApiKey(key=key_message(created.key), secret=created.secret)
    if created.replaced is not None:
        message.replaced.CopyFrom(key_message(created.replaced))
    return message


def model_message(model: ModelRecord) -> admin_pb2.ModelVersion:
    return admin_pb2.ModelVersion(
        version=model.version,
        alias=model.alias or "",
        tokenizer=model.tokenizer,
        context_limit=model.context_limit,
        worker_pool=model.worker_pool,
        quality_tier=model.quality_tier,
        end_id=model.end_id,
        price_input_per_m_micros=model.prices.input_per_m_micros,
        price_cached_input_per_m_micros=model.prices.cached_input_per_m_micros,
        price_output_per_m_micros=model.prices.output_per_m_micros,
        price_card_id=model.price_card_id or 0,
        retired_at=_time(model.retired_at),
    )


def replica_message(replica: ReplicaRecord) -> routing_pb2.Replica:
    return routing_pb2.Replica(
        name=replica.name,
        pool=replica.pool,
        grpc_address=replica.grpc_address,
        metrics_url=replica.metrics_url,
        block_size=replica.block_size,
        kv_capacity_blocks=replica.kv_capacity_blocks,
        long_context=replica.long_context,
    )


def audit_message(entry: AuditRecord) -> admin_pb2.AuditEntry:
    def dump(value: Any) -> str:
        return "" if value is None else json.dumps(value, sort_keys=True)

    return admin_pb2.AuditEntry(
        id=entry.id,
        at=_time(entry.at),
        actor=entry.actor,
        action=entry.action,
        target=entry.target,
        before_json=dump(entry.before),
        after_json=dump(entry.after),
    )


def _prices(request: Any) -> Prices:
    return Prices(
        request.price_input_per_m_micros,
        request.price_cached_input_per_m_micros,
        request.price_output_per_m_micros,
    )


def _optional(request: Any, field: str) -> int | None:
    return int(getattr(request, field)) if request.HasField(field) else None


class AdminServicer(TrafficAdminMethods, admin_pb2_grpc.AdminServicer):
    def __init__(self, service: AdminService) -> None:
        self._service = service

    @grpc_errors
    async def CreateTenant(
        self, request: admin_pb2.CreateTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        view: TenantView = await self._service.create_tenant(
            context.invocation_metadata(),
            request.name,
            tuple(request.allowed_tiers),
            Limits(
                max_concurrent_runs=request.max_concurrent_runs, tokens_per_minute=request.tokens_per_minute
            ),
            request.token_budget,
            request.cost_budget_micros,
        )
        return tenant_message(view.tenant, view.budget)

    @grpc_errors
    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListTenantsResponse:
        tenants = await self._service.list_tenants(context.invocation_metadata())
        return admin_pb2.ListTenantsResponse(tenants=[tenant_message(tenant) for tenant in tenants])

    @grpc_errors
    async def GetTenant(
        self, request: admin_pb2.GetTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        view = await self._service.get_tenant(context.invocation_metadata(), request.name)
        return tenant_message(view.tenant, view.budget)

    @grpc_errors
    async def SuspendTenant(
        self, request: admin_pb2.SuspendTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        return tenant_message(
            await self._service.suspend_tenant(context.invocation_metadata(), request.name, request.resume)
        )

    @grpc_errors
    async def SetLimits(
        self, request: admin_pb2.SetLimitsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        limits = Limits(
            max_concurrent_runs=_optional(request, "max_concurrent_runs"),
            tokens_per_minute=_optional(request, "tokens_per_minute"),
            allowed_tiers=tuple(request.allowed_tiers) or None,
            kv_token_budget=_optional(request, "kv_token_budget"),
            batch_allowed=request.batch_allowed if request.HasField("batch_allowed") else None,
        )
        return tenant_message(
            await self._service.set_limits(context.invocation_metadata(), request.name, limits)
        )

    @grpc_errors
    async def SetBudget(
        self, request: admin_pb2.SetBudgetRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Budget:
        return budget_message(
            await self._service.set_budget(
                context.invocation_metadata(),
                request.tenant,
                request.period,
                request.token_budget,
                request.cost_budget_micros,
            )
        )

    @grpc_errors
    async def CreateApiKey(
        self, request: admin_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.CreatedApiKey:
        return created_key_message(
            await self._service.create_key(
                context.invocation_metadata(),
                request.tenant,
                request.scope,
                request.label,
                request.expires_in_s,
            )
        )

    @grpc_errors
    async def ListApiKeys(
        self, request: admin_pb2.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListApiKeysResponse:
        keys = await self._service.list_keys(context.invocation_metadata(), request.tenant)
        return admin_pb2.ListApiKeysResponse(keys=[key_message(key) for key in keys])

    @grpc_errors
    async def RotateApiKey(
        self, request: admin_pb2.RotateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.CreatedApiKey:
        return created_key_message(
            await self._service.rotate_key(context.invocation_metadata(), request.id, request.overlap_s)
        )

    @grpc_errors
    async def RevokeApiKey(
        self, request: admin_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        return key_message(await self._service.revoke_key(context.invocation_metadata(), request.id))

    @grpc_errors
    async def RegisterModel(
        self, request: admin_pb2.RegisterModelRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ModelVersion:
        new = NewModel(
            version=request.version,
            tokenizer=request.tokenizer,
            context_limit=request.context_limit,
            worker_pool=request.worker_pool or request.version,
            quality_tier=request.quality_tier or "standard",
            end_id=request.end_id,
            prices=_prices(request),
            alias=request.alias or None,
            chat_template=request.chat_template or None,
        )
        return model_message(await self._service.register_model(context.invocation_metadata(), new))

    @grpc_errors
    async def ListModels(
        self, request: admin_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListModelsResponse:
        models = await self._service.list_models(context.invocation_metadata())
        return admin_pb2.ListModelsResponse(models=[model_message(model) for model in models])

    @grpc_errors
    async def SetPriceCard(
        self, request: admin_pb2.SetPriceCardRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ModelVersion:
        return model_message(
            await self._service.set_price_card(
                context.invocation_metadata(), request.version, _prices(request)
            )
        )

    @grpc_errors
    async def MoveAlias(
        self, request: admin_pb2.MoveAliasRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ModelVersion:
        return model_message(
            await self._service.move_alias(context.invocation_metadata(), request.alias, request.version)
        )

    @grpc_errors
    async def RetireModel(
        self, request: admin_pb2.RetireModelRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ModelVersion:
        return model_message(await self._service.retire_model(context.invocation_metadata(), request.version))

    @grpc_errors
    async def UpsertReplica(
        self, request: routing_pb2.Replica, context: grpc.aio.ServicerContext
    ) -> routing_pb2.Replica:
        table: dict[str, object] = {
            "name": request.name,
            "pool": request.pool,
            "grpc_address": request.grpc_address,
            "metrics_url": request.metrics_url,
            "long_context": request.long_context,
        }
        if request.block_size:
            table["block_size"] = request.block_size
        if request.kv_capacity_blocks:
            table["kv_capacity_blocks"] = request.kv_capacity_blocks
        replica = await self._service.upsert_replica(context.invocation_metadata(), table)
        return replica_message(replica)

    @grpc_errors
    async def RemoveReplica(
        self, request: routing_pb2.RemoveReplicaRequest, context: grpc.aio.ServicerContext
    ) -> routing_pb2.RemoveReplicaResponse:
        removed = await self._service.remove_replica(context.invocation_metadata(), request.name)
        return routing_pb2.RemoveReplicaResponse(removed=removed)

    @grpc_errors
    async def ListReplicas(
        self, request: routing_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> routing_pb2.ListReplicasResponse:
        replicas = await self._service.list_replicas(context.invocation_metadata())
        return routing_pb2.ListReplicasResponse(replicas=[replica_message(replica) for replica in replicas])

    @grpc_errors
    async def ListAudit(
        self, request: admin_pb2.ListAuditRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListAuditResponse:
        entries = await self._service.audit_log(context.invocation_metadata(), request.limit, request.action)
        return admin_pb2.ListAuditResponse(entries=[audit_message(entry) for entry in entries])


def add_admin_servicer(
    server: grpc.aio.Server, sessionmaker: async_sessionmaker[AsyncSession], config: Settings
) -> AdminService:
    """Register Admin on `server`; config's [[replicas]] are the registry's bootstrap."""
    service = AdminService(sessionmaker, registry_from_config(config).specs())
    add_checked_service(server, admin_pb2.DESCRIPTOR.services_by_name["Admin"], AdminServicer(service),
                        FieldLimits.from_config(config))
    return service
