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
    if run.route_reason is None:
        return None
    return RouteRecord(model_version=run.model_version, pool=run.worker_pool or "",
                       tier=run.quality_tier or "", reason=RouteReason(run.route_reason),
                       requested_model=run.requested_model or "",
                       fallback_from=run.fallback_from, detail=run.route_detail or "")
