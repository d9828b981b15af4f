"""The routing decision a run records: the model version, its pool and tier, and why it went there.

Admission makes the decision (it resolves the alias, splits a canary, falls back) and writes it on
the run row in the transaction that reserves its budget; GetRun, the first STATUS event, the usage
entry and the routing metrics all report the same record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RouteReason(enum.StrEnum):
    """Why a run went to its model version; stored as TEXT in runs.route_reason."""

    REQUESTED = "requested"      # the caller named this exact version
    ALIAS = "alias"              # the caller named an alias; this version holds it
    CANARY = "canary"            # the alias's canary split sent it to the candidate version
    FALLBACK = "fallback"        # the requested model was overloaded; a permitted fallback took it


@dataclass(frozen=True, slots=True)
class RouteRecord:
    model_version: str           # what the run is pinned to (tokenizer, price card, pool)
    pool: str                    # the worker pool that serves it
    tier: str                    # the version's quality tier
    reason: RouteReason
    requested_model: str         # the name the caller wrote (alias or version)
    fallback_from: str | None = None   # FALLBACK: the version the request would have gone to
    detail: str = ""             # FALLBACK: the condition that was met; CANARY: the split
