"""The Admin API's traffic-policy RPCs on the wire (fallbacks, canaries); AdminServicer mixes them in."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc.aio
from sluice.ledger.canaries import CanaryRecord
from sluice.services.admin_traffic import fallback_rules
from sluice.services.errors import InvalidArgument, grpc_errors

from sluice.traffic.canary import Guardrails
from sluice.traffic.fallback import FallbackRule
from sluice.v1 import admin_pb2

if TYPE_CHECKING:
    from sluice.services.admin import AdminService

DEFAULT_GUARDRAILS = Guardrails()


def rules_message(tenant: str, rules: list[FallbackRule]) -> admin_pb2.Fallbacks:
    return admin_pb2.Fallbacks(tenant=tenant, rules=[
        admin_pb2.FallbackRule(from_model=rule.from_model, to_model=rule.to_model,
                               conditions=sorted(c.value for c in rule.conditions)) for rule in rules])


def guardrails_from(message: admin_pb2.CanaryGuardrails) -> Guardrails:
    """Zero fields take the defaults (traffic.canary.Guardrails)."""
    d = DEFAULT_GUARDRAILS
    try:
        return Guardrails(
            window_s=message.window_s or d.window_s, min_samples=message.min_samples or d.min_samples,
            max_ttft_ratio=message.max_ttft_ratio or d.max_ttft_ratio,
            max_tpot_ratio=message.max_tpot_ratio or d.max_tpot_ratio,
            max_failure_rate_increase=message.max_failure_rate_increase or d.max_failure_rate_increase)
    except ValueError as error:
        raise InvalidArgument(f"guardrails: {error}") from None


def canary_message(canary: CanaryRecord) -> admin_pb2.Canary:
    limits = canary.guardrails
    return admin_pb2.Canary(
        alias=canary.alias, baseline_version=canary.baseline_version,
        candidate_version=canary.candidate_version, share_bp=canary.share_bp, state=canary.state.value,
        guardrails=admin_pb2.CanaryGuardrails(
            window_s=limits.window_s, min_samples=limits.min_samples, max_ttft_ratio=limits.max_ttft_ratio,
            max_tpot_ratio=limits.max_tpot_ratio, max_failure_rate_increase=limits.max_failure_rate_increase),
        started_at=canary.started_at.isoformat(),
        ended_at=canary.ended_at.isoformat() if canary.ended_at else "",
        reason=canary.reason or "",
        last_judgment_json=json.dumps(canary.last_judgment, sort_keys=True) if canary.last_judgment else "",
        judged_at=canary.judged_at.isoformat() if canary.judged_at else "")


class TrafficAdminMethods:
    """SetFallbacks, GetFallbacks and the canary RPCs of AdminServicer."""

    _service: AdminService

    @grpc_errors
    async def SetFallbacks(self, request: admin_pb2.SetFallbacksRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.Fallbacks:
        rules = fallback_rules([(r.from_model, r.to_model, list(r.conditions)) for r in request.rules])
        saved = await self._service.set_fallbacks(context.invocation_metadata(), request.tenant, rules)
        return rules_message(request.tenant, saved)

    @grpc_errors
    async def GetFallbacks(self, request: admin_pb2.GetFallbacksRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.Fallbacks:
        return rules_message(request.tenant,
                             await self._service.get_fallbacks(context.invocation_metadata(), request.tenant))

    @grpc_errors
    async def StartCanary(self, request: admin_pb2.StartCanaryRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.Canary:
        return canary_message(await self._service.start_canary(
            context.invocation_metadata(), request.alias, request.candidate_version, request.share_bp,
            guardrails_from(request.guardrails)))

    @grpc_errors
    async def ListCanaries(self, request: admin_pb2.ListCanariesRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.ListCanariesResponse:
        canaries = await self._service.list_canaries(context.invocation_metadata())
        return admin_pb2.ListCanariesResponse(canaries=[canary_message(canary) for canary in canaries])

    @grpc_errors
    async def SetCanaryShare(self, request: admin_pb2.SetCanaryShareRequest,
                             context: grpc.aio.ServicerContext) -> admin_pb2.Canary:
        return canary_message(await self._service.set_canary_share(
            context.invocation_metadata(), request.alias, request.share_bp))

    @grpc_errors
    async def StopCanary(self, request: admin_pb2.StopCanaryRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.Canary:
        return canary_message(await self._service.stop_canary(
            context.invocation_metadata(), request.alias, request.reason))

    @grpc_errors
    async def PromoteCanary(self, request: admin_pb2.PromoteCanaryRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.Canary:
        promoted = await self._service.promote_canary(context.invocation_metadata(), request.alias)
        return canary_message(promoted)
