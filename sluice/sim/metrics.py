"""Serving metrics with vLLM `bench serve`'s definitions.

    TTFT  first token − arrival (arrival = when the router received the request)
    TPOT  (E2E − TTFT) / (output tokens − 1), per request with more than one token
    ITL   every gap between consecutive streamed chunks of a request; the engine
          streams one token per step, so each generation step of d seconds adds
          one ITL sample of d per request that decoded in it (kept as weighted
          samples: a run of k steps over a batch of b adds k samples of weight b)
    E2E   last token − arrival
    goodput  requests per second that met every SLO given (TTFT, TPOT, E2E)

Times are the replica's: arrival is when the router placed the request, so
TTFT is queueing + prefill on the replica, without network, gateway or
tokenization (seed 003 budgets ~47 ms for those on top).

A request resumed after a pause (max_utilization) recomputes its context; that
stall shows in its TPOT and E2E but not as an ITL sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sluice.sim.scaling import ScalingSample
from sluice.sim.traffic import TrafficSummary

if TYPE_CHECKING:
    from sluice.sim.canary import CanaryOutcome  # sim/canary.py reads this module's RequestRecord

PERCENTILES = (50.0, 90.0, 95.0, 99.0)
HIT_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = 0.5
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: float | None = 0.04      # reported against the ITL p95, not per request


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float], weights: Sequence[float] | None = None) -> Distribution:
        data = np.asarray(values, dtype=float)
        if data.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        if weights is None:
            p50, p90, p95, p99 = (float(v) for v in np.percentile(data, PERCENTILES))
            return cls(int(data.size), float(data.mean()), p50, p90, p95, p99)
        w = np.asarray(weights, dtype=float)
        order = np.argsort(data, kind="stable")
        data, w = data[order], w[order]
        cumulative = np.cumsum(w)
        total = float(cumulative[-1])

        def pick(q: float) -> float:
            index = int(np.searchsorted(cumulative, q / 100.0 * total, side="left"))
            return float(data[min(index, data.size - 1)])

        return cls(int(total), float(np.dot(data, w) / total), pick(50), pick(90), pick(95), pick(99))

    def format_ms(self) -> str:
        if self.count == 0:
            return "n/a"
        return (f"mean {self.mean * 1e3:8.1f}  p50 {self.p50 * 1e3:8.1f}  p90 {self.p90 * 1e3:8.1f}  "
                f"p95 {self.p95 * 1e3:8.1f}  p99 {self.p99 * 1e3:8.1f} ms")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    replica: str
    arrival_s: float
    input_tokens: int
    first_token_s: float = math.nan
    finish_s: float = math.nan
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""


class ItlRecorder:
    """Weighted ITL samples, appended in bulk (a decode run adds one entry per step)."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.weights: list[int] = []

    def add(self, duration_s: float, count: int) -> None:
        if count > 0:
            self.durations.append(duration_s)
            self.weights.append(count)

    def add_run(self, durations: Sequence[float], batch: int, last_step_tokens: int) -> None:
        if not durations:
            return
        self.durations.extend(durations)
        self.weights.extend([batch] * (len(durations) - 1))
        self.weights.append(last_step_tokens)

    def distribution(self) -> Distribution:
        return Distribution.of(self.durations, self.weights)


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    name: str
    requests: int                    # routed to it
    busy_fraction: float             # share of the run it spent executing steps
    mean_batch: float                # generation requests per decode step, step-weighted
    kv_utilization_mean: float       # time-weighted used / max blocks
    kv_utilization_peak: float
    cache_hit_rate: float            # reused / (reused + missed) prompt blocks
    paused: int                      # requests paused (max_utilization)
    steps: int


@dataclass(frozen=True, slots=True)
class FleetReport:
    policy: str
    duration_s: float                # measured window (after warm-up)
    replicas: int
    requests_arrived: int
    requests_completed: int
    requests_rejected: int           # the router found no replica, or the engine refused the request
    requests_unfinished: int         # still queued or running when the run ended
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    request_throughput: float        # completed requests / s
    output_token_throughput: float   # streamed tokens / s
    total_token_throughput: float    # (prompt + streamed) tokens / s
    goodput: float                   # requests / s meeting every per-request SLO
    slo: SLO
    slo_attainment: float            # share of completed requests meeting every per-request SLO
    mean_input_tokens: float
    mean_output_tokens: float
    cache_hit_rate: float            # cached prompt tokens / prompt tokens, completed requests
    kv_utilization_mean: float       # across replicas, time-weighted
    kv_utilization_peak: float
    routing_outcomes: tuple[tuple[str, int], ...]
    per_replica: tuple[ReplicaSummary, ...]
    sim_cpu_s: float                 # CPU time of the simulation itself
    sim_wall_s: float
    events: int
    requests_interrupted: int = 0    # lost with a replica that restarted (their users resent them)
    # (window start s, cached / prompt tokens of the requests whose first token came in that window),
    # every HIT_WINDOW_S from the start of the run, warm-up included: how a restart dents the hit rate
    hit_timeline: tuple[tuple[float, float], ...] = ()
    offered_rate: float = 0.0        # requests arriving in the measured window / s (resends included)
    requests_shed: int = 0           # refused by the gateway with a retry-after (autoscaling runs)
    scaling: tuple[ScalingSample, ...] = ()   # the autoscaler's view at each control tick
    canary: CanaryOutcome | None = None       # the canary's guard passes (FleetConfig.canary)
    traffic: TrafficSummary | None = None     # batch work and the degradation ladder (sim/traffic.py)
    # TTFT of the requests arriving in the second half of the measured window: past a cold start's
    # backlog that a short warm-up leaves in the first half (bench_routing rag), so steadier across seeds
    ttft_late: Distribution = Distribution(0, math.nan, math.nan, math.nan, math.nan, math.nan)

    def format(self) -> str:
        slo = self.slo
        targets = (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2E", slo.e2e_s))
        slo_text = ", ".join(f"{name} ≤ {value * 1e3:.0f} ms" for name, value in targets if value is not None)
        lines = [
            f"policy {self.policy}: {self.replicas} replicas, {self.duration_s:.0f} s measured",
            f"requests   arrived {self.requests_arrived}  completed {self.requests_completed}  "
            f"rejected {self.requests_rejected}  interrupted {self.requests_interrupted}  "
            f"unfinished {self.requests_unfinished}",
            f"tokens     mean input {self.mean_input_tokens:.0f}  mean output {self.mean_output_tokens:.0f}",
            f"TTFT       {self.ttft.format_ms()}",
            f"TPOT       {self.tpot.format_ms()}",
            f"ITL        {self.itl.format_ms()}",
            f"E2E        {self.e2e.format_ms()}",
            f"throughput {self.request_throughput:.2f} req/s  "
            f"{self.output_token_throughput:,.0f} output tok/s  "
            f"{self.total_token_throughput:,.0f} total tok/s",
            f"goodput    {self.goodput:.2f} req/s "
            f"({self.slo_attainment:.1%} of completed meet {slo_text or 'no SLO'})",
        ]
        if slo.itl_s is not None and self.itl.count:
            verdict = "meets" if self.itl.p95 <= slo.itl_s else "MISSES"
            lines.append(f"ITL p95    {self.itl.p95 * 1e3:.1f} ms {verdict} the {slo.itl_s * 1e3:.0f} ms SLO")
        lines += [
            f"KV cache   hit rate {self.cache_hit_rate:.1%}  "
            f"utilization mean {self.kv_utilization_mean:.1%}  peak {self.kv_utilization_peak:.1%}",
            "routing    " + ", ".join(f"{name} {count}" for name, count in self.routing_outcomes),
            f"{'replica':<8}{'requests':>9}{'busy':>7}{'batch':>7}{'kv mean':>9}{'kv peak':>9}{'hit':>7}"
            f"{'paused':>8}{'steps':>9}",
        ]
        for r in self.per_replica:
            lines.append(f"{r.name:<8}{r.requests:>9}{r.busy_fraction:>7.0%}{r.mean_batch:>7.1f}"
                         f"{r.kv_utilization_mean:>9.1%}{r.kv_utilization_peak:>9.1%}{r.cache_hit_rate:>7.1%}"
                         f"{r.paused:>8}{r.steps:>9}")
        lines.append(f"simulated in {self.sim_cpu_s:.1f} s CPU "
                     f"({self.sim_wall_s:.1f} s wall, {self.events:,} events)")
        return "\n".join(lines)


def hit_timeline(records: Sequence[RequestRecord], window_s: float = HIT_WINDOW_S
                 ) -> tuple[tuple[float, float], ...]:
    """Prompt-cache hit rate per window of first-token time (windows with no first token are left out)."""
    cached: dict[int, int] = {}
    prompt: dict[int, int] = {}
    for record in records:
        if math.isnan(record.first_token_s):
            continue
        window = int(record.first_token_s // window_s)
        cached[window] = cached.get(window, 0) + record.cached_tokens
        prompt[window] = prompt.get(window, 0) + record.input_tokens
    return tuple((window * window_s, cached[window] / prompt[window])
                 for window in sorted(prompt) if prompt[window] > 0)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    ttft = record.first_token_s - record.arrival_s
    e2e = record.finish_s - record.arrival_s
    if slo.ttft_s is not None and not ttft <= slo.ttft_s:
        return False
    if slo.e2e_s is not None and not e2e <= slo.e2e_s:
        return False
    if slo.tpot_s is not None and record.output_tokens > 1:
        if not (e2e - ttft) / (record.output_tokens - 1) <= slo.tpot_s:
            return False
    return True
