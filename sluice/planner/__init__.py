"""Capacity planner: a brief (model, GPUs, users, token lengths, SLOs, budget) → a sized
design with every step's arithmetic, the failure-mode table and the engine
configuration (seed 003 §11 C, seed 000's sizing chain).

    from sluice.planner import load_brief, plan
    result = plan(load_brief("examples/briefs/seed003.yaml"))

Pure: no I/O beyond reading the brief; `planner.cli` is the command-line edge.
"""

from sluice.planner.brief import Brief, load_brief, parse_brief
from sluice.planner.errors import BriefError
from sluice.planner.plan import plan
from sluice.planner.result import Figure, Plan, Scenario

__all__ = ["Brief", "BriefError", "Figure", "Plan", "Scenario", "load_brief", "parse_brief", "plan"]
