"""The routing decision as the ledger keeps it (runs.requested_model … route_detail, migration 0008)."""

from __future__ import annotations

from typing import Any

from sluice.ledger.models import Run

from sluice.traffic.route import RouteReason, RouteRecord


def route_columns(route: RouteRecord) -> dict[str, Any]:
    """The runs columns that record `route` (model_version is written with the run itself)."""
    return {"requested_model": route.requested_model, "route_reason": route.reason.value,
            "worker_pool": route.pool, "quality_tier": route.tier, "fallback_from": route.fallback_from,
            "route_detail": route.detail or None}


def route_of(run: Run) -> RouteRecord | None:
    """The decision a run recorded; None for a run admitted before decisions were recorded."""
    return route_from_columns(run.model_version, run.worker_pool, run.quality_tier, run.route_reason,
                              run.requested_model, run.fallback_from, run.route_detail)


def route_from_columns(model_version: str, pool: str | None, tier: str | None, reason: str | None,
                       requested_model: str | None, fallback_from: str | None,
                       detail: str | None) -> RouteRecord | None:
    """route_of from the runs columns read without an ORM row (the claim loop's)."""
    if reason is None:
        return None
    return RouteRecord(model_version=model_version, pool=pool or "", tier=tier or "",
                       reason=RouteReason(reason), requested_model=requested_model or "",
                       fallback_from=fallback_from, detail=detail or "")
