"""What a routing process measures (Prometheus) and what it puts on its spans (OpenTelemetry).

Per run (DESIGN.md observability box): TTFT and TPOT histograms per pool (tails,
not averages: read p95/p99 from the buckets), runs by terminal status, retries
before the first token. Per router decision: outcome counts and predicted
against reported cache hits (router.metrics), and the decision's own latency.
Per replica: breaker state and the load it reported at its last scrape (batch,
queue, KV use). Per pool goodput: runs COMPLETED within both the TTFT and the
TPOT objective ([telemetry] ttft_slo_ms, tpot_slo_ms; seed 000's 500 ms / 50 ms),
to set against sluice_runs_total.

TTFT runs from the submit (the run row's created_at, ledger clock) to the first
token reaching this process (its wall clock): what the caller waits for,
including time queued before a worker claimed the run. The same interval is in
the ledger as started_at - created_at (both on the database's clock), since the
driver records RUNNING right after the first token is durable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sluice.ledger.models import RunStatus
from sluice.services.finish import Ending
from sluice.services.routing.claims import ClaimedRun
from sluice.services.telemetry import GEN_AI_OPERATION, gen_ai_request

from sluice.config import Settings
from sluice.router.load import LoadSnapshot
from sluice.router.metrics import RouterMetrics
from sluice.router.policy import RouteDecision
from sluice.traffic.route import RouteRecord

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5)
DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3)
LOAD_KINDS = ("active", "waiting", "scheduled", "kv_used_blocks", "kv_fraction")   # LoadSnapshot fields
SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
LEASE_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0)


@dataclass(frozen=True, slots=True)
class ServiceObjectives:
    ttft_s: float = 0.5          # submit -> first token
    tpot_s: float = 0.05         # per output token after the first

    @classmethod
    def from_config(cls, config: Settings) -> ServiceObjectives:
        return cls(ttft_s=config.telemetry.ttft_slo_ms / 1000, tpot_s=config.telemetry.tpot_slo_ms / 1000)

    def met(self, outcome: RunOutcome) -> bool:
        if outcome.status is not RunStatus.COMPLETED or outcome.ttft_s is None:
            return False
        return outcome.ttft_s <= self.ttft_s and (outcome.tpot_s is None or outcome.tpot_s <= self.tpot_s)


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How one run went, as its driver saw it (spans and metrics are made from this)."""

    status: RunStatus
    replica: str | None          # the replica of the last attempt
    attempts: int                # replicas tried (1 + retries before the first token)
    input_tokens: int            # prompt tokens charged (0 when no replica took the run)
    output_tokens: int
    cached_input_tokens: int     # charged at the cached rate
    reported_cached_tokens: int  # reused blocks the replica reported x its block size
    ttft_s: float | None         # submit -> first token (None: no token)
    tpot_s: float | None         # mean time between tokens after the first (None: fewer than 2)


class RoutingMetrics:
    """The routing process's Prometheus metrics, all in one registry (served on [routing].metrics_port)."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 objectives: ServiceObjectives | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.objectives = objectives or ServiceObjectives()
        registry = self.registry
        self.router = RouterMetrics(registry)
        self._ttft = Histogram("sluice_run_ttft_seconds", "Submit to first token, per pool",
                               ["pool"], buckets=TTFT_BUCKETS, registry=registry)
        self._tpot = Histogram("sluice_run_tpot_seconds",
                               "Mean time per output token after the first, per pool",
                               ["pool"], buckets=TPOT_BUCKETS, registry=registry)
        self._runs = Counter("sluice_runs", "Runs this process ended, by pool and terminal status",
                             ["pool", "status"], registry=registry)
        self._tokens = Counter("sluice_run_tokens", "Tokens of the runs this process ended, by pool and kind",
                               ["pool", "kind"], registry=registry)
        self._goodput = Counter("sluice_run_goodput", "Runs COMPLETED within the TTFT and TPOT objectives",
                                ["pool"], registry=registry)
        self._retries = Counter("sluice_run_retries",
                                "Runs moved to another replica before their first token",
                                ["pool"], registry=registry)
        # Issue 14: where claimed runs went and why (requested, alias, canary, fallback), once per run.
        self._routes = Counter("sluice_run_routes", "Runs claimed, by the routing decision made at admission",
                               ["model_version", "pool", "tier", "reason"], registry=registry)
        self._decision = Histogram("sluice_router_decision_seconds", "Time of one policy.choose() call",
                                   buckets=DECISION_BUCKETS, registry=registry)
        # Several routing processes on a host see the same replicas: under multiprocess mode the
        # served value is the most recent any live process wrote (telemetry.py).
        self._healthy = Gauge("sluice_replica_healthy", "1 while the replica's circuit breaker is closed",
                              ["replica"], registry=registry, multiprocess_mode="livemostrecent")
        self._load = Gauge("sluice_replica_load", "What the replica reported at its last scrape",
                           ["replica", "kind"], registry=registry, multiprocess_mode="livemostrecent")
        self._scrape = Histogram("sluice_replica_scrape_seconds",
                                 "One scrape of a replica's metrics endpoint",
                                 buckets=SCRAPE_BUCKETS, registry=registry)
        self._scrape_failures = Counter("sluice_replica_scrape_failures", "Failed scrapes",
                                        ["replica"], registry=registry)
        self._restarts = Counter("sluice_replica_restarts", "Replica restarts seen by scraping",
                                 ["replica"], registry=registry)
        # Observed from the lease keeper's thread (prometheus_client metrics are thread-safe).
        self._lease_lag = Histogram("sluice_lease_renewal_lag_seconds",
                                    "How long after it was due each lease renewal completed",
                                    buckets=LEASE_LAG_BUCKETS, registry=registry)
        self._lease_failures = Counter("sluice_lease_renewal_failures",
                                       "Lease renewals that failed and were retried", registry=registry)
        # The per-pool series of the per-run metrics, each looked up once: prometheus_client's labels()
        # checks its arguments and takes a lock at every call (~3 us; seven per run ended). Pools
        # and statuses are few, and these series are never removed.
        self._series: dict[tuple[str, str, str], Counter | Histogram] = {}

    def _of(self, metric: Counter | Histogram, pool: str, label: str = "", value: str = "") -> Any:
        """`metric`'s series for `pool` (and `label`=`value` when it has a second label)."""
        key = (metric._name, pool, value)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(pool=pool, **({label: value} if label else {}))
        return series

    def lease_renewed(self, lag_s: float) -> None:
        self._lease_lag.observe(lag_s)

    def lease_renewal_failed(self) -> None:
        self._lease_failures.inc()

    def decided(self, policy: str, decision: RouteDecision, seconds: float) -> None:
        self.router.record_decision(policy, decision)
        self._decision.observe(seconds)

    def routed(self, route: RouteRecord | None) -> None:
        if route is not None:
            self._routes.labels(model_version=route.model_version, pool=route.pool, tier=route.tier,
                                reason=route.reason.value).inc()

    def retried(self, pool: str) -> None:
        self._retries.labels(pool=pool).inc()

    def run_ended(self, pool: str, predicted_cached_tokens: int, outcome: RunOutcome) -> None:
        self._of(self._runs, pool, "status", outcome.status.value).inc()
        self._of(self._tokens, pool, "kind", "input").inc(outcome.input_tokens)
        self._of(self._tokens, pool, "kind", "cached_input").inc(outcome.cached_input_tokens)
        self._of(self._tokens, pool, "kind", "output").inc(outcome.output_tokens)
        if outcome.ttft_s is not None:
            self._of(self._ttft, pool).observe(max(0.0, outcome.ttft_s))
        if outcome.tpot_s is not None:
            self._of(self._tpot, pool).observe(outcome.tpot_s)
        if self.objectives.met(outcome):
            self._of(self._goodput, pool).inc()
        if outcome.input_tokens:   # the replica reported on a prompt it took
            self.router.record_reported(predicted_cached_tokens, outcome.reported_cached_tokens,
                                        outcome.input_tokens)

    def health(self, states: Mapping[str, bool]) -> None:
        for name, healthy in states.items():
            self._healthy.labels(replica=name).set(1.0 if healthy else 0.0)

    def scraped(self, replica: str, snapshot: LoadSnapshot, seconds: float, restarted: bool) -> None:
        self._scrape.observe(seconds)
        for kind in LOAD_KINDS:
            self._load.labels(replica=replica, kind=kind).set(getattr(snapshot, kind))
        if restarted:
            self._restarts.labels(replica=replica).inc()

    def scrape_failed(self, replica: str, seconds: float) -> None:
        self._scrape.observe(seconds)
        self._scrape_failures.labels(replica=replica).inc()

    def forget_replica(self, replica: str) -> None:
        with contextlib.suppress(KeyError):
            self._healthy.remove(replica)
        for kind in LOAD_KINDS:
            with contextlib.suppress(KeyError):
                self._load.remove(replica, kind)


def span_attributes(run_id: str, model: str, pool: str, decision: RouteDecision, input_tokens: int) -> dict[
        str, str | int]:
    """The attributes a run.drive span starts with; the outcome's are added when it ends."""
    return {"sluice.run_id": run_id, "sluice.model": model, "sluice.pool": pool,
            "sluice.replica": decision.replica, "sluice.route.outcome": decision.outcome,
            "sluice.route.predicted_cached_tokens": decision.predicted_cached_tokens,
            "sluice.prompt_tokens": input_tokens, **gen_ai_request(model)}


def finish_reason(status: RunStatus, output_tokens: int, max_output_tokens: int) -> str:
    """gen_ai.response.finish_reasons' value: "length" when the cap ended it, "stop" for the model's
    own end, else the terminal status (cancelled, expired, failed, interrupted)."""
    if status is RunStatus.COMPLETED:
        return "length" if output_tokens >= max_output_tokens else "stop"
    return status.value.lower()


def claim_attributes(claim: ClaimedRun, decision: RouteDecision) -> dict[str, str | int]:
    """The per-run run.claim span: which replica the policy chose, in the run's own trace."""
    return {"sluice.run_id": claim.run_id, "sluice.tenant": str(claim.tenant_id),
            "sluice.pool": claim.worker_pool, "sluice.replica": decision.replica,
            "sluice.route.outcome": decision.outcome, "sluice.lease_epoch": claim.epoch}


def stream_span_name(claim: ClaimedRun) -> str:
    return f"{GEN_AI_OPERATION} {claim.model_version}"   # the convention: "{operation} {model}"


def stream_attributes(claim: ClaimedRun, address: str) -> dict[str, str | int]:
    """The replica stream's span (one per run, not per token): the GenAI request and the replica."""
    host, _, port = address.rpartition(":")
    return {**gen_ai_request(claim.model_version), "gen_ai.request.max_tokens": claim.max_output_tokens,
            "sluice.run_id": claim.run_id, "sluice.tenant": str(claim.tenant_id),
            "server.address": host, "server.port": int(port) if port.isdigit() else 0}


def stream_end_attributes(claim: ClaimedRun, ending: Ending, attempts: int,
                          first_token_s: float | None) -> dict[str, str | int | float | Sequence[str]]:
    """What the stream span learns at its end: tokens, why it stopped, attempts, time to first token."""
    attributes: dict[str, str | int | float | Sequence[str]] = {
        "gen_ai.response.model": claim.model_version,
        "gen_ai.usage.input_tokens": claim.input_tokens,
        "gen_ai.usage.output_tokens": ending.output_tokens,
        "gen_ai.response.finish_reasons": [finish_reason(ending.status, ending.output_tokens,
                                                         claim.max_output_tokens)],
        "sluice.status": ending.status.value, "sluice.attempts": attempts,
        "sluice.cached_input_tokens": ending.cached_input_tokens}
    if first_token_s is not None:
        attributes["sluice.ttft_ms"] = round(first_token_s * 1000, 3)
    return attributes


def outcome_attributes(outcome: RunOutcome) -> dict[str, str | int | float]:
    attributes: dict[str, str | int | float] = {
        "sluice.status": outcome.status.value, "sluice.replica": outcome.replica or "",
        "sluice.attempts": outcome.attempts, "sluice.input_tokens": outcome.input_tokens,
        "sluice.output_tokens": outcome.output_tokens,
        "sluice.cached_input_tokens": outcome.cached_input_tokens,
        # What the run was charged, as the GenAI conventions name it.
        "gen_ai.usage.input_tokens": outcome.input_tokens,
        "gen_ai.usage.output_tokens": outcome.output_tokens,
    }
    if outcome.ttft_s is not None:
        attributes["sluice.ttft_ms"] = round(outcome.ttft_s * 1000, 3)
    if outcome.tpot_s is not None:
        attributes["sluice.tpot_ms"] = round(outcome.tpot_s * 1000, 3)
    return attributes
