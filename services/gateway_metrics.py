"""What a gateway process measures (Prometheus) and puts on its Submit span (OpenTelemetry).

    sluice_submit_seconds{code}             Submit latency, both doors (gRPC and the HTTP edge),
                                            by the status it answered (OK or the refusal's code)
    sluice_submit_refusals_total{code, reason}   refusals by status and ErrorInfo reason
                                            (RESOURCE_EXHAUSTED / BUDGET_EXCEEDED, ...)
    sluice_budget_remaining{tenant, kind}   what the tenant's current period has left after the
                                            last reservation this process made or refused
                                            (kind tokens | cost_micros); settlements elsewhere move
                                            it between submits

Under multiprocess mode the budget gauge is the most recent value any live process wrote
(multiprocess_mode="livemostrecent"); latencies and refusals add up over the processes.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sluice.services.telemetry import gen_ai_request

# Submit is two statements when it admits (~1-3 ms on a quiet box); refusals before any query are
# sub-millisecond and a tokenized 128k-token prompt takes tens of ms.
SUBMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OK = "OK"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._latency = Histogram("sluice_submit_seconds", "Submit latency, by the status answered",
                                  ["code"], buckets=SUBMIT_BUCKETS, registry=self.registry)
        self._refusals = Counter("sluice_submit_refusals", "Submits refused, by status and reason",
                                 ["code", "reason"], registry=self.registry)
        self._budget = Gauge("sluice_budget_remaining",
                             "What the tenant's current budget period has left, as of its last submit here",
                             ["tenant", "kind"], registry=self.registry, multiprocess_mode="livemostrecent")
        # Label children looked up once (a labels() call costs ~10-20 us; issue 9: every Submit pays them).
        self._admitted = self._latency.labels(code=OK)
        self._budget_of: dict[str, tuple[Gauge, Gauge]] = {}

    def submitted(self, seconds: float) -> None:
        self._admitted.observe(seconds)

    def refused(self, code: str, reason: str, seconds: float) -> None:
        self._latency.labels(code=code).observe(seconds)
        self._refusals.labels(code=code, reason=reason).inc()

    def budget_left(self, tenant: str, tokens: int, cost_micros: int) -> None:
        gauges = self._budget_of.get(tenant)
        if gauges is None:
            gauges = self._budget_of[tenant] = (self._budget.labels(tenant=tenant, kind="tokens"),
                                                self._budget.labels(tenant=tenant, kind="cost_micros"))
        gauges[0].set(tokens)
        gauges[1].set(cost_micros)


def submit_span_attributes(model: str, max_output_tokens: int, sampling: Mapping[str, float | int]) -> dict[
        str, str | int | float]:
    """The Submit span's attributes known before anything is read."""
    attributes: dict[str, str | int | float] = {**gen_ai_request(model),
                                                "gen_ai.request.max_tokens": max_output_tokens}
    for name, value in sampling.items():
        if value:
            attributes[f"gen_ai.request.{name}"] = value
    return attributes
