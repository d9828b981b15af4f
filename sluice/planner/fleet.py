"""The fleet: how busy the shared GPUs are, how many replicas, and what breaks it.

Prefill and decode share every GPU (seed 003 §2), so the fleet's utilization is
the sum of two time shares:

    prefill share = prefill tokens/s needed ÷ prefill capacity
    decode share  = decode tokens/s needed  ÷ decode capacity at the planned batch

Failure scenarios (seed 003 §6) scale those shares with the demand and the
replicas left, which is seed 003's method. It holds each replica's decode
capacity at the planned batch, so it overstates decode when the batch grows (a
bigger batch shares each weight read among more tokens); each row also shows the
figure with decode re-priced at the scenario's own batch, which is lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sluice.engine.cost_model import CostModel
from sluice.planner import fmt
from sluice.planner.brief import FIXED_BUDGET, GOODPUT, USERS, Brief
from sluice.planner.demand import Load
from sluice.planner.errors import BUDGET_BELOW_ONE_REPLICA, BUDGET_NOT_A_MULTIPLE, BriefError
from sluice.planner.result import Figure, Scenario, Section
from sluice.planner.solve import MAX_REPLICAS, Candidate, evaluate, floor_reason, solve
from sluice.planner.supply import Replica, batch_per_replica, with_precision

FITS = "fits"
AT_RISK = "at risk"
OVERLOADED = "overloaded"


@dataclass(frozen=True, slots=True)
class Split:
    replicas: int
    batch: int
    step_s: float
    prefill_capacity: float    # fleet tok/s
    decode_capacity: float     # fleet tok/s at `batch`
    prefill_fraction: float
    decode_fraction: float

    @property
    def utilization(self) -> float:
        return self.prefill_fraction + self.decode_fraction


def split(cost: CostModel, replicas: int, load: Load) -> Split:
    batch = batch_per_replica(load.generating, replicas)
    step = cost.decode_step_s(batch, load.context_tokens)
    prefill_capacity = replicas * cost.prefill_tokens_per_s()
    decode_capacity = replicas * batch / step
    return Split(replicas, batch, step, prefill_capacity, decode_capacity,
                 load.prefill_tok_per_s / prefill_capacity, load.decode_tok_per_s / decode_capacity)


def verdict(utilization: float, ceiling: float) -> str:
    if utilization <= ceiling:
        return FITS
    return AT_RISK if utilization <= 1.0 else OVERLOADED


# --- replica count ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizing:
    replicas: int                 # the fleet planned (spares included)
    needed: Candidate | None      # the smallest serving count that meets the brief (None: no count does)
    figures: tuple[Figure, ...]


def fleet_replicas(brief: Brief, rep: Replica, load: Load) -> Sizing:
    """Replicas of the fleet: the budget's (fixed_budget), the goodput chain's (goodput, seed 000), or
    the solved count (users). In every mode the count needed is solved from the per-replica model."""
    s, tp = brief.sizing, rep.tp
    needed = solve(brief, rep, load)
    if s.mode == FIXED_BUDGET:
        assert s.gpus is not None, "parse_brief requires sizing.gpus in fixed_budget mode"
        if s.gpus < tp:
            raise BriefError("sizing.gpus", BUDGET_BELOW_ONE_REPLICA.format(field="sizing.gpus", value=s.gpus,
                                                                            tp=tp))
        if s.gpus % tp:
            raise BriefError("sizing.gpus", BUDGET_NOT_A_MULTIPLE.format(field="sizing.gpus", value=s.gpus,
                                                                         tp=tp))
        replicas = s.gpus // tp
        budget = Figure("replicas.fleet", "replicas in the budget", replicas, "replicas",
                        f"{s.gpus} GPUs ÷ TP {tp} = {replicas} replicas")
        return Sizing(replicas, needed, (budget,))
    if s.mode == USERS:
        return _users_sizing(brief, rep, load, needed)
    goodput, share = s.goodput_tok_per_s_per_replica, s.prefill_share
    assert goodput is not None and share is not None, "parse_brief requires both in goodput mode"
    decode_only = load.decode_tok_per_s / goodput
    with_prefill = decode_only / (1.0 - share)
    serving = math.ceil(with_prefill - 1e-9)
    replicas = serving + s.spare_replicas
    figures = (
        Figure("replicas.decode_only", "replicas if decode had the GPUs alone", decode_only, "replicas",
               f"{fmt.num(load.decode_tok_per_s)} tok/s ÷ {fmt.num(goodput)} tok/s measured goodput per "
               "replica "
               f"= {fmt.num(decode_only)}"),
        Figure("replicas.with_prefill", "replicas with prefill's share of each", serving, "replicas",
               f"{fmt.num(decode_only)} ÷ (1 − {fmt.num(share)} prefill share) = {fmt.num(with_prefill)} → "
               f"{serving}"),
        Figure("replicas.fleet", "replicas with spares for availability", replicas, "replicas",
               f"{serving} + {s.spare_replicas} spare (N+{s.spare_replicas}, "
               f"{fmt.pct(brief.slo.availability)} "
               f"availability) = {replicas}"),
    )
    return Sizing(replicas, needed, figures)


def goodput_at_itl_slo(brief: Brief, rep: Replica, load: Load) -> tuple[int, float, float]:
    """(batch, step, tok/s): the largest decode batch whose step plus scheduling stays within the p95 ITL
    SLO and whose KV fits, and the goodput it gives, from the engine model instead of a measurement."""
    cost, ctx = rep.cost, load.context_tokens
    limit = brief.slo.itl_p95_s - brief.latency.scheduler_overhead_s
    fit = max(1, cost.sequences_that_fit(ctx))
    lo, hi = 1, fit
    if cost.decode_step_s(1, ctx) > limit:
        hi = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost.decode_step_s(mid, ctx) <= limit:
            lo = mid
        else:
            hi = mid - 1
    step = cost.decode_step_s(lo, ctx)
    return lo, step, lo / step


def _users_sizing(brief: Brief, rep: Replica, load: Load, needed: Candidate | None) -> Sizing:
    """Seed 000's chain from users alone: the goodput at the TPOT SLO comes from the engine model."""
    s, cost = brief.sizing, rep.cost
    batch, step, goodput = goodput_at_itl_slo(brief, rep, load)
    decode_only = load.decode_tok_per_s / goodput
    share = load.prefill_tok_per_s / (max(1, math.ceil(decode_only)) * cost.prefill_tokens_per_s())
    limit = brief.slo.itl_p95_s - brief.latency.scheduler_overhead_s
    figures = [
        Figure("replicas.goodput_at_itl_slo", "decode goodput per replica at the p95 ITL SLO", goodput,
               "tok/s", f"largest batch whose step ≤ {fmt.ms(brief.slo.itl_p95_s)} SLO − "
               f"{fmt.ms(brief.latency.scheduler_overhead_s)} scheduling = {fmt.ms(limit)} (and whose KV "
               f"fits): {batch} ÷ {fmt.ms(step)} = {fmt.num(goodput)} tok/s, from the engine model"),
        Figure("replicas.decode_only", "replicas if decode had the GPUs alone", decode_only, "replicas",
               f"{fmt.num(load.decode_tok_per_s)} tok/s ÷ {fmt.num(goodput)} tok/s = {fmt.num(decode_only)}"),
        Figure("replicas.prefill_share_at_decode_only", "prefill's share at that count", share, "fraction",
               f"{fmt.num(load.prefill_tok_per_s)} ÷ ({max(1, math.ceil(decode_only))} × "
               f"{fmt.num(cost.prefill_tokens_per_s())}) = {fmt.pct(share)}: seed 000's ÷ (1 − share) step, "
               "which the solved count below replaces"),
    ]
    serving = needed.serving if needed is not None else MAX_REPLICAS
    replicas = serving + s.spare_replicas
    figures.append(Figure("replicas.fleet", "replicas with spares for availability", replicas, "replicas",
                          f"{serving} solved (below) + {s.spare_replicas} spare (N+{s.spare_replicas}) = "
                          f"{replicas}" if needed is not None else
                          "no count of this replica shape meets the brief: "
                          f"{floor_reason(brief, rep, load)}"))
    return Sizing(replicas, needed, tuple(figures))


def utilization_section(brief: Brief, rep: Replica, load: Load, base: Split) -> Section:
    ceiling = brief.sizing.max_utilization
    p, d, u = base.prefill_fraction, base.decode_fraction, base.utilization
    figures = [
        Figure("utilization.prefill", "prefill's share of the GPUs", p, "fraction",
               f"{fmt.num(load.prefill_tok_per_s)} ÷ {fmt.num(base.prefill_capacity)} = {fmt.pct(p)}"),
        Figure("utilization.decode", "decode's share of the GPUs", d, "fraction",
               f"{fmt.num(load.decode_tok_per_s)} ÷ {fmt.num(base.decode_capacity)} = {fmt.pct(d)}"),
        Figure("utilization.total", "shared-GPU utilization", u, "fraction",
               f"{fmt.pct(p)} + {fmt.pct(d)} = {fmt.pct(u)} ({verdict(u, ceiling)} under the "
               f"{fmt.pct(ceiling)} ceiling)"),
    ]
    hit = brief.workload.prefix_hit_rate
    if hit > 0 and not brief.workload.prefix_credit_in_sizing:
        cached = load.expected_prefill_tok_per_s / base.prefill_capacity
        figures.append(Figure("utilization.with_expected_cache",
                              "utilization at the expected prefix hit rate", cached + d, "fraction",
                              f"{fmt.num(load.expected_prefill_tok_per_s)} ÷ "
                              f"{fmt.num(base.prefill_capacity)} = "
                              f"{fmt.pct(cached)} + {fmt.pct(d)} = {fmt.pct(cached + d)} (the cache is "
                              "headroom: "
                              "the sizing does not count on it)"))
    return Section("utilization", "Shared-GPU utilization", tuple(figures))


def replicas_section(brief: Brief, rep: Replica, load: Load, base: Split, sizing: Sizing) -> Section:
    s = brief.sizing
    figures = list(sizing.figures)
    n, spares = sizing.replicas, s.spare_replicas
    found = sizing.needed
    if found is None:
        figures.append(Figure("replicas.needed", "serving replicas needed (solved)", math.inf, "replicas",
                              floor_reason(brief, rep, load)))
        figures.append(Figure("replicas.needed_with_spares", "replicas needed with spares", math.inf,
                              "replicas",
                              f"✗ no count of TP{rep.tp} replicas; change TP, precision or model"))
    else:
        below = (evaluate(brief, rep, load, found.serving - 1) if found.serving > 1 else None)
        why_not_fewer = (f"; at {below.serving}: {'; '.join(below.failures)}" if below is not None else "")
        figures.append(Figure("replicas.needed", "serving replicas needed (solved)", found.serving,
                              "replicas",
                              f"smallest count whose per-replica model meets the brief: at {found.serving}, "
                              f"batch {found.batch}, step {fmt.ms(found.step_s)}, utilization "
                              f"{fmt.pct(found.prefill_fraction)} + {fmt.pct(found.decode_fraction)} = "
                              f"{fmt.pct(found.utilization)}, p95 TTFT {fmt.ms(found.ttft.p95_s)}, p95 ITL "
                              f"{fmt.ms(found.itl_p95_s)}{why_not_fewer}"))
        total = found.serving + spares
        check = "✓ within" if total <= n else "✗ more than"
        figures.append(Figure("replicas.needed_with_spares", "replicas needed with spares", total, "replicas",
                              f"{found.serving} + {spares} spare (N+{spares}) = {total}: {check} the {n} "
                              "planned"))
    if s.mode == GOODPUT:
        goodput = s.goodput_tok_per_s_per_replica
        assert goodput is not None
        analytical = base.decode_capacity / n
        serving = n - spares
        share = load.prefill_tok_per_s / (serving * rep.cost.prefill_tokens_per_s())
        figures.append(Figure("replicas.analytical_goodput", "cost-model decode capacity per replica",
                              analytical, "tok/s",
                              f"{base.batch} ÷ {fmt.ms(base.step_s)} = {fmt.num(analytical)} tok/s at the "
                              "planned "
                              f"batch, {fmt.times(analytical / goodput)} the brief's measured "
                              f"{fmt.num(goodput)}",
                              "the measured goodput includes what the roofline cannot see (p95 TPOT "
                              "batching limits, attention kernels below roofline); the sizing uses the "
                              "measured figure"))
        figures.append(Figure("replicas.analytical_prefill_share", "cost-model prefill share", share,
                              "fraction",
                              f"{fmt.num(load.prefill_tok_per_s)} ÷ ({serving} × "
                              f"{fmt.num(rep.cost.prefill_tokens_per_s())} tok/s) = {fmt.pct(share)} vs the "
                              f"brief's {fmt.pct(s.prefill_share or 0)}"))
    gpus = n * rep.tp
    figures.append(Figure("replicas.gpus", "GPUs in the fleet", gpus, "GPUs",
                          f"{n} replicas × TP {rep.tp} = {gpus} × {brief.hardware.name} "
                          f"({fmt.num(gpus / brief.gpus_per_node)} nodes of {brief.gpus_per_node})"))
    return Section("replicas", "Replicas and availability", tuple(figures))


# --- failure scenarios: each re-evaluated with the per-replica model ---------------------------------


def _row(key: str, name: str, change: str, brief: Brief, rep: Replica, load: Load, serving: int,
         hit_rate: float | None = None, note: str = "") -> Scenario:
    if serving < 1:
        return _unservable(key, name, change, "no replica left")
    got = evaluate(brief, rep, load, serving, hit_rate)
    needed = solve(brief, rep, load, hit_rate)
    need = needed.serving + brief.sizing.spare_replicas if needed is not None else math.inf
    formula = (f"{serving} replicas, batch {got.batch}, step {fmt.ms(got.step_s)}: "
               f"{fmt.pct(got.prefill_fraction)} + {fmt.pct(got.decode_fraction)} = "
               f"{fmt.pct(got.utilization)}")
    verdict_text = FITS if got.ok else (OVERLOADED if got.utilization > 1.0 else AT_RISK)
    failures = "; ".join(got.failures)
    return Scenario(key, name, change, got.prefill_fraction, got.decode_fraction, got.utilization, formula,
                    got.ttft.p95_s, got.itl_p95_s, need, verdict_text,
                    "; ".join(part for part in (failures, note) if part))


def _unservable(key: str, name: str, change: str, why: str) -> Scenario:
    """A scenario no fleet of this shape can serve: unbounded shares, overloaded."""
    return Scenario(key, name, change, math.inf, math.inf, math.inf, why, math.inf, math.inf, math.inf,
                    OVERLOADED, why)


def scenarios(brief: Brief, rep: Replica, load: Load, base: Split) -> tuple[Scenario, ...]:
    """Seed 003 §6's table: each failure re-priced by the per-replica model at the fleet it leaves
    (the spares serve until a failure takes them), with the replicas it would need."""
    sc, n = brief.scenarios, base.replicas
    rows: list[Scenario] = []

    hit, expected = sc.prefix_hit_rate, brief.workload.prefix_hit_rate
    if expected > hit:   # a fall only exists below the expected hit rate
        rows.append(_prefix_row(brief, rep, load, n, hit))

    k = sc.traffic_factor
    rows.append(_row("traffic_doubles" if k == 2 else "traffic_grows", f"traffic × {fmt.num(k)}",
                     f"{fmt.count(load.users)} → {fmt.count(load.users * k)} users", brief, rep,
                     load.scaled(traffic=k), n))

    k = sc.input_factor
    grown_ctx = load.context_tokens + round(brief.workload.input_tokens.mean * (k - 1))
    rows.append(_row("inputs_double" if k == 2 else "inputs_grow", f"input lengths × {fmt.num(k)}",
                     f"mean input {fmt.count(brief.workload.input_tokens.mean)} → "
                     f"{fmt.count(brief.workload.input_tokens.mean * k)} tokens, context "
                     f"{fmt.count(load.context_tokens)} → {fmt.count(grown_ctx)}", brief, rep,
                     replace(load.scaled(inputs=k), context_tokens=grown_ctx), n))

    for lost in sc.nodes_lost:
        left = n - lost * rep.replicas_per_node
        name = f"{lost} node{'s' if lost > 1 else ''} lost"
        key = {1: "one_node_lost", 2: "two_nodes_lost"}.get(lost, f"{lost}_nodes_lost")
        rows.append(_row(key, name, f"{n} → {max(left, 0)} replicas", brief, rep, load, left))

    m = brief.model
    if (m.weight_precision, m.kv_precision) != ("bf16", "bf16"):
        rows.append(_precision_row(brief, rep, load, n))
    return tuple(rows)


def _prefix_row(brief: Brief, rep: Replica, load: Load, n: int, hit: float) -> Scenario:
    expected = brief.workload.prefix_hit_rate
    prefill = load.input_tok_per_s * (1.0 - hit)
    change = f"prefill {fmt.num(load.input_tok_per_s)} × (1 − {fmt.num(hit)}) = {fmt.num(prefill)} tok/s"
    if brief.workload.prefix_credit_in_sizing:
        fallen = replace(load, prefill_tok_per_s=prefill, expected_prefill_tok_per_s=prefill)
        note = f"the sizing counted on {fmt.pct(expected)} hits"
    else:
        fallen = replace(load, expected_prefill_tok_per_s=prefill)
        note = ("the sizing never counted on the cache, so utilization is unchanged; TTFT's own prefill "
                f"grows from {fmt.count(brief.slo.ttft_input_tokens * (1 - expected))} to "
                f"{fmt.count(brief.slo.ttft_input_tokens * (1 - hit))} new tokens")
    return _row("prefix_hit_rate_falls", f"prefix hit rate falls to {fmt.pct(hit)}", change, brief, rep,
                fallen, n, hit_rate=hit, note=note)


def _precision_row(brief: Brief, rep: Replica, load: Load, n: int) -> Scenario:
    m = brief.model
    name = f"{m.weight_precision} weights / {m.kv_precision} KV reverted to bf16"
    bf16 = with_precision(brief, rep, "bf16", "bf16")
    change = (f"weights {fmt.gb(rep.cost.weight_bytes_per_gpu())} → "
              f"{fmt.gb(bf16.cost.weight_bytes_per_gpu())} "
              f"per GPU, matmuls {rep.cost.compute_dtype} → {bf16.cost.compute_dtype}")
    if not bf16.cost.fits():
        return _unservable("precision_reverted", name, change + ": no room for KV at this TP",
                           "the weights do not fit")
    ctx = load.context_tokens
    fit = bf16.cost.sequences_that_fit(ctx)
    change += f"; KV holds {fmt.count(fit)} sequences per replica at {fmt.count(ctx)} context"
    return _row("precision_reverted", name, change, brief, bf16, load, n)
