"""The plan as markdown (for people) and JSON (for tools): the same data, two views."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from sluice.planner import fmt
from sluice.planner.result import REFERENCE_TOLERANCE, Figure, Plan, Scenario


def _finite(value: object) -> object:
    """JSON has no infinity: an unbounded queue or a lost fleet is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def to_json(result: Plan) -> str:
    return json.dumps(_finite(asdict(result)), ensure_ascii=False, indent=2)


def _pct(x: float) -> str:
    return fmt.pct(x) if math.isfinite(x) else "—"


def _figure(figure: Figure) -> list[str]:
    value = figure.text() if math.isfinite(figure.value) else "unbounded"
    lines = [f"- {figure.label}: **{value}** — {figure.formula}"]
    if figure.note:
        lines.append(f"  - note: {figure.note}")
    return lines


def _scenario(row: Scenario) -> str:
    need = fmt.count(row.replicas_needed) if math.isfinite(row.replicas_needed) else "—"
    return (f"| {row.name} | {row.change} | {_pct(row.prefill_fraction)} | {_pct(row.decode_fraction)} | "
            f"{row.formula} | {fmt.ms(row.ttft_p95_s)} | {fmt.ms(row.itl_p95_s)} | {need} | "
            f"**{row.verdict}** |")


def to_markdown(result: Plan) -> str:
    out = [f"# Capacity plan: {result.brief}", "", f"**Verdict.** {result.verdict}", ""]
    for section in result.sections:
        out += [f"## {section.title}", ""]
        for figure in section.figures:
            out += _figure(figure)
        out.append("")

    out += ["## Failure modes (seed 003 §6, recomputed)", "",
            "Each row re-prices the replicas left with the per-replica model (the scenario's own batch, "
            "decode's weight-read floor included), checks the ceiling and the SLOs, and solves the "
            "replicas the scenario would need (spares included).",
            "",
            "| scenario | change | prefill | decode | utilization | p95 TTFT | p95 ITL | replicas needed | "
            "verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    out += [_scenario(row) for row in result.scenarios]
    notes = [f"- {row.name}: {row.note}" for row in result.scenarios if row.note]
    if notes:
        out += ["", *notes]
    out.append("")

    out += ["## Engine configuration", "", "| setting | value | why |", "|---|---|---|"]
    out += [f"| {s.name} | {fmt.num(s.value)} | {s.reason} |" for s in result.engine_config]
    out.append("")

    out += ["## Critical dependencies", ""]
    out += [f"{i}. {dep}" for i, dep in enumerate(result.dependencies, 1)]
    out.append("")

    if result.simulation is not None:
        sim = result.simulation
        out += [f"## Simulation ({fmt.num(sim.simulated_s)} simulated s, {fmt.count(sim.requests)} requests)",
                "",
                "| figure | analytical | simulated |", "|---|---|---|"]
        out += [f"| {f.label} | {fmt.value(f.analytical, f.unit) if math.isfinite(f.analytical) else '—'} | "
                f"{fmt.value(f.simulated, f.unit)} |" for f in sim.figures]
        holds = "SLO holds" if sim.slo_holds else "SLO does not hold"
        out += ["", f"**{holds}** in simulation: {sim.summary}", ""]

    if result.reference_checks:
        out += [f"## Against {result.reference_source}'s printed figures", "",
                f"Within {fmt.pct(REFERENCE_TOLERANCE)} counts as the same figure rounded; otherwise the "
                "plan keeps its own arithmetic and says why the printed figure differs.", "",
                "| figure | printed | planned | difference | why |", "|---|---|---|---|---|"]
        for check in result.reference_checks:
            status = "matches" if check.matches else f"{check.relative_difference:+.1%}"
            out.append(f"| {check.label} (`{check.key}`) | {fmt.value(check.reference, check.unit)} | "
                       f"{fmt.value(check.planned, check.unit)} | {status} | {check.why} |")
        out.append("")

    out += ["## Assumptions", ""]
    out += [f"- {line}" for line in result.assumptions]
    out.append("")
    return "\n".join(out)
