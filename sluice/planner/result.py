"""What a plan is made of: figures with their arithmetic, grouped in sections.

Every number the planner states is a `Figure` that carries the formula it came
from with the numbers substituted, so the markdown and JSON renderings are the
same data, and a reader can change any input and see what moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.planner import fmt


@dataclass(frozen=True, slots=True)
class Figure:
    key: str        # stable dotted id, e.g. "demand.generating_sequences" (JSON, tests, references)
    label: str      # what it is, in words
    value: float    # in SI units: seconds, bytes, FLOP/s, fractions (0.514), dollars
    unit: str       # how to print it (see fmt.UNIT_FORMATS); "" for a bare number
    formula: str    # the arithmetic, with the numbers substituted
    note: str = ""  # a caveat, or where a reference document's printed figure differs and why

    def text(self) -> str:
        return fmt.value(self.value, self.unit)


@dataclass(frozen=True, slots=True)
class Section:
    key: str                       # "demand", "memory", ...
    title: str
    figures: tuple[Figure, ...]

    def __getitem__(self, name: str) -> Figure:
        for figure in self.figures:
            if figure.key == f"{self.key}.{name}":
                return figure
        raise KeyError(f"{self.key}.{name}")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One row of seed 003's failure-mode table, recomputed."""

    key: str                   # stable id, e.g. "traffic_doubles" (JSON, tests, references)
    name: str                  # "traffic doubles"
    change: str                # what changes, in numbers
    prefill_fraction: float    # of the replicas left, re-priced by the per-replica model
    decode_fraction: float     # at the scenario's own batch (the weight-read floor included)
    utilization: float         # prefill + decode
    formula: str
    ttft_p95_s: float          # p95 TTFT of an SLO-sized input in the scenario
    itl_p95_s: float           # p95 ITL of the engine configuration in the scenario
    replicas_needed: float     # solved for the scenario, spares included (inf: no count serves it)
    verdict: str               # "fits" (meets ceiling and SLOs), "at risk" (≤ 100%) or "overloaded"
    note: str = ""


@dataclass(frozen=True, slots=True)
class EngineSetting:
    name: str       # the engine flag, e.g. "max_num_seqs"
    value: float
    reason: str     # the arithmetic and the constraint it comes from


@dataclass(frozen=True, slots=True)
class ReferenceCheck:
    key: str
    label: str
    reference: float
    planned: float
    unit: str
    relative_difference: float   # (planned − reference) ÷ reference
    matches: bool                # within REFERENCE_TOLERANCE
    why: str                     # the brief's explanation of a difference


REFERENCE_TOLERANCE = 0.005   # a printed figure within 0.5% is the same figure, rounded


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """The per-replica model of the planned fleet (spares serving) at a multiple of the brief's traffic."""

    traffic: float        # × the brief's users
    utilization: float
    ttft_p95_s: float
    itl_p95_s: float


@dataclass(frozen=True, slots=True)
class SimulatedFigure:
    label: str
    analytical: float
    simulated: float
    unit: str


@dataclass(frozen=True, slots=True)
class Simulation:
    """`--simulate`: the planned fleet on the fleet simulator, beside the analytical figures."""

    simulated_s: float
    requests: int
    figures: tuple[SimulatedFigure, ...]
    slo_holds: bool
    summary: str
    ttft_p95_s: float = math.nan     # end to end (fixed latency added)
    itl_p95_s: float = math.nan
    busy_fraction: float = math.nan  # mean GPU busy share across replicas


@dataclass(frozen=True, slots=True)
class Plan:
    brief: str
    mode: str                                   # fixed_budget or goodput
    sections: tuple[Section, ...]               # demand, memory, decode, prefill, utilization, ...
    scenarios: tuple[Scenario, ...]             # seed 003's failure-mode table
    engine_config: tuple[EngineSetting, ...]    # max_num_seqs, max_num_tokens, max_model_len, memory
    dependencies: tuple[str, ...]               # the critical dependencies, worst first
    verdict: str                                # one paragraph: does it meet the SLO, what binds
    meets_slo: bool
    replicas: int                               # the planned fleet, spares included
    gpus: int
    assumptions: tuple[str, ...]                # defaults taken and modelling choices, stated
    reference_source: str                       # "" when the brief has no reference figures
    reference_checks: tuple[ReferenceCheck, ...]
    simulation: Simulation | None = None
    curves: tuple[LoadPoint, ...] = ()          # utilization, p95 TTFT and ITL against load (the report)
    architecture: tuple[str, ...] = ()          # model, precision, GPU, TP, replicas/node, node GPUs, spares
    limits: tuple[float, float, float] = (0.85, math.inf, math.inf)   # ceiling, p95 TTFT SLO, p95 ITL SLO (s)

    def figure(self, key: str) -> Figure:
        section, _, name = key.partition(".")
        for candidate in self.sections:
            if candidate.key == section:
                return candidate[name]
        raise KeyError(key)

    def figures(self) -> tuple[Figure, ...]:
        return tuple(figure for section in self.sections for figure in section.figures)

    def setting(self, name: str) -> EngineSetting:
        for setting in self.engine_config:
            if setting.name == name:
                return setting
        raise KeyError(name)
