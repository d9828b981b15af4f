"""The engine configuration to run, each value with the constraint it comes from.

Rules (seed 003 §4, made mechanical):
  max_model_len   next power of two ≥ p95 input + p95 output (longer requests belong to another pool)
  max_num_seqs    the batch a replica carries with one failure domain lost, plus headroom, in
                  multiples of 16, and never above what the KV pool holds at the sizing context
  max_num_tokens  the largest multiple of 256 whose step (max_num_seqs decodes + the rest as a
                  prefill chunk) stays within the p95 ITL SLO, priced by the cost model
  memory fraction the brief's choice, checked to hold max_num_seqs and max_model_len
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.engine.cost_model import CostModel
from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.demand import Load
from sluice.planner.result import EngineSetting
from sluice.planner.supply import batch_per_replica

_SEQS_STEP = 16
_TOKENS_STEP = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    settings: tuple[EngineSetting, ...]
    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    memory_fraction: float
    itl_p95_s: float        # the step that carries a full chunk at max_num_seqs, with scheduling overhead
    itl_p95_formula: str


def _round_up(x: float, step: int) -> int:
    return int(math.ceil(x / step) * step)


def engine_config(brief: Brief, cost: CostModel, load: Load, replicas: int,
                  replicas_per_node: int) -> EngineConfig:
    w, slo, ctx = brief.workload, brief.slo, load.context_tokens
    overhead = brief.latency.scheduler_overhead_s

    longest = w.input_tokens.p95 + w.output_tokens.p95
    max_model_len = 1 << max(0, math.ceil(math.log2(longest)))
    len_reason = (f"p95 input {fmt.count(w.input_tokens.p95)} + "
                  f"p95 output {fmt.count(w.output_tokens.p95)} = "
                  f"{fmt.count(longest)} → next power of two {fmt.count(max_model_len)} "
                  f"(+{fmt.pct(max_model_len / longest - 1)} headroom); longer requests go to another pool")

    serving = replicas - replicas_per_node if replicas > replicas_per_node else replicas
    degraded = batch_per_replica(load.generating, serving)
    wanted = degraded * (1 + brief.engine.max_num_seqs_headroom)
    engine_cost = cost   # brief.factors carry the engine's memory fraction: one memory rule
    fit = engine_cost.sequences_that_fit(ctx)
    max_num_seqs = min(_round_up(wanted, _SEQS_STEP), max(fit, 1))
    seqs_reason = (f"⌈{fmt.num(load.generating)} generating ÷ {serving} replicas (one node lost)⌉ = "
                   f"{degraded} × "
                   f"{fmt.num(1 + brief.engine.max_num_seqs_headroom)} headroom = {fmt.num(wanted)} → "
                   f"{max_num_seqs} (multiple of {_SEQS_STEP}); the KV pool holds {fmt.count(fit)} at "
                   f"{fmt.count(ctx)} context, so admission never preempts")
    if max_num_seqs == fit:
        seqs_reason += " ✗ capped by the KV pool: memory binds"

    def chunk_step(tokens: int) -> float:
        prefill = max(0, tokens - max_num_seqs)
        return cost.step_time_totals_s(prefill, max_num_seqs, max_num_seqs * ctx) + overhead

    max_num_tokens = _round_up(max_num_seqs + 1, _TOKENS_STEP)
    while max_num_tokens + _TOKENS_STEP <= max_model_len and chunk_step(max_num_tokens + _TOKENS_STEP) <= \
            slo.itl_p95_s:
        max_num_tokens += _TOKENS_STEP
    itl = chunk_step(max_num_tokens)
    chunk = max_num_tokens - max_num_seqs
    itl_formula = (f"step({max_num_seqs} decodes + {chunk}-token chunk) = {fmt.ms(itl - overhead)} + "
                   f"{fmt.ms(overhead)} scheduling = {fmt.ms(itl)}")
    tokens_reason = (f"largest multiple of {_TOKENS_STEP} whose step stays within the "
                     f"{fmt.ms(slo.itl_p95_s)} "
                     f"p95 ITL: {itl_formula}")
    if itl > slo.itl_p95_s:
        tokens_reason += " ✗ even the smallest chunk breaks the ITL SLO: decode alone is too slow"
    else:
        tokens_reason += (f"; the next {_TOKENS_STEP} would take "
                          f"{fmt.ms(chunk_step(max_num_tokens + _TOKENS_STEP))}"
                          "; larger chunks raise throughput but only a measured p95 ITL can justify them "
                          "(seed 003 starts at 2,048 and tunes)")

    fraction = brief.engine.memory_fraction
    pool_tokens = engine_cost.kv_capacity_tokens_per_gpu()
    memory_reason = (f"{fmt.num(fraction)} × {fmt.gb(cost.hardware.hbm_bytes)} = "
                     f"{fmt.gb(fraction * cost.hardware.hbm_bytes)} for the engine, leaving "
                     f"{fmt.gb((1 - fraction) * cost.hardware.hbm_bytes)} per GPU for CUDA graphs, NCCL "
                     "buffers "
                     "and fragmentation; its KV pool "
                     f"({fmt.gb(engine_cost.kv_pool_bytes_per_gpu())} per GPU, "
                     f"{fmt.count(pool_tokens)} tokens) holds {fmt.count(fit)} sequences at "
                     f"{fmt.count(ctx)} context ≥ max_num_seqs {max_num_seqs} "
                     f"{'✓' if fit >= max_num_seqs else '✗'}")
    settings = (
        EngineSetting("max_num_seqs", max_num_seqs, seqs_reason),
        EngineSetting("max_num_tokens", max_num_tokens, tokens_reason),
        EngineSetting("max_model_len", max_model_len, len_reason),
        EngineSetting("memory_fraction", fraction, memory_reason),
    )
    return EngineConfig(settings, max_num_seqs, max_num_tokens, max_model_len, fraction, itl, itl_formula)
