"""The routing decision on the wire (common.proto RouteDecision): one conversion for every door."""

from __future__ import annotations

from typing import cast

from sluice.traffic.route import RouteReason, RouteRecord
from sluice.v1 import common_pb2


def route_message(route: RouteRecord | None) -> common_pb2.RouteDecision:
    """An empty message (reason UNSPECIFIED) for a run admitted before decisions were recorded."""
    if route is None:
        return common_pb2.RouteDecision()
    return common_pb2.RouteDecision(
        model_version=route.model_version, pool=route.pool, tier=route.tier,
        reason=cast("common_pb2.RouteReason",
                    common_pb2.RouteReason.Value(f"ROUTE_REASON_{route.reason.name}")),
        requested_model=route.requested_model, fallback_from=route.fallback_from or "", detail=route.detail)


def reason_of(message: common_pb2.RouteDecision) -> RouteReason | None:
    if message.reason == common_pb2.ROUTE_REASON_UNSPECIFIED:
        return None
    return RouteReason[common_pb2.RouteReason.Name(message.reason).removeprefix("ROUTE_REASON_")]
