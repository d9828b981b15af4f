"""The one-page design report (`sluice plan BRIEF --report plan.html`), seed 003 §11 E: the fleet's
architecture, the configuration with its reasons, the SLO budget, utilization and p95 TTFT/ITL
against load (the planner's curves, with the simulator's points on them when `--simulate` ran),
the failure table, the critical dependencies and the validation plan.

Self-contained HTML: inline CSS and SVG, no scripts, so it prints to PDF from any browser.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from sluice.planner import fmt
from sluice.planner.result import LoadPoint, Plan

PLOT_W, PLOT_H, PAD = 310, 190, 40
CURVE_RGB, SIM_RGB = (0x1E, 0x88, 0xE5), (0xE6, 0x51, 0x00)   # the planner's lines, the simulator's dots


@dataclass(frozen=True, slots=True)
class SimPoint:
    """One simulator run at a multiple of the brief's traffic."""

    traffic: float
    utilization: float   # GPU busy share
    ttft_p95_s: float    # end to end
    itl_p95_s: float


def _plot(plot_id: str, title: str, curve: Sequence[LoadPoint], sims: Sequence[SimPoint],
          y: Callable[[LoadPoint], float], y_sim: Callable[[SimPoint], float], limit: float,
          limit_label: str, y_text: Callable[[float], str]) -> str:
    finite = [y(p) for p in curve if math.isfinite(y(p))] + [y_sim(s) for s in sims] + [limit]
    top = min(max(finite) * 1.1, limit * 3)
    x_max = max([p.traffic for p in curve] + [s.traffic for s in sims])

    def sx(x: float) -> float:
        return PAD + x / x_max * (PLOT_W - PAD - 24)

    def sy(v: float) -> float:
        return PLOT_H - 25 - min(v, top) / top * (PLOT_H - 45)

    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(p.traffic):.1f},{sy(y(p)):.1f}"
                    for i, p in enumerate(curve) if math.isfinite(y(p)))
    dots = "".join(f'<circle class="sim" cx="{sx(s.traffic):.1f}" cy="{sy(y_sim(s)):.1f}" r="4"/>'
                   for s in sims)
    ticks = "".join(f'<text x="{sx(t):.1f}" y="{PLOT_H - 8}" class="tick">{t:g}×</text>'
                    for t in (0.5, 1.0, 1.5, 2.0) if t <= x_max)
    return (f'<svg id="{plot_id}" class="plot" width="{PLOT_W}" height="{PLOT_H}" role="img" '
            f'aria-label="{escape(title)}"><text x="{PAD}" y="14" class="title">{escape(title)}</text>'
            f'<line x1="{PAD}" y1="{sy(0):.1f}" x2="{PLOT_W - 10}" y2="{sy(0):.1f}" class="axis"/>'
            f'<line x1="{PAD}" y1="20" x2="{PAD}" y2="{sy(0):.1f}" class="axis"/>'
            f'<line x1="{PAD}" y1="{sy(limit):.1f}" x2="{PLOT_W - 10}" y2="{sy(limit):.1f}" class="limit"/>'
            f'<text x="{PLOT_W - 12}" y="{sy(limit) - 3:.1f}" class="tick" text-anchor="end">'
            f'{escape(limit_label)}</text>'
            f'<text x="4" y="{sy(top) + 10:.1f}" class="tick">{escape(y_text(top))}</text>'
            f'<line x1="{sx(1):.1f}" y1="20" x2="{sx(1):.1f}" y2="{sy(0):.1f}" class="today"/>'
            f'<path d="{path}" class="curve"/>{dots}{ticks}</svg>')


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _architecture(result: Plan) -> str:
    model, precision, gpu, tp, per_node, node_gpus, spares = result.architecture
    nodes = max(1, math.ceil(result.gpus / int(node_gpus)))
    boxes = "".join(
        f'<rect x="{250 + 58 * i}" y="40" width="50" height="44" class="node"/>'
        f'<text x="{275 + 58 * i}" y="66" class="tick" text-anchor="middle">node {i}</text>'
        for i in range(min(nodes, 8)))
    more = (f'<text x="{250 + 58 * 8}" y="66" class="tick">… {nodes} nodes</text>' if nodes > 8 else "")
    return (f'<svg id="architecture" width="760" height="95" role="img" aria-label="fleet architecture">'
            '<rect x="5" y="40" width="70" height="44" class="box"/><text x="40" y="66" class="tick" '
            'text-anchor="middle">clients</text>'
            '<rect x="90" y="40" width="70" height="44" class="box"/><text x="125" y="60" class="tick" '
            'text-anchor="middle">gateway</text><text x="125" y="74" class="tick" text-anchor="middle">'
            'auth, limits</text>'
            '<rect x="170" y="40" width="70" height="44" class="box"/><text x="205" y="60" class="tick" '
            'text-anchor="middle">router</text><text x="205" y="74" class="tick" text-anchor="middle">'
            'prefix-aware</text>'
            f'{boxes}{more}<text x="250" y="28" class="title">{result.replicas} replicas × TP{tp} '
            f'({per_node} per node of {node_gpus} × {escape(gpu)}), N+{spares}; {escape(model)}, '
            f'{escape(precision)}</text></svg>')


def to_html(result: Plan, sims: Sequence[SimPoint] = ()) -> str:
    """The report as one self-contained HTML page."""
    ceiling, ttft_limit, itl_limit = result.limits
    plots = (
        _plot("plot-utilization", "utilization vs load", result.curves, sims, lambda p: p.utilization,
              lambda s: s.utilization, ceiling, f"ceiling {fmt.pct(ceiling)}", fmt.pct),
        _plot("plot-ttft", "p95 TTFT vs load", result.curves, sims, lambda p: p.ttft_p95_s,
              lambda s: s.ttft_p95_s, ttft_limit, f"SLO {fmt.ms(ttft_limit)}", fmt.ms),
        _plot("plot-itl", "p95 ITL vs load", result.curves, sims, lambda p: p.itl_p95_s,
              lambda s: s.itl_p95_s, itl_limit, f"SLO {fmt.ms(itl_limit)}", fmt.ms),
    )
    latency = next(section for section in result.sections if section.key == "latency")
    budget = _table(("TTFT / ITL budget line", "value", "arithmetic"),
                    [(f.label, f.text() if math.isfinite(f.value) else "unbounded", f.formula)
                     for f in latency.figures])
    config = _table(("setting", "value", "why"),
                    [(s.name, fmt.num(s.value), s.reason) for s in result.engine_config])
    failures = _table(("scenario", "utilization", "p95 TTFT", "p95 ITL", "replicas needed", "verdict"),
                      [(r.name, fmt.pct(r.utilization) if math.isfinite(r.utilization) else "—",
                        fmt.ms(r.ttft_p95_s), fmt.ms(r.itl_p95_s),
                        fmt.count(r.replicas_needed) if math.isfinite(r.replicas_needed) else "—", r.verdict)
                       for r in result.scenarios])
    deps = "".join(f"<li>{escape(d)}</li>" for d in result.dependencies)
    loads = ", ".join(f"{s.traffic:g}×" for s in sims)
    sim_note = (f"Dots: the fleet simulator at {loads} the brief's traffic "
                "(its utilization is GPU busy time, which an inflight-batching engine keeps high whenever "
                "any sequence is generating; its ITL is the p95 gap, the planner's the step carrying a full "
                "chunk)." if sims else "Run with --simulate to put the simulator's points on these curves.")
    background = "#e8f5e9" if result.meets_slo else "#fdecea"
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>Capacity plan: {escape(result.brief)}</title><style>
body{{font:12px/1.35 system-ui,sans-serif;margin:18px 24px;max-width:1000px;color:#111}}
h1{{font-size:18px;margin:0 0 6px}}h2{{font-size:13px;margin:12px 0 4px;border-bottom:1px solid #ccc}}
table{{border-collapse:collapse;width:100%;font-size:11px}}td,th{{border:1px solid #ddd;padding:2px 4px;
vertical-align:top;text-align:left}}.verdict{{padding:6px;background:{background}}}
.plots{{display:flex;gap:12px}}.curve{{fill:none;stroke:#1e88e5;stroke-width:2}}.sim{{fill:#e65100}}
.axis{{stroke:#444}}.limit{{stroke:#c62828;stroke-dasharray:4 3}}.today{{stroke:#999;stroke-dasharray:2 3}}
.tick{{font-size:10px;fill:#333}}.title{{font-size:11px;font-weight:600}}.box{{fill:#eceff1;stroke:#546e7a}}
.node{{fill:#e3f2fd;stroke:#546e7a}}ol,ul{{margin:2px 0 2px 18px;padding:0}}
</style></head><body>
<h1>Capacity plan: {escape(result.brief)}</h1>
<p class="verdict">{escape(result.verdict)}</p>
<h2>Fleet architecture</h2>{_architecture(result)}
<h2>Utilization and p95 latency against load</h2><div class="plots">{''.join(plots)}</div>
<p>Lines: the planner's per-replica model of the planned fleet from 0.1× to 2× the brief's traffic (dotted:
today). {escape(sim_note)}</p>
<h2>SLO budget</h2>{budget}
<h2>Configuration, with reasons</h2>{config}
<h2>Failure table</h2>{failures}
<h2>Critical dependencies</h2><ol>{deps}</ol>
<h2>Validation plan</h2><ul>
<li>Before committing: measure one replica's decode step at the planned batch and its prefill tok/s against
the cost model (calibrated to TensorRT-LLM's published max-throughput rows within ±10%); re-plan with the
measured efficiency factors.</li>
<li>Load test at 0.5×, 1× and 1.5× the brief's traffic; the p95 TTFT and ITL points must sit on the curves
above, and the knee must not move left.</li>
<li>In production, watch first: prefix cache hit rate, running batch per replica, p95 ITL, queue wait p95,
KV pool use, cost per million output tokens; alert on the dependencies above.</li>
</ul></body></html>
"""
