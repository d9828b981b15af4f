"""TTFT and ITL, analytically: the budget seed 003 §5 writes by hand, with its
queueing term made explicit.

Queueing model (stated, not hidden). What delays a new request's first token is the
prefill work queued ahead of it, not other sequences' decoding: an inflight-batching
engine keeps decoding while it prefills, decode only takes its share of every step.
So each replica is one prefill server that runs at the prefill rate left over by
decode, C × (1 − d), where C is the replica's prefill capacity (all-reduce included)
and d decode's share of the GPU. Its load is ρ = p ÷ (1 − d), p being prefill's share
(ρ < 1 exactly when p + d < 1), and a mean request's service time is its prefill
tokens (the sizing basis) ÷ C(1 − d). M/M/1 then gives the mean wait ρ/(1 − ρ)·S and
the p95 wait S/(1 − ρ)·ln(ρ/0.05). The SLO-sized input's own prefill (its uncached
tokens at the expected hit rate) follows at the same rate. `--simulate` measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.engine.cost_model import CostModel
from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.result import Figure, Section

_P95_TAIL = 0.05


@dataclass(frozen=True, slots=True)
class Ttft:
    fixed_s: float
    new_tokens: float        # uncached tokens of the SLO-sized input
    prefill_s: float         # alone on the GPU
    interleaved_s: float     # at the prefill rate decode leaves
    rho: float               # the prefill server's load, p ÷ (1 − d)
    service_s: float         # a mean request's prefill at that rate
    wait_mean_s: float
    wait_p95_s: float

    @property
    def mean_s(self) -> float:
        return self.fixed_s + self.wait_mean_s + self.interleaved_s

    @property
    def p95_s(self) -> float:
        return self.fixed_s + self.wait_p95_s + self.interleaved_s


def queue_wait(rho: float, service_s: float) -> tuple[float, float]:
    """M/M/1 waiting time (mean, p95); infinite at or above saturation."""
    if rho >= 1.0:
        return math.inf, math.inf
    mean = rho / (1.0 - rho) * service_s
    p95 = service_s / (1.0 - rho) * math.log(rho / _P95_TAIL) if rho > _P95_TAIL else 0.0
    return mean, p95


def ttft(brief: Brief, cost: CostModel, prefill_fraction: float, decode_fraction: float,
         prefill_tokens_per_request: float, hit_rate: float) -> Ttft:
    """TTFT of an SLO-sized input on a replica whose prefill and decode take these shares."""
    lat = brief.latency
    fixed = (lat.network_rtt_s + lat.gateway_s + lat.tokenization_s + lat.first_sample_s
             + lat.sse_first_write_s)
    new_tokens = brief.slo.ttft_input_tokens * (1.0 - hit_rate)
    rate = cost.prefill_tokens_per_s()
    left = rate * (1.0 - decode_fraction) if decode_fraction < 1.0 else 0.0
    alone = new_tokens / rate
    interleaved = new_tokens / left if left > 0 else math.inf
    rho = prefill_fraction / (1.0 - decode_fraction) if decode_fraction < 1.0 else math.inf
    service = prefill_tokens_per_request / left if left > 0 else math.inf
    wait_mean, wait_p95 = queue_wait(rho, service)
    return Ttft(fixed, new_tokens, alone, interleaved, rho, service, wait_mean, wait_p95)


def _check(value: float, limit: float) -> str:
    return "✓" if value <= limit else "✗"


def latency_section(brief: Brief, cost: CostModel, t: Ttft, utilization: float, prefill_fraction: float,
                    decode_step_s: float, itl_p95_s: float, itl_p95_formula: str,
                    prefill_tokens_per_request: float) -> Section:
    lat, slo = brief.latency, brief.slo
    hit = brief.workload.prefix_hit_rate
    overhead = lat.scheduler_overhead_s
    itl_mean = (decode_step_s + overhead) / (1.0 - prefill_fraction) if prefill_fraction < 1 else math.inf
    rho, decode = t.rho, utilization - prefill_fraction
    figures = (
        Figure("latency.fixed_s", "network, gateway, tokenization, first sample, first SSE write", t.fixed_s,
               "s", f"{fmt.ms(lat.network_rtt_s)} + {fmt.ms(lat.gateway_s)} + {fmt.ms(lat.tokenization_s)} + "
               f"{fmt.ms(lat.first_sample_s)} + {fmt.ms(lat.sse_first_write_s)} = {fmt.ms(t.fixed_s)}"),
        Figure("latency.ttft_new_tokens", "uncached tokens of an SLO-sized input", t.new_tokens, "tokens",
               f"{fmt.count(slo.ttft_input_tokens)} × (1 − {fmt.num(hit)} expected prefix hit) = "
               f"{fmt.count(t.new_tokens)} tokens"),
        Figure("latency.prefill_s", "its prefill, interleaved with decode", t.interleaved_s, "s",
               f"{fmt.count(t.new_tokens)} ÷ {fmt.num(cost.prefill_tokens_per_s())} tok/s = "
               f"{fmt.ms(t.prefill_s)}"
               f", ÷ (1 − {fmt.pct(decode)} decode share) = {fmt.ms(t.interleaved_s)}"),
        Figure("latency.prefill_load", "load of the prefill queue (prefill ÷ what decode leaves)", t.rho,
               "fraction", f"ρ = {fmt.pct(prefill_fraction)} ÷ (1 − {fmt.pct(decode)}) = {fmt.pct(t.rho)}"),
        Figure("latency.service_s", "prefill of a mean request (queueing service time)", t.service_s, "s",
               f"{fmt.count(prefill_tokens_per_request)} tokens ÷ ({fmt.num(cost.prefill_tokens_per_s())} × "
               f"(1 − {fmt.pct(decode)})) tok/s = {fmt.ms(t.service_s)}: only prefill blocks a new request"),
        Figure("latency.queue_wait_mean_s", "mean queue wait (M/M/1 on prefill work)", t.wait_mean_s, "s",
               f"ρ/(1 − ρ) × S = {fmt.num(rho)}/{fmt.num(1 - rho)} × {fmt.ms(t.service_s)} = "
               f"{fmt.ms(t.wait_mean_s)}" if rho < 1 else "ρ ≥ 1: the queue grows without bound"),
        Figure("latency.queue_wait_p95_s", "p95 queue wait (M/M/1 on prefill work)", t.wait_p95_s, "s",
               f"S/(1 − ρ) × ln(ρ/0.05) = {fmt.ms(t.service_s / (1 - rho))} × "
               f"{fmt.num(math.log(max(rho, _P95_TAIL) / _P95_TAIL))} = {fmt.ms(t.wait_p95_s)}"
               if rho < 1 else "ρ ≥ 1: the queue grows without bound"),
        Figure("latency.ttft_mean_s", "mean TTFT", t.mean_s, "s",
               f"{fmt.ms(t.fixed_s)} + {fmt.ms(t.wait_mean_s)} + {fmt.ms(t.interleaved_s)} = "
               f"{fmt.ms(t.mean_s)}"),
        Figure("latency.ttft_p95_s", "p95 TTFT", t.p95_s, "s",
               f"{fmt.ms(t.fixed_s)} + {fmt.ms(t.wait_p95_s)} + {fmt.ms(t.interleaved_s)} = "
               f"{fmt.ms(t.p95_s)} vs the {fmt.ms(slo.ttft_p95_s)} SLO {_check(t.p95_s, slo.ttft_p95_s)}"),
        Figure("latency.itl_mean_s", "mean inter-token latency", itl_mean, "s",
               f"({fmt.ms(decode_step_s)} step + {fmt.ms(overhead)} scheduling) ÷ (1 − "
               f"{fmt.pct(prefill_fraction)}"
               f" prefill share) = {fmt.ms(itl_mean)}"),
        Figure("latency.itl_p95_s", "p95 inter-token latency (a step carrying a full prefill chunk)",
               itl_p95_s, "s", f"{itl_p95_formula} vs the {fmt.ms(slo.itl_p95_s)} SLO "
               f"{_check(itl_p95_s, slo.itl_p95_s)}"),
    )
    return Section("latency", "Latency: TTFT budget and ITL", figures)
