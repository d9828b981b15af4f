"""Router counters: decisions per policy and outcome, predicted against reported cache hits.

Plain counters with a typed snapshot (what tests and the bench read), mirrored
into prometheus_client counters when the host hands in a registry (what the
live service exports). Predicted cached tokens come from RouteDecision; the
reported ones from the replica's per-response kv_cache_reused_blocks (times its
block size), which the host passes to ``record_reported`` when the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from sluice.router.policy import RouteDecision


@dataclass(frozen=True, slots=True)
class RouterMetricsSnapshot:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (policy, outcome) -> count
    predicted_cached_tokens: int = 0    # sum over decisions
    reported_cached_tokens: int = 0     # sum over runs the replica reported on
    prompt_tokens: int = 0              # sum over runs the replica reported on
    reported_runs: int = 0
    overpredicted_runs: int = 0         # predicted more cached tokens than the replica reused

    @property
    def reported_hit_rate(self) -> float:
        return self.reported_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def outcome_share(self, policy: str, outcome: str) -> float:
        total = sum(count for (name, _), count in self.decisions.items() if name == policy)
        return self.decisions.get((policy, outcome), 0) / total if total else 0.0


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._decisions: dict[tuple[str, str], int] = {}
        self._predicted = 0
        self._reported = 0
        self._prompt = 0
        self._runs = 0
        self._overpredicted = 0
        self._prom_decisions: Counter | None = None
        self._prom_tokens: Counter | None = None
        if registry is not None:
            self._prom_decisions = Counter("sluice_router_decisions",
                                           "Routing decisions by policy and outcome",
                                           ["policy", "outcome"], registry=registry)
            self._prom_tokens = Counter("sluice_router_cached_tokens",
                                        "Prompt tokens predicted cached by the router / reported reused",
                                        ["kind"], registry=registry)

    def record_decision(self, policy: str, decision: RouteDecision) -> None:
        key = (policy, decision.outcome)
        self._decisions[key] = self._decisions.get(key, 0) + 1
        self._predicted += decision.predicted_cached_tokens
        if self._prom_decisions is not None and self._prom_tokens is not None:
            self._prom_decisions.labels(policy=policy, outcome=decision.outcome).inc()
            self._prom_tokens.labels(kind="predicted").inc(decision.predicted_cached_tokens)

    def record_reported(self, predicted_cached_tokens: int, reported_cached_tokens: int,
                        prompt_tokens: int) -> None:
        self._reported += reported_cached_tokens
        self._prompt += prompt_tokens
        self._runs += 1
        if predicted_cached_tokens > reported_cached_tokens:
            self._overpredicted += 1
        if self._prom_tokens is not None:
            self._prom_tokens.labels(kind="reported").inc(reported_cached_tokens)

    def snapshot(self) -> RouterMetricsSnapshot:
        return RouterMetricsSnapshot(
            decisions=dict(self._decisions), predicted_cached_tokens=self._predicted,
            reported_cached_tokens=self._reported, prompt_tokens=self._prompt,
            reported_runs=self._runs, overpredicted_runs=self._overpredicted,
        )
