"""Command-line edge: `sluice plan BRIEF.yaml [--json] [--simulate] [--report plan.html]` (also
`python -m sluice.planner`).

Exit status: 0 when the plan meets its SLO, 1 when it does not (the plan is still
printed), 2 when the brief is invalid (the message names the field: YAML syntax,
a value out of range, a model that does not fit, a TP that does not split the heads,
a precision the GPU lacks, a turn shorter than its answer). No input gives a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sluice.planner.brief import load_brief
from sluice.planner.errors import BriefError
from sluice.planner.plan import plan
from sluice.planner.render import to_json, to_markdown
from sluice.planner.report import SimPoint, to_html

EXIT_MEETS, EXIT_MISSES, EXIT_BAD_BRIEF = 0, 1, 2
MAX_SIMULATED_REPLICAS = 1024   # a fleet the solver could not size is 65,536 replicas: not simulated


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice plan", description="Size a serving fleet from a brief, "
                                     "printing every step's arithmetic.")
    parser.add_argument("brief", help="YAML brief (see examples/briefs/)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of markdown")
    parser.add_argument("--simulate", action="store_true",
                        help="run the fleet simulator on the planned fleet and print its p95 TTFT, ITL and "
                             "utilization beside the analytical figures")
    parser.add_argument("--sim-seconds", type=float, default=300.0,
                        help="simulated seconds of peak traffic for --simulate (default 300)")
    parser.add_argument("--report", metavar="PLAN.html",
                        help="also write the one-page design report (HTML with inline SVG plots)")
    parser.add_argument("--sim-loads", default="1",
                        help="with --simulate and --report: traffic multiples to simulate for the report's "
                             "points, e.g. 0.5,1,1.5 (default 1)")
    return parser


def _loads(text: str) -> tuple[float, ...] | None:
    try:
        loads = tuple(float(part) for part in text.split(","))
    except ValueError:
        return None
    return loads if loads and all(0 < load <= 10 for load in loads) else None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        brief = load_brief(args.brief)
        result = plan(brief)
    except BriefError as error:
        print(f"sluice plan: {error}", file=sys.stderr)
        return EXIT_BAD_BRIEF
    except OSError as error:
        print(f"sluice plan: cannot read {args.brief}: {error.strerror}", file=sys.stderr)
        return EXIT_BAD_BRIEF
    loads = _loads(args.sim_loads)
    if loads is None:
        print(f"sluice plan: --sim-loads {args.sim_loads!r}: give traffic multiples in (0, 10], "
              "e.g. 0.5,1,1.5", file=sys.stderr)
        return EXIT_BAD_BRIEF
    meets, points = result.meets_slo, []
    if args.simulate and result.replicas > MAX_SIMULATED_REPLICAS:
        print(f"sluice plan: --simulate skipped: {result.replicas:,} replicas is beyond what the simulator "
              f"runs (at most {MAX_SIMULATED_REPLICAS:,}); the plan says why so many", file=sys.stderr)
        print(to_json(result) if args.json else to_markdown(result))
        return EXIT_MISSES
    if args.simulate:
        from sluice.planner.simulate import simulate  # the simulator is only imported when asked for

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        try:
            simulation = simulate(brief, result, seconds=args.sim_seconds, progress=say)
            for load in (loads if args.report else ()):
                run = simulation if load == 1 else simulate(
                    replace(brief, demand=replace(brief.demand, users=brief.demand.users * load)), result,
                    seconds=args.sim_seconds, progress=say)
                points.append(SimPoint(load, run.busy_fraction, run.ttft_p95_s, run.itl_p95_s))
        except ValueError as error:   # the simulator refusing a configuration: say so, keep the plan
            print(f"sluice plan: --simulate could not run this plan: {error}", file=sys.stderr)
            print(to_json(result) if args.json else to_markdown(result))
            return EXIT_MISSES
        result = replace(result, simulation=simulation)
        meets = meets and simulation.slo_holds
    if args.report:
        try:
            Path(args.report).write_text(to_html(result, points), encoding="utf-8")
        except OSError as error:
            print(f"sluice plan: cannot write {args.report}: {error.strerror}", file=sys.stderr)
            return EXIT_BAD_BRIEF
    print(to_json(result) if args.json else to_markdown(result))
    return EXIT_MEETS if meets else EXIT_MISSES
