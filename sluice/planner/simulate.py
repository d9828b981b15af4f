"""`--simulate`: the planned fleet on the fleet simulator, with the brief's workload.

The simulator runs the same engine core and cost model as the replicas, on a
virtual clock, behind the shared router. This module only translates:

    plan   → FleetConfig (replicas, TP, precision, the engine configuration the plan chose)
    brief  → WorkloadConfig (closed-loop users who read and type between answers)

and sets the simulated figures beside the analytical ones.

Workload translation. The simulator's conversations send, at turn n, a shared
system prompt + the n − 1 earlier exchanges + a new user message, so the prefix
cache can serve everything but the new message. From the brief's mean input I,
mean output O and expected prefix hit rate h:

    new tokens per request    U = I × (1 − h)
    cacheable tokens          C = I − U = S + (T − 1) × (U + O)
    system prompt             S = min(C, 400)
    turns per conversation    T = 1 + (C − S) ÷ (U + O)      (geometric, mean T)

so the mean prompt is I and a perfectly routed fleet would hit h. Read-and-type
time is exponential with the brief's mean (turn period − answer time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from sluice.engine.sampling import FixedLength, GeometricLength, LengthDistribution, LogNormalLength
from sluice.engine.types import EngineConfig
from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.result import Plan, SimulatedFigure, Simulation
from sluice.sim import SLO, FleetConfig, FleetReport, WorkloadConfig, run_fleet

SYSTEM_PROMPT_TOKENS = 400
BLOCK_SIZE = 32
# LogNormalLength.from_mean_p95 needs ln(p95/mean) < z²/2, i.e. p95 below ~3.87 × the mean.
_MAX_P95_RATIO = 3.8
POLICY = "prefix_aware"


@dataclass(frozen=True, slots=True)
class SimInputs:
    fleet: FleetConfig
    workload: WorkloadConfig
    think_time_s: float
    new_tokens: float          # U
    system_prompt: int         # S
    mean_turns: float          # T
    notes: tuple[str, ...]


def _lengths(mean: float, p95: float, notes: list[str], what: str) -> LengthDistribution:
    if p95 <= mean:
        return FixedLength(max(1, round(mean)))
    if p95 > _MAX_P95_RATIO * mean:
        notes.append(f"{what}: p95 {fmt.count(p95)} is more than {_MAX_P95_RATIO}× the mean "
                     f"{fmt.count(mean)}, "
                     f"beyond a log-normal's reach; simulated with p95 {fmt.count(_MAX_P95_RATIO * mean)}")
        p95 = _MAX_P95_RATIO * mean
    return LogNormalLength.from_mean_p95(mean, p95)


def _think_time(brief: Brief) -> float:
    d, out = brief.demand, brief.workload.output_tokens.mean
    if d.read_and_type_s is not None:
        return d.read_and_type_s
    assert d.turn_period_s is not None and d.duty_cycle is not None
    if d.generation_tok_per_s is not None:
        return d.turn_period_s - out / d.generation_tok_per_s
    return d.turn_period_s * (1.0 - d.duty_cycle)


def sim_inputs(brief: Brief, result: Plan, seconds: float, seed: int = 0) -> SimInputs:
    w, notes = brief.workload, list[str]()
    inputs, outputs, hit = w.input_tokens, w.output_tokens, w.prefix_hit_rate
    new = max(1.0, inputs.mean * (1.0 - hit))
    cacheable = inputs.mean - new
    system = int(min(cacheable, SYSTEM_PROMPT_TOKENS))
    turns = 1.0 + (cacheable - system) / (new + outputs.mean)
    think = _think_time(brief)
    max_model_len = int(result.setting("max_model_len").value)
    engine = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=int(result.setting("max_num_seqs").value),
                          max_num_tokens=int(result.setting("max_num_tokens").value), stream_tokens=False)
    # The plan budgets scheduling and sampling per step; the simulated steps pay it too.
    efficiency = replace(brief.factors, memory_fraction=result.setting("memory_fraction").value,
                         fixed_overhead_s=brief.factors.fixed_overhead_s + brief.latency.scheduler_overhead_s)
    fleet = FleetConfig(replicas=result.replicas, model=brief.model, hardware=brief.hardware,
                        tp=int(result.figure("memory.tp").value), efficiency=efficiency, engine=engine)
    workload = WorkloadConfig(
        duration_s=seconds, arrival="users", users=round(brief.demand.users), think_time_s=think,
        turns=GeometricLength(turns), system_prompt_tokens=system, num_system_prompts=1,
        user_tokens=_lengths(new, new * inputs.p95 / inputs.mean, notes, "new input tokens"),
        output_tokens=_lengths(outputs.mean, outputs.p95, notes, "output tokens"),
        max_output_tokens=max(1, max_model_len - 1), max_context_tokens=max_model_len,
        warmup_s=min(30.0, seconds / 4), model_version=brief.model.name, seed=seed)
    return SimInputs(fleet, workload, think, new, system, turns, tuple(notes))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def simulate(brief: Brief, result: Plan, seconds: float = 300.0,
             progress: Callable[[str], None] | None = None, seed: int = 0) -> Simulation:
    setup = sim_inputs(brief, result, seconds, seed)
    say = progress or (lambda line: None)
    fixed = result.figure("latency.fixed_s").value
    say(f"simulating {fmt.num(seconds)} s of peak traffic: {fmt.count(brief.demand.users)} users on "
        f"{result.replicas} × TP{setup.fleet.tp} replicas ({POLICY} routing; {fmt.num(setup.mean_turns, 3)} "
        "turns "
        f"per conversation, {setup.system_prompt}-token system prompt, {fmt.count(setup.new_tokens)} new "
        "tokens "
        f"a turn, {fmt.num(setup.think_time_s)} s think) …")
    slo = SLO(ttft_s=max(brief.slo.ttft_p95_s - fixed, 1e-6), tpot_s=None, itl_s=brief.slo.itl_p95_s)
    report = run_fleet(setup.fleet, setup.workload, POLICY, slo=slo)
    say(f"simulated in {report.sim_cpu_s:.1f} s CPU: {report.requests_completed:,} requests completed, "
        f"{report.requests_rejected} rejected, {report.requests_unfinished} unfinished")
    return _compare(brief, result, setup, report, fixed)


def _compare(brief: Brief, result: Plan, setup: SimInputs, report: FleetReport, fixed: float) -> Simulation:
    f = result.figure
    engine_ttft_p95 = f("latency.queue_wait_p95_s").value + f("latency.prefill_s").value
    busy = _mean([r.busy_fraction for r in report.per_replica])
    batch = _mean([r.mean_batch for r in report.per_replica])
    figures = (
        SimulatedFigure("requests per second", f("demand.requests_per_s").value, report.request_throughput,
                        "req/s"),
        SimulatedFigure("output tokens per second (completed requests)", f("demand.decode_tok_per_s").value,
                        report.output_token_throughput, "tok/s"),
        SimulatedFigure("prefix cache hit rate", brief.workload.prefix_hit_rate, report.cache_hit_rate,
                        "fraction"),
        SimulatedFigure("p95 TTFT at the engine (router → first token)", engine_ttft_p95, report.ttft.p95,
                        "s"),
        SimulatedFigure("p95 TTFT end to end (+ fixed network, gateway, tokenization, SSE)",
                        f("latency.ttft_p95_s").value, report.ttft.p95 + fixed, "s"),
        SimulatedFigure("mean TTFT end to end", f("latency.ttft_mean_s").value, report.ttft.mean + fixed,
                        "s"),
        SimulatedFigure("p95 ITL", f("latency.itl_p95_s").value, report.itl.p95, "s"),
        SimulatedFigure("mean ITL", f("latency.itl_mean_s").value, report.itl.mean, "s"),
        SimulatedFigure("decode batch per replica", f("decode.batch").value, batch, "sequences"),
        SimulatedFigure("utilization (analytical share) vs GPU busy time (simulated)",
                        f("utilization.total").value, busy, "fraction"),
        SimulatedFigure("peak KV pool use", result.figure("demand.generating_sequences").value
                        / f("memory.fleet_sequences").value, report.kv_utilization_peak, "fraction"),
    )
    ttft_ok = report.ttft.p95 + fixed <= brief.slo.ttft_p95_s
    itl_ok = report.itl.p95 <= brief.slo.itl_p95_s
    holds = ttft_ok and itl_ok and report.requests_rejected == 0
    summary = (f"p95 TTFT {fmt.ms(report.ttft.p95 + fixed)} {'≤' if ttft_ok else '>'} "
               f"{fmt.ms(brief.slo.ttft_p95_s)}, p95 ITL {fmt.ms(report.itl.p95)} {'≤' if itl_ok else '>'} "
               f"{fmt.ms(brief.slo.itl_p95_s)}, {report.requests_rejected} rejected. An inflight-batching "
               "engine "
               "decodes whenever any sequence is generating, so its GPUs look busy well below capacity: the "
               f"headroom shows as a small batch ({fmt.num(batch, 3)} vs the planned "
               f"{fmt.count(f('decode.batch').value)}) and a short ITL, not as idle time.")
    if report.cache_hit_rate < brief.workload.prefix_hit_rate:
        summary += (f" The simulated fleet starts cold at peak (each user's first turn brings history no "
                    f"replica has cached), so a run of a few think times ({fmt.num(setup.think_time_s)} s) "
                    f"measures a cache still warming: {fmt.pct(report.cache_hit_rate)} hits against the "
                    f"{fmt.pct(brief.workload.prefix_hit_rate)} expected, the harder case for TTFT.")
    if setup.notes:
        summary += " Workload: " + "; ".join(setup.notes) + "."
    return Simulation(simulated_s=report.duration_s, requests=report.requests_completed, figures=figures,
                      slo_holds=holds, summary=summary, ttft_p95_s=report.ttft.p95 + fixed,
                      itl_p95_s=report.itl.p95, busy_fraction=busy)
