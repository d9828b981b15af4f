"""Fleet sizing solved, not scaled: the smallest replica count whose per-replica model meets
the brief, found by evaluating that model at each candidate count.

Scaling a utilization as 1/n (⌈n·u/ceiling⌉) is wrong for decode: every decode step reads
all the weights, a floor that does not shrink as the batch per replica does. Each replica
must step as often as its users read tokens, r = decode tok/s ÷ sequences generating, so
decode's share is r × step(batch) ≥ r × step(weights only), whatever n. A candidate of n
serving replicas is therefore re-priced from scratch:

    batch        ⌈generating ÷ n⌉
    prefill      p = prefill tok/s ÷ (n × prefill capacity)          (all-reduce included)
    decode       d = decode tok/s ÷ (n × batch ÷ step(batch))      (= r × step(batch))
    utilization  p + d ≤ the ceiling (sizing.max_utilization)
    TTFT p95     fixed + M/M/1 wait on prefill work + own prefill ≤ the SLO
    ITL p95      the engine configuration's step (max_num_seqs decodes + a chunk) ≤ the SLO
    KV           generating ≤ n × sequences whose KV fits a replica

Every one of these improves as n grows, so the smallest n that passes is found by doubling
then bisecting; when even a very large fleet fails (the decode floor alone breaks the ITL
or the ceiling), the answer is "no count of this replica shape", with the floor that binds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.demand import Load
from sluice.planner.engine_config import engine_config
from sluice.planner.latency import Ttft, ttft
from sluice.planner.result import LoadPoint
from sluice.planner.supply import Replica, batch_per_replica

# Past this many serving replicas the floor binds: more replicas cannot help.
MAX_REPLICAS = 1 << 16


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica count, priced by the per-replica model."""

    serving: int               # replicas carrying the load (spares excluded)
    batch: int                 # sequences decoding per replica
    step_s: float              # its decode step
    prefill_fraction: float
    decode_fraction: float
    ttft: Ttft
    itl_p95_s: float
    kv_share: float            # generating ÷ the serving replicas' KV capacity in sequences
    failures: tuple[str, ...]  # the checks it fails, in words; empty when it meets the brief

    @property
    def utilization(self) -> float:
        return self.prefill_fraction + self.decode_fraction

    @property
    def ok(self) -> bool:
        return not self.failures


def evaluate(brief: Brief, rep: Replica, load: Load, serving: int,
             hit_rate: float | None = None) -> Candidate:
    """The per-replica model at `serving` replicas, checked against ceiling, SLOs and KV; `hit_rate`
    (default: the brief's expected one) sets how much of an SLO-sized input its own prefill computes."""
    cost, slo, ceiling = rep.cost, brief.slo, brief.sizing.max_utilization
    batch = batch_per_replica(load.generating, serving)
    step = cost.decode_step_s(batch, load.context_tokens)
    p = load.prefill_tok_per_s / (serving * cost.prefill_tokens_per_s())
    d = load.decode_tok_per_s / (serving * batch / step)
    per_request = load.prefill_tok_per_s / load.requests_per_s
    hit = brief.workload.prefix_hit_rate if hit_rate is None else hit_rate
    t = ttft(brief, cost, p, d, per_request, hit)
    fleet = serving + brief.sizing.spare_replicas
    itl = engine_config(brief, cost, load, fleet, rep.replicas_per_node).itl_p95_s
    fit = cost.sequences_that_fit(load.context_tokens)
    kv_share = load.generating / (serving * fit) if fit else math.inf
    failures: list[str] = []
    if p + d > ceiling:
        failures.append(f"utilization {fmt.pct(p + d)} > {fmt.pct(ceiling)}")
    if t.p95_s > slo.ttft_p95_s:
        failures.append(f"p95 TTFT {fmt.ms(t.p95_s)} > {fmt.ms(slo.ttft_p95_s)}")
    if itl > slo.itl_p95_s:
        failures.append(f"p95 ITL {fmt.ms(itl)} > {fmt.ms(slo.itl_p95_s)}")
    if kv_share > 1.0:
        failures.append(f"KV needs {fmt.pct(kv_share)} of the pool")
    return Candidate(serving, batch, step, p, d, t, itl, kv_share, tuple(failures))


def solve(brief: Brief, rep: Replica, load: Load, hit_rate: float | None = None) -> Candidate | None:
    """The smallest serving count that meets the brief, or None when none up to MAX_REPLICAS does."""
    hi = 1
    while not evaluate(brief, rep, load, hi, hit_rate).ok:
        if hi >= MAX_REPLICAS:
            return None
        hi = min(hi * 2, MAX_REPLICAS)
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if evaluate(brief, rep, load, mid, hit_rate).ok:
            hi = mid
        else:
            lo = mid + 1
    return evaluate(brief, rep, load, hi, hit_rate)


def floor_reason(brief: Brief, rep: Replica, load: Load) -> str:
    """Why no count of this replica shape meets the brief: what still fails at the largest fleet."""
    last = evaluate(brief, rep, load, MAX_REPLICAS)
    floor = rep.cost.decode_step_s(1, load.context_tokens)
    return (f"even {fmt.count(MAX_REPLICAS)} replicas fail ({'; '.join(last.failures)}): more replicas "
            f"cannot shorten a step below its weight read ({fmt.ms(floor)} at batch 1) nor a prefill below "
            f"{fmt.num(rep.cost.prefill_tokens_per_s())} tok/s per replica")


def load_curve(brief: Brief, rep: Replica, load: Load, serving: int) -> tuple[LoadPoint, ...]:
    """Utilization, p95 TTFT and p95 ITL of `serving` replicas from 0.1× to 2× the brief's traffic."""
    points = []
    for tenth in range(1, 21):
        got = evaluate(brief, rep, load.scaled(traffic=tenth / 10), serving)
        points.append(LoadPoint(tenth / 10, got.utilization, got.ttft.p95_s, got.itl_p95_s))
    return tuple(points)


def traffic_headroom(brief: Brief, rep: Replica, load: Load, serving: int) -> float:
    """The largest traffic factor `serving` replicas carry within the ceiling and SLOs (bisected on the
    per-replica model, not 1/utilization: decode's floor does not scale with traffic)."""
    if not evaluate(brief, rep, load, serving).ok:
        return 0.0
    lo, hi = 1.0, 2.0
    while evaluate(brief, rep, load.scaled(traffic=hi), serving).ok:
        lo, hi = hi, hi * 2
        if hi > 1024:
            return lo
    for _ in range(20):
        mid = (lo + hi) / 2
        if evaluate(brief, rep, load.scaled(traffic=mid), serving).ok:
            lo = mid
        else:
            hi = mid
    return lo
