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
from sluice.planner.brief import FIXED_BUDGET, Brief
from sluice.planner.demand import Load
from sluice.planner.errors import BUDGET_BELOW_ONE_REPLICA, BUDGET_NOT_A_MULTIPLE, BriefError
from sluice.planner.result import Figure, Scenario, Section
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
    replicas: int           # the fleet planned (spares included)
    figures: tuple[Figure, ...]


def fleet_replicas(brief: Brief, rep: Replica, load: Load) -> Sizing:
    """Replicas of the fleet: the budget's (fixed_budget) or the goodput chain's (goodput, seed 000)."""
    s, tp = brief.sizing, rep.tp
    if s.mode == FIXED_BUDGET:
        assert s.gpus is not None, "parse_brief requires sizing.gpus in fixed_budget mode"
        if s.gpus < tp:
            raise BriefError("sizing.gpus", BUDGET_BELOW_ONE_REPLICA.format(field="sizing.gpus", value=s.gpus,
                                                                            tp=tp))
        if s.gpus % tp:
            raise BriefError("sizing.gpus", BUDGET_NOT_A_MULTIPLE.format(field="sizing.gpus", value=s.gpus,
                                                                         tp=tp))
        replicas = s.gpus // tp
        return Sizing(replicas, (Figure("replicas.fleet", "replicas in the budget", replicas, "replicas",
                                        f"{s.gpus} GPUs ÷ TP {tp} = {replicas} replicas"),))
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
    return Sizing(replicas, figures)


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
    figures.append(Figure("utilization.growth_to_ceiling", "demand growth before the ceiling", ceiling / u,
                          "x",
                          f"{fmt.pct(ceiling)} ÷ {fmt.pct(u)} = {fmt.times(ceiling / u)}; to saturation "
                          f"1 ÷ {fmt.pct(u)} = {fmt.times(1 / u)}"))
    return Section("utilization", "Shared-GPU utilization", tuple(figures))


def replicas_section(brief: Brief, rep: Replica, load: Load, base: Split, sizing: Sizing) -> Section:
    s, ceiling = brief.sizing, brief.sizing.max_utilization
    figures = list(sizing.figures)
    n = sizing.replicas
    needed = math.ceil(n * base.utilization / ceiling - 1e-9)
    figures.append(Figure("replicas.needed", "replicas needed at the utilization ceiling", needed, "replicas",
                          f"⌈{n} × {fmt.pct(base.utilization)} ÷ {fmt.pct(ceiling)}⌉ = "
                          f"⌈{fmt.num(n * base.utilization / ceiling)}⌉ = {needed} (shares scale as 1 ÷ "
                          "replicas)"))
    total = needed + s.spare_replicas
    check = "✓ within" if total <= n else "✗ more than"
    figures.append(Figure("replicas.needed_with_spares", "replicas needed with spares", total, "replicas",
                          f"{needed} + {s.spare_replicas} spare (N+{s.spare_replicas}) = {total}: "
                          f"{check} the {n} planned"))
    if s.mode != FIXED_BUDGET:
        goodput = s.goodput_tok_per_s_per_replica
        assert goodput is not None
        analytical = base.decode_capacity / n
        serving = n - s.spare_replicas
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


# --- failure scenarios ------------------------------------------------------------------------------


def _row(key: str, name: str, change: str, p: float, d: float, formula: str, rebatched: float,
         rebatched_formula: str, ceiling: float, note: str = "") -> Scenario:
    u = p + d
    return Scenario(key, name, change, p, d, u, f"{formula} = {fmt.pct(u)}", rebatched, rebatched_formula,
                    verdict(u, ceiling), note)


def _unservable(key: str, name: str, change: str, why: str) -> Scenario:
    """A scenario no fleet of this shape can serve: unbounded shares, overloaded."""
    return Scenario(key, name, change, math.inf, math.inf, math.inf, why, math.inf, why, OVERLOADED)


def _rebatched(cost: CostModel, replicas: int, load: Load) -> tuple[float, str]:
    again = split(cost, replicas, load)
    return again.utilization, (f"batch {again.batch}, step {fmt.ms(again.step_s)}: "
                               f"{fmt.pct(again.prefill_fraction)}"
                               f" + {fmt.pct(again.decode_fraction)} = {fmt.pct(again.utilization)}")


def scenarios(brief: Brief, rep: Replica, load: Load, base: Split) -> tuple[Scenario, ...]:
    sc, ceiling, cost, n = brief.scenarios, brief.sizing.max_utilization, rep.cost, base.replicas
    p, d = base.prefill_fraction, base.decode_fraction
    rows: list[Scenario] = []

    hit, expected = sc.prefix_hit_rate, brief.workload.prefix_hit_rate
    if expected > hit:   # a fall only exists below the expected hit rate
        rows.append(_prefix_row(brief, load, base, hit))

    k = sc.traffic_factor
    again, again_formula = _rebatched(cost, n, load.scaled(traffic=k))
    rows.append(_row("traffic_doubles" if k == 2 else "traffic_grows", f"traffic × {fmt.num(k)}",
                     f"{fmt.count(load.users)} → {fmt.count(load.users * k)} users", p * k, d * k,
                     f"({fmt.pct(p)} + {fmt.pct(d)}) × {fmt.num(k)}", again, again_formula, ceiling))

    k = sc.input_factor
    longer = load.scaled(inputs=k)
    grown_ctx = load.context_tokens + round(brief.workload.input_tokens.mean * (k - 1))
    again, again_formula = _rebatched(cost, n, replace(longer, context_tokens=grown_ctx))
    rows.append(_row("inputs_double" if k == 2 else "inputs_grow", f"input lengths × {fmt.num(k)}",
                     f"mean input {fmt.count(brief.workload.input_tokens.mean)} → "
                     f"{fmt.count(brief.workload.input_tokens.mean * k)} tokens", p * k, d,
                     f"{fmt.pct(p)} × {fmt.num(k)} + {fmt.pct(d)}", again,
                     again_formula + f" (context {fmt.count(load.context_tokens)} → {fmt.count(grown_ctx)})",
                     ceiling))

    for lost in sc.nodes_lost:
        left = n - lost * rep.replicas_per_node
        name = f"{lost} node{'s' if lost > 1 else ''} lost"
        key = {1: "one_node_lost", 2: "two_nodes_lost"}.get(lost, f"{lost}_nodes_lost")
        if left < 1:
            rows.append(_unservable(key, name, f"{n} → 0 replicas", "no replica left"))
            continue
        scale = n / left
        again, again_formula = _rebatched(cost, left, load)
        rows.append(_row(key, name, f"{n} → {left} replicas", p * scale, d * scale,
                         f"({fmt.pct(p)} + {fmt.pct(d)}) × {n}/{left}", again, again_formula, ceiling))

    m = brief.model
    if (m.weight_precision, m.kv_precision) != ("bf16", "bf16"):
        rows.append(_precision_row(brief, rep, load, base))
    return tuple(rows)


def _prefix_row(brief: Brief, load: Load, base: Split, hit: float) -> Scenario:
    d, ceiling = base.decode_fraction, brief.sizing.max_utilization
    prefill = load.input_tok_per_s * (1.0 - hit)
    p_hit = prefill / base.prefill_capacity
    cached = load.expected_prefill_tok_per_s
    note = (f"prefill demand × {fmt.num(prefill / cached, 3)} against the expected "
            f"{fmt.pct(brief.workload.prefix_hit_rate)} hit ({fmt.pct(cached / base.prefill_capacity + d)} "
            "utilization)")
    if not brief.workload.prefix_credit_in_sizing:
        note += "; the sizing never counted on the cache, so the fall stays inside the planned utilization"
    return _row("prefix_hit_rate_falls", f"prefix hit rate falls to {fmt.pct(hit)}",
                f"prefill {fmt.num(load.input_tok_per_s)} × (1 − {fmt.num(hit)}) = {fmt.num(prefill)} tok/s",
                p_hit, d, f"{fmt.pct(p_hit)} + {fmt.pct(d)}", p_hit + d, "same batch", ceiling, note)


def _precision_row(brief: Brief, rep: Replica, load: Load, base: Split) -> Scenario:
    m, ceiling = brief.model, brief.sizing.max_utilization
    name = f"{m.weight_precision} weights / {m.kv_precision} KV reverted to bf16"
    bf16 = with_precision(brief, rep, "bf16", "bf16")
    change = (f"weights {fmt.gb(rep.cost.weight_bytes_per_gpu())} → "
              f"{fmt.gb(bf16.cost.weight_bytes_per_gpu())} "
              f"per GPU")
    if not bf16.cost.fits():
        return _unservable("precision_reverted", name, change + ": no room for KV at this TP",
                           "the weights do not fit")
    ctx = load.context_tokens
    step = bf16.cost.decode_step_s(base.batch, ctx)
    slower = step / base.step_s
    prefill_ratio = rep.cost.prefill_tokens_per_s() / bf16.cost.prefill_tokens_per_s()
    p, d = base.prefill_fraction * prefill_ratio, base.decode_fraction * slower
    fit = bf16.cost.sequences_that_fit(ctx)
    change += (f"; decode step {fmt.ms(base.step_s)} → {fmt.ms(step)} ({fmt.times(slower)} slower); KV holds "
               f"{fmt.count(fit)} sequences per replica at {fmt.count(ctx)} context "
               f"({'≥' if fit >= base.batch else '<'} batch {base.batch})")
    prefill_part = (f"{fmt.pct(base.prefill_fraction)}" if prefill_ratio == 1.0
                    else f"{fmt.pct(base.prefill_fraction)} × {fmt.num(prefill_ratio, 3)}")
    again, again_formula = _rebatched(bf16.cost, base.replicas, load)
    note = ("prefill is unchanged: its matmuls were already priced at bf16 (efficiency.compute_dtype)"
            if prefill_ratio == 1.0 else "")
    return _row("precision_reverted", name, change, p, d,
                f"{prefill_part} + {fmt.pct(base.decode_fraction)} × {fmt.num(slower, 3)}", again,
                again_formula, ceiling, note)
