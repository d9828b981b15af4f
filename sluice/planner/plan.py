"""`plan(brief) -> Plan`: the whole sizing, in the order a reader checks it.

    demand → replica (TP, memory) → fleet size → decode, prefill → utilization
    → replicas → engine configuration → latency → cost → failure scenarios
    → critical dependencies → verdict → comparison with the brief's reference figures
"""

from __future__ import annotations

import math
from dataclasses import replace

from sluice.planner import fmt
from sluice.planner.brief import GOODPUT, Brief
from sluice.planner.cost import cost_section
from sluice.planner.demand import Load, demand
from sluice.planner.engine_config import EngineConfig, engine_config
from sluice.planner.errors import UNKNOWN_REFERENCE_FIGURE, BriefError
from sluice.planner.fleet import (
    FITS,
    Sizing,
    Split,
    fleet_replicas,
    replicas_section,
    scenarios,
    split,
    utilization_section,
)
from sluice.planner.kv_tier import kv_tier_section
from sluice.planner.latency import Ttft, latency_section, ttft
from sluice.planner.result import REFERENCE_TOLERANCE, Figure, Plan, ReferenceCheck, Scenario
from sluice.planner.solve import MAX_REPLICAS, evaluate, load_curve, solve, traffic_headroom
from sluice.planner.supply import (
    Replica,
    decode_section,
    memory_section,
    prefill_section,
    replica,
    tp_choices,
)

_MODELLING_NOTES = (
    "Every hardware figure comes from engine.cost_model.CostModel, the core the replica engine and the "
    "simulator also price steps with.",
    "Utilization = prefill tokens/s ÷ prefill capacity + decode tokens/s ÷ decode capacity at the planned "
    "batch (seed 003 §2); failure rows scale those shares (seed 003's method) and also show decode re-priced "
    "at the scenario's own batch.",
    "Queueing is M/M/1 on each replica's prefill work, served at the rate decode leaves (an "
    "inflight-batching engine keeps decoding while a request waits); --simulate measures it.",
)


def _search_tp(brief: Brief, load: Load) -> tuple[Replica, Figure | None]:
    """`sizing.tp: auto`: of the TP degrees that fit a node, the one whose solved fleet needs the fewest
    GPUs (ties: the larger TP, for the shorter step)."""
    if not brief.sizing.search_tp:
        return replica(brief), None
    spares, options = brief.sizing.spare_replicas, []
    for tp in tp_choices(brief.gpus_per_node, brief.model):
        try:
            rep = replica(brief, tp)
        except BriefError:
            continue   # too small to hold the weights
        found = solve(brief, rep, load)
        gpus = (found.serving + spares) * tp if found is not None else math.inf
        options.append((gpus, -tp, rep))
    if not options:
        return replica(brief), None   # raises the refusal with the smallest configuration that fits
    gpus, _, best = min(options, key=lambda option: (option[0], option[1]))
    listing = ", ".join(f"TP{rep.tp}: {fmt.count(g) if math.isfinite(g) else 'none'}"
                        for g, _, rep in sorted(options, key=lambda o: -o[1]))
    return best, Figure("memory.tp_search", "TP chosen by the solved fleet size", best.tp, "",
                        f"GPUs needed with spares at each TP that fits — {listing}: TP {best.tp} needs the "
                        "fewest")


def _search_precision(brief: Brief, load: Load) -> tuple[Brief, tuple[Figure, ...]]:
    """`sizing.precision`: the brief with weights and KV at the allowed precision whose solved fleet (at
    the brief's TP, or the searched one) needs the fewest GPUs. One GPU-hour price per brief, so fewest
    GPUs is also cheapest; ties go to the wider precision, which risks no accuracy."""
    if not brief.sizing.precisions:
        return brief, ()
    spares = brief.sizing.spare_replicas
    options: list[tuple[float, Brief]] = []
    lines: list[Figure] = []
    refusals: list[BriefError] = []
    for precision in brief.sizing.precisions:
        gpus: float = math.inf
        candidate = replace(brief, model=brief.model.with_precision(precision, precision))
        try:
            rep, _ = _search_tp(candidate, load)
        except BriefError as error:   # the weights fit no allowed TP at this precision
            refusals.append(error)
            line = f"refused: {error}"
        else:
            found = solve(candidate, rep, load)
            gpus = (found.serving + spares) * rep.tp if found is not None else math.inf
            line = (f"TP{rep.tp}: ({found.serving} + {spares} spare) × {rep.tp} = {fmt.count(gpus)} GPUs, "
                    f"p95 ITL {fmt.ms(found.itl_p95_s)}, p95 TTFT {fmt.ms(found.ttft.p95_s)}, utilization "
                    f"{fmt.pct(found.utilization)}" if found is not None else
                    f"TP{rep.tp}: no replica count meets the brief (at {fmt.count(MAX_REPLICAS)}: "
                    f"{'; '.join(evaluate(candidate, rep, load, MAX_REPLICAS).failures)})")
            options.append((gpus, candidate))
        lines.append(Figure(f"memory.precision.{precision}", f"{precision} weights and KV", gpus, "GPUs",
                            f"{precision} {line}"))
    if not options:
        raise refusals[0]
    gpus, best = min(options, key=lambda option: (option[0], -option[1].model.bytes_per_weight))
    chosen = best.model.weight_precision
    why = (f"{chosen} needs the fewest GPUs of {', '.join(brief.sizing.precisions)} (one line each above)"
           if math.isfinite(gpus) else f"no allowed precision meets the brief; planned at {chosen}")
    return best, (*lines, Figure("memory.precision_search", f"precision chosen by the solved fleet size: "
                                 f"{chosen}", gpus, "GPUs", why))


def plan(brief: Brief) -> Plan:
    load, demand_figures = demand(brief)
    brief, precision_figures = _search_precision(brief, load)
    rep, tp_figure = _search_tp(brief, load)
    sizing = fleet_replicas(brief, rep, load)
    n = sizing.replicas
    base = split(rep.cost, n, load)
    config = engine_config(brief, rep.cost, load, n, rep.replicas_per_node)
    per_request = load.prefill_tok_per_s / load.requests_per_s
    t = ttft(brief, rep.cost, base.prefill_fraction, base.decode_fraction, per_request,
             brief.workload.prefix_hit_rate)
    gpus = n * rep.tp
    memory = memory_section(brief, rep, load, n)
    searched = (tp_figure,) if tp_figure is not None else ()
    memory = replace(memory, figures=(*memory.figures, *searched, *precision_figures))
    serving = max(1, n - brief.sizing.spare_replicas)
    growth = traffic_headroom(brief, rep, load, serving)
    utilization = utilization_section(brief, rep, load, base)
    utilization = replace(utilization, figures=(*utilization.figures, Figure(
        "utilization.traffic_headroom", "traffic growth the fleet carries (spares down)", growth, "x",
        f"largest factor on today's traffic at which {serving} serving replicas still meet the ceiling and "
        f"SLOs: {fmt.times(growth)} (bisected on the per-replica model)")))
    sections = (
        demand_figures,
        memory,
        kv_tier_section(brief, rep, load, n),
        decode_section(brief, rep, load, n),
        prefill_section(brief, rep, load, n),
        utilization,
        replicas_section(brief, rep, load, base, sizing),
        latency_section(brief, rep.cost, t, base.utilization, base.prefill_fraction, base.step_s,
                        config.itl_p95_s, config.itl_p95_formula, per_request),
        cost_section(brief, load, gpus),
    )
    rows = scenarios(brief, rep, load, base)
    meets, verdict_text = _verdict(brief, rep, load, base, sizing, rows, t, config)
    result = Plan(
        brief=brief.name,
        mode=brief.sizing.mode,
        sections=sections,
        scenarios=rows,
        engine_config=config.settings,
        dependencies=_dependencies(brief, rep, load, base, rows, growth),
        verdict=verdict_text,
        meets_slo=meets,
        replicas=n,
        gpus=gpus,
        assumptions=brief.defaults + _MODELLING_NOTES,
        reference_source=brief.reference.source if brief.reference else "",
        reference_checks=(),
        curves=load_curve(brief, rep, load, n),
        limits=(brief.sizing.max_utilization, brief.slo.ttft_p95_s, brief.slo.itl_p95_s),
        architecture=(brief.model.name,
                      f"{brief.model.weight_precision} weights, {brief.model.kv_precision} KV",
                      brief.hardware.name, str(rep.tp), str(rep.replicas_per_node), str(brief.gpus_per_node),
                      str(brief.sizing.spare_replicas)),
    )
    return _compare_with_reference(brief, result)


def _verdict(brief: Brief, rep: Replica, load: Load, base: Split, sizing: Sizing,
             rows: tuple[Scenario, ...], t: Ttft, config: EngineConfig) -> tuple[bool, str]:
    ceiling, slo = brief.sizing.max_utilization, brief.slo
    fleet_sequences = rep.cost.sequences_that_fit(load.context_tokens) * base.replicas
    found = sizing.needed
    needed = found.serving + brief.sizing.spare_replicas if found is not None else math.inf
    memory_share = load.generating / fleet_sequences if fleet_sequences else math.inf
    shares = {"prefill compute": base.prefill_fraction, "decode bandwidth": base.decode_fraction,
              "KV memory": memory_share}
    binding = max(shares, key=lambda name: shares[name])
    def cmp(ok: bool) -> str:
        return "≤" if ok else ">"

    checks = [
        (ok := base.utilization <= ceiling, f"utilization {fmt.pct(base.utilization)} {cmp(ok)} the "
                                            f"{fmt.pct(ceiling)} ceiling"),
        (ok := t.p95_s <= slo.ttft_p95_s, f"p95 TTFT {fmt.ms(t.p95_s)} {cmp(ok)} {fmt.ms(slo.ttft_p95_s)}"),
        (ok := config.itl_p95_s <= slo.itl_p95_s,
         f"p95 ITL {fmt.ms(config.itl_p95_s)} {cmp(ok)} {fmt.ms(slo.itl_p95_s)}"),
        (ok := memory_share <= 1.0, f"KV for {fmt.num(load.generating)} generating sequences needs "
                                    f"{fmt.pct(memory_share)} of the fleet's pool"),
        (ok := needed <= base.replicas,
         f"{fmt.count(needed) if math.isfinite(needed) else 'no count of'} replicas needed with spares "
         f"{cmp(ok)} {base.replicas} planned"),
    ]
    meets = all(ok for ok, _ in checks)
    failed = [text for ok, text in checks if not ok]
    survived = [row.name for row in rows if row.key.endswith("lost") and row.verdict == FITS]
    text = (f"{'Meets' if meets else 'Does not meet'} the SLO. {base.replicas} × TP{rep.tp} replicas "
            f"({base.replicas * rep.tp} × {brief.hardware.name}) run at {fmt.pct(base.utilization)} "
            "utilization "
            f"(prefill {fmt.pct(base.prefill_fraction)} + decode {fmt.pct(base.decode_fraction)}); "
            f"p95 TTFT ≈ {fmt.ms(t.p95_s)} (SLO {fmt.ms(slo.ttft_p95_s)}), p95 ITL ≤ "
            f"{fmt.ms(config.itl_p95_s)} "
            f"(SLO {fmt.ms(slo.itl_p95_s)}). The binding resource is {binding} ({fmt.pct(shares[binding])}).")
    if failed:
        text += " Fails: " + "; ".join(failed) + "."
    if survived:
        text += f" Within the ceiling with {survived[-1]}."
    return meets, text


_HINTS = {
    "prefix_hit_rate_falls": "monitor the hit rate and alert on drops; keep prompt prefixes cache-friendly",
    "traffic_doubles": "order capacity ahead of growth (lead time); shed with retry-after above the ceiling",
    "traffic_grows": "order capacity ahead of growth (lead time); shed with retry-after above the ceiling",
    "inputs_double": "watch input lengths (retrieval, history); cap context or add prefill capacity",
    "inputs_grow": "watch input lengths (retrieval, history); cap context or add prefill capacity",
    "precision_reverted": "validate the lower precision's quality before committing; keep a second "
                          "method (e.g. INT8 W8A8) as fallback",
}


def _dependencies(brief: Brief, rep: Replica, load: Load, base: Split,
                  rows: tuple[Scenario, ...], growth: float) -> tuple[str, ...]:
    ceiling, w, f = brief.sizing.max_utilization, brief.workload, brief.factors
    deps: list[str] = []
    for row in sorted(rows, key=lambda r: -r.utilization):
        if row.verdict != FITS:
            hint = _HINTS.get(row.key, "keep a spare failure domain; restore capacity before a second loss")
            need = (f"{fmt.count(row.replicas_needed)} replicas needed" if math.isfinite(row.replicas_needed)
                    else "no count of these replicas serves it")
            deps.append(f"{row.name}: utilization {fmt.pct(row.utilization)} ({row.verdict}; {need}) — "
                        f"{hint}.")
    precision = next((row for row in rows if row.key == "precision_reverted"), None)
    if precision is not None and precision.verdict == FITS:
        deps.append(f"Precision: the plan uses {brief.model.weight_precision} weights and "
                    f"{brief.model.kv_precision} KV; reverted to bf16 it would run at "
                    f"{fmt.pct(precision.utilization)}, within the ceiling — a margin, not a dependency.")
    if w.prefix_credit_in_sizing and w.prefix_hit_rate > 0:
        raw = load.input_tok_per_s / base.prefill_capacity
        floor = 1.0 - (ceiling - base.decode_fraction) / raw
        deps.append(f"Prefix cache hit rate ≥ {fmt.pct(max(floor, 0.0))}: the sizing counts on "
                    f"{fmt.pct(w.prefix_hit_rate)}; below the floor utilization passes {fmt.pct(ceiling)}.")
    elif w.prefix_hit_rate > 0:
        cold = brief.slo.ttft_input_tokens * (1 - brief.scenarios.prefix_hit_rate)
        cold_t = ttft(brief, rep.cost, base.prefill_fraction, base.decode_fraction,
                      load.prefill_tok_per_s / load.requests_per_s, brief.scenarios.prefix_hit_rate)
        deps.append(f"Prefix cache for TTFT: an SLO-sized input ({fmt.count(brief.slo.ttft_input_tokens)} "
                    "tokens) "
                    f"prefills {fmt.count(brief.slo.ttft_input_tokens * (1 - w.prefix_hit_rate))} new tokens "
                    "at the "
                    f"expected {fmt.pct(w.prefix_hit_rate)} hit rate, {fmt.count(cold)} at "
                    f"{fmt.pct(brief.scenarios.prefix_hit_rate)}: p95 TTFT ≈ {fmt.ms(cold_t.p95_s)} "
                    f"(SLO {fmt.ms(brief.slo.ttft_p95_s)}). Prompt structure must stay cache-friendly.")
    turn = f"a turn every {fmt.num(load.turn_period_s / growth)} s instead of " if growth > 0 else "today: "
    deps.append(f"Demand model: users ÷ turn period sets every token rate; with its spares down the fleet "
                f"meets the ceiling and SLOs up to {fmt.times(growth)} today's request rate "
                f"({turn}{fmt.num(load.turn_period_s)} s). Measure the duty cycle before committing.")
    deps.append(f"Efficiency assumptions: {fmt.pct(f.achieved_bandwidth_fraction)} of HBM bandwidth, "
                f"{fmt.pct(f.achieved_flops_fraction)} of {rep.cost.compute_dtype} dense FLOP/s, "
                f"{fmt.pct(rep.cost.allreduce_share)} of each TP {rep.tp} step in all-reduce — measure a "
                "replica's decode "
                "step "
                "and prefill rate first.")
    if brief.lora is not None:
        deps.append(f"Multi-LoRA: {brief.lora.adapters} adapters on one base model; route adapter-aware (a "
                    "request to a replica that has its adapter loaded, affinity as for prefixes) and measure "
                    f"the batched-adapter overhead ({fmt.pct(brief.lora.overhead)} assumed).")
    if brief.sizing.mode == GOODPUT:
        deps.append(f"Measured goodput ({fmt.num(brief.sizing.goodput_tok_per_s_per_replica or 0)} tok/s per "
                    f"replica) and prefill share ({fmt.pct(brief.sizing.prefill_share or 0)}) are inputs: "
                    "re-measure them for each model, GPU and SLO.")
    return tuple(deps)


def _reference_value(result: Plan, key: str) -> tuple[str, float, str] | None:
    """(label, value, unit) of a plan figure, scenario ("scenarios.<key>") or setting ("engine.<name>")."""
    group, _, name = key.partition(".")
    if group == "scenarios":
        row = next((r for r in result.scenarios if r.key == name), None)
        return (row.name, row.utilization, "fraction") if row else None
    if group == "engine":
        setting = next((s for s in result.engine_config if s.name == name), None)
        return (setting.name, setting.value, "") if setting else None
    try:
        figure = result.figure(key)
    except KeyError:
        return None
    return figure.label, figure.value, figure.unit


def _known_reference_keys(result: Plan) -> str:
    keys = [figure.key for figure in result.figures()]
    keys += [f"scenarios.{row.key}" for row in result.scenarios]
    keys += [f"engine.{setting.name}" for setting in result.engine_config]
    return ", ".join(keys)


def _compare_with_reference(brief: Brief, result: Plan) -> Plan:
    if brief.reference is None:
        return result
    checks: list[ReferenceCheck] = []
    notes: dict[str, str] = {}
    for key, printed in brief.reference.figures.items():
        found = _reference_value(result, key)
        if found is None:
            field = f"reference.figures.{key}"
            raise BriefError(field, UNKNOWN_REFERENCE_FIGURE.format(field=field, value=key,
                                                                    known=_known_reference_keys(result)))
        label, planned, unit = found
        diff = (planned - printed.value) / printed.value if printed.value else planned - printed.value
        matches = abs(diff) <= REFERENCE_TOLERANCE
        checks.append(ReferenceCheck(key, label, printed.value, planned, unit, diff, matches, printed.why))
        if not matches:
            notes[key] = (f"{brief.reference.source} prints {fmt.value(printed.value, unit)} "
                          f"({diff:+.1%} from this arithmetic)" + (f": {printed.why}" if printed.why else ""))

    def annotate(figure: Figure) -> Figure:
        extra = notes.get(figure.key)
        if not extra:
            return figure
        return replace(figure, note=f"{figure.note}; {extra}" if figure.note else extra)

    sections = tuple(replace(section, figures=tuple(annotate(f) for f in section.figures))
                     for section in result.sections)
    rows = tuple(replace(row, note=f"{row.note}; {notes[key]}" if row.note else notes[key])
                 if (key := f"scenarios.{row.key}") in notes else row for row in result.scenarios)
    settings = tuple(replace(s, reason=f"{s.reason}; {notes[key]}") if (key := f"engine.{s.name}") in notes
                     else s for s in result.engine_config)
    return replace(result, sections=sections, scenarios=rows, engine_config=settings,
                   reference_checks=tuple(checks))
