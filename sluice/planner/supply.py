"""Supply of one replica (a tensor-parallel group): memory, decode and prefill.

Every hardware figure comes from `engine.cost_model.CostModel`, the same core the
replica engine and the simulator price their steps with, so the planner and the
engine never disagree about what a step costs. The planner only adds the words
and the substituted numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sluice.engine.cost_model import AUTO, CostFactors, CostModel
from sluice.engine.profiles import HardwareProfile, ModelProfile, precision_bytes
from sluice.planner import fmt
from sluice.planner.brief import Brief
from sluice.planner.demand import Load
from sluice.planner.errors import (
    MODEL_FITS_NO_GPU_COUNT,
    TP_NOT_A_DIVISOR,
    TP_SPLITS_HEADS,
    TP_TOO_SMALL,
    BriefError,
)
from sluice.planner.result import Figure, Section


@dataclass(frozen=True, slots=True)
class Replica:
    cost: CostModel
    tp: int
    min_tp: int               # the smallest TP whose weights leave room for KV
    replicas_per_node: int


def tp_choices(gpus_per_node: int, model: ModelProfile | None = None) -> tuple[int, ...]:
    """Tensor-parallel degrees inside one NVSwitch domain: the divisors of the node's GPU count that
    split the model's attention heads evenly and its KV heads evenly (or replicate them whole)."""
    return tuple(tp for tp in range(1, gpus_per_node + 1)
                 if gpus_per_node % tp == 0 and (model is None or splits_heads(model, tp)))


def splits_heads(model: ModelProfile, tp: int) -> bool:
    kv = model.num_kv_heads
    return model.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def cost_model(model: ModelProfile, hardware: HardwareProfile, tp: int, factors: CostFactors) -> CostModel:
    return CostModel(model, hardware, tp=tp, efficiency=factors)


def _smallest_fitting(brief: Brief) -> str:
    """The smallest configuration that would hold the model: more GPUs at its precision (TP across
    nodes), or a smaller weight precision at TP = the node."""
    m, h, f, node = brief.model, brief.hardware, brief.factors, brief.gpus_per_node
    options: list[str] = []
    for nodes in range(2, 17):
        tp = node * nodes
        if splits_heads(m, tp) and cost_model(m, h, tp, f).fits():
            options.append(f"TP {tp} ({nodes} nodes, crossing InfiniBand) at {m.weight_precision} weights")
            break
    for precision in ("fp8", "int8", "int4"):
        if precision_bytes(precision) >= m.bytes_per_weight or not h.supports_precision(precision):
            continue
        smaller = m.with_precision(precision, m.kv_precision if h.supports_precision(m.kv_precision)
                                   else "bf16")
        fit = [tp for tp in tp_choices(node, smaller) if cost_model(smaller, h, tp, f).fits()]
        if fit:
            options.append(f"{precision} weights at TP {fit[0]}")
            break
    return ", or ".join(options) if options else "none within 16 nodes or int4 weights"


def replica(brief: Brief, tp: int | None = None) -> Replica:
    """The TP group: the smallest degree that fits, and the degree used (`tp`, else the brief's, else
    the whole node). A model that fits no group in a node is refused with the smallest that would."""
    node, m, h, f = brief.gpus_per_node, brief.model, brief.hardware, brief.factors
    choices = tp_choices(node, m)
    fitting = [choice for choice in choices if cost_model(m, h, choice, f).fits()]
    if not fitting:
        raise BriefError("model", MODEL_FITS_NO_GPU_COUNT.format(
            field="model", model=m.name, precision=m.weight_precision, weights_gb=m.weight_bytes() / 1e9,
            gpus_per_node=node, hardware=h.name, usable_gb=h.hbm_bytes * f.memory_fraction / 1e9,
            fraction=f.memory_fraction, reserve_gb=f.activation_reserve_bytes / 1e9,
            per_gpu_gb=m.weight_bytes() / node / 1e9, smallest=_smallest_fitting(brief)))
    min_tp = fitting[0]
    if tp is None:
        tp = brief.sizing.tp if brief.sizing.tp is not None else choices[-1]
    if node % tp:
        raise BriefError("sizing.tp", TP_NOT_A_DIVISOR.format(field="sizing.tp", value=tp,
                                                              gpus_per_node=node))
    if not splits_heads(m, tp):
        raise BriefError("sizing.tp", TP_SPLITS_HEADS.format(
            field="sizing.tp", value=tp, heads=m.num_attention_heads, kv_heads=m.num_kv_heads,
            known=", ".join(str(choice) for choice in choices)))
    if tp < min_tp:
        raise BriefError("sizing.tp", TP_TOO_SMALL.format(
            field="sizing.tp", value=tp, weights_gb=m.weight_bytes() / tp / 1e9,
            usable_gb=h.hbm_bytes * f.memory_fraction / 1e9, hbm_gb=h.hbm_bytes / 1e9, min_tp=min_tp))
    return Replica(cost_model(m, h, tp, f), tp, min_tp, node // tp)


def batch_per_replica(generating: float, replicas: int) -> int:
    """Sequences each replica decodes at once; rounded up, the conservative side of a step's cost."""
    return max(1, math.ceil(generating / replicas - 1e-9))


def memory_section(brief: Brief, rep: Replica, load: Load, replicas: int) -> Section:
    m, h, f, cost = brief.model, brief.hardware, brief.factors, rep.cost
    tp, weights = rep.tp, m.weight_bytes()
    min_tp_weights = weights / rep.min_tp
    if brief.sizing.tp is None:
        tp_formula = (f"TP {tp} = the {brief.gpus_per_node} GPUs of one node: the group fills one NVSwitch "
                      "domain; a larger TP would cross nodes over InfiniBand")
    else:
        tp_formula = f"TP {tp}, stated in the brief ({rep.replicas_per_node} replicas per node)"
    kv_token = m.kv_bytes_per_token()
    kv_split = cost.kv_shards()
    pool = cost.kv_pool_bytes_per_gpu()
    fit = cost.sequences_that_fit(load.context_tokens)
    fleet_fit = fit * replicas
    binding = ("memory is not the constraint ✓" if fleet_fit >= load.generating
               else "memory binds: not every generating sequence's KV fits ✗")
    figures: tuple[Figure, ...] = (
        Figure("memory.weight_bytes", "weights", weights, "B",
               f"{fmt.num(m.num_params / 1e9)}e9 params × {fmt.num(m.bytes_per_weight)} B "
               f"({m.weight_precision}) = {fmt.gb(weights)}"),
        Figure("memory.min_tp", "smallest tensor-parallel degree that fits", rep.min_tp, "",
               f"{fmt.gb(weights)} ÷ {rep.min_tp} = {fmt.gb(min_tp_weights)} + "
               f"{fmt.gb(f.activation_reserve_bytes)} activation reserve ≤ {fmt.gb(h.hbm_bytes)} × "
               f"{fmt.num(f.memory_fraction)} engine memory fraction = "
               f"{fmt.gb(h.hbm_bytes * f.memory_fraction)} of {h.name} HBM (the same rule as the pool "
               "below and the engine configuration)"),
        Figure("memory.tp", "tensor-parallel degree of a replica", tp, "", tp_formula),
        Figure("memory.weight_bytes_per_gpu", "weights per GPU", cost.weight_bytes_per_gpu(), "B",
               f"{fmt.gb(weights)} ÷ {tp} = {fmt.gb(cost.weight_bytes_per_gpu())}"),
        Figure("memory.kv_bytes_per_token", "KV cache per token", kv_token, "B/token",
               f"2 (K and V) × {m.num_layers} layers × {m.num_kv_heads} KV heads × {m.head_dim} × "
               f"{fmt.num(m.bytes_per_kv_element)} B ({m.kv_precision}) = {fmt.kv_bytes(kv_token)}"),
        Figure("memory.kv_bytes_per_token_per_gpu", "KV cache per token per GPU",
               cost.kv_bytes_per_token_per_gpu(), "B/token",
               f"{fmt.kv_bytes(kv_token)} ÷ {kv_split} (KV heads split over min(TP {tp}, {m.num_kv_heads} "
               f"KV heads)) = {fmt.kv_bytes(cost.kv_bytes_per_token_per_gpu())}"),
        Figure("memory.kv_pool_bytes_per_gpu", "HBM left for the KV pool per GPU", pool, "B",
               f"{fmt.gb(h.hbm_bytes)} × {fmt.num(f.memory_fraction)} − "
               f"{fmt.gb(cost.weight_bytes_per_gpu())} weights − {fmt.gb(f.activation_reserve_bytes)} "
               f"activations = {fmt.gb(pool)}"),
        Figure("memory.sequences_per_replica", "sequences whose KV fits one replica", fit, "sequences",
               f"{fmt.gb(pool)} ÷ ({fmt.count(cost.kv_bytes_per_token_per_gpu())} B × "
               f"{fmt.count(load.context_tokens)} tokens) = {fmt.count(fit)} sequences at "
               f"{fmt.count(load.context_tokens)} context"),
        Figure("memory.fleet_sequences", "sequences whose KV fits the fleet", fleet_fit, "sequences",
               f"{fmt.count(fit)} × {replicas} replicas = {fmt.count(fleet_fit)} vs "
               f"{fmt.num(load.generating)} generating: {binding}"),
    )
    if brief.lora is not None:
        lora = brief.lora
        adapters = lora.adapters * lora.adapter_bytes
        figures = (*figures, Figure(
            "memory.lora_bytes", "LoRA adapters held on each GPU", adapters, "B",
            f"{lora.adapters} adapters × {fmt.gb(lora.adapter_bytes)} = {fmt.gb(adapters)}, held beside the "
            f"{fmt.gb(f.activation_reserve_bytes - adapters)} "
            f"activation reserve (in the pool above); their batched matmuls slow every step by "
            f"{fmt.pct(lora.overhead)} (achieved bandwidth and FLOP/s ÷ {fmt.num(1 + lora.overhead)})"))
    return Section("memory", "Memory: weights, tensor parallelism, KV", figures)


def decode_section(brief: Brief, rep: Replica, load: Load, replicas: int) -> Section:
    cost, f, h = rep.cost, brief.factors, brief.hardware
    ctx, tp = load.context_tokens, rep.tp
    batch = batch_per_replica(load.generating, replicas)
    kv_read = batch * ctx * cost.kv_bytes_per_token_per_gpu()
    step_bytes = cost.decode_bytes_per_gpu(batch, ctx)
    theoretical = cost.decode_step_theoretical_s(batch, ctx)
    step = cost.decode_step_s(batch, ctx)
    per_replica = batch / step
    fleet = per_replica * replicas
    stretch = f" ÷ (1 − {fmt.num(cost.allreduce_share, 3)} all-reduce at TP {tp})" if tp > 1 else ""
    overhead = f" + {fmt.ms(f.fixed_overhead_s)}" if f.fixed_overhead_s else ""

    ceiling_batch = brief.workload.decode_batch or batch
    ceiling_weights = brief.model.weight_bytes()
    ceiling_kv = ceiling_batch * ctx * cost.kv_bytes_per_token_per_gpu() * tp
    ceiling_bytes = cost.decode_bytes_per_gpu(ceiling_batch, ctx) * tp
    ceiling_bandwidth = tp * h.hbm_bandwidth_bytes_per_s
    ceiling_step = cost.decode_step_theoretical_s(ceiling_batch, ctx)
    ceiling = ceiling_batch / ceiling_step
    figures = (
        Figure("decode.batch", "sequences decoding at once per replica", batch, "sequences",
               f"⌈{fmt.num(load.generating)} generating ÷ {replicas} replicas⌉ = {batch}"),
        Figure("decode.bytes_per_step_per_gpu", "bytes read per decode step per GPU", step_bytes, "B",
               f"{fmt.gb(cost.weight_bytes_per_gpu())} weights + {batch} × {fmt.count(ctx)} tokens × "
               f"{fmt.count(cost.kv_bytes_per_token_per_gpu())} B = {fmt.gb(cost.weight_bytes_per_gpu())} + "
               f"{fmt.gb(kv_read)} = {fmt.gb(step_bytes)}"),
        Figure("decode.step_theoretical_s", "decode step at full HBM bandwidth", theoretical, "s",
               f"{fmt.gb(step_bytes)} ÷ {fmt.tb_s(h.hbm_bandwidth_bytes_per_s)} = {fmt.ms(theoretical)}"),
        Figure("decode.step_s", "decode step as the engine prices it", step, "s",
               f"{fmt.ms(theoretical)} ÷ {fmt.num(f.achieved_bandwidth_fraction)} achieved bandwidth"
               f"{stretch}{overhead} = {fmt.ms(step)}"),
        Figure("decode.tok_per_s_per_replica", "decode capacity per replica at that batch", per_replica,
               "tok/s", f"{batch} ÷ {fmt.ms(step)} = {fmt.num(per_replica)} tok/s"),
        Figure("decode.tok_per_s", "decode capacity of the fleet", fleet, "tok/s",
               f"{fmt.num(per_replica)} × {replicas} replicas = {fmt.num(fleet)} tok/s, "
               f"{fmt.times(fleet / load.decode_tok_per_s)} the {fmt.num(load.decode_tok_per_s)} tok/s "
               "needed"),
        Figure("decode.ceiling_bytes_per_step", f"bytes per step per replica at batch {ceiling_batch}",
               ceiling_bytes, "B",
               f"{fmt.gb(ceiling_weights)} + {ceiling_batch} seqs × "
               f"({fmt.count(brief.model.kv_bytes_per_token())}"
               f" B × {fmt.count(ctx)} ctx = {fmt.gb(brief.model.kv_bytes_per_token() * ctx)}) = "
               f"{fmt.gb(ceiling_weights + ceiling_kv)}"),
        Figure("decode.ceiling_step_s", f"roofline decode step at batch {ceiling_batch}", ceiling_step, "s",
               f"{fmt.gb(ceiling_bytes)} ÷ ({tp} × {fmt.tb_s(h.hbm_bandwidth_bytes_per_s)} = "
               f"{fmt.tb_s(ceiling_bandwidth)}) = {fmt.ms(ceiling_step)}"),
        Figure("decode.ceiling_tok_per_s", "roofline decode ceiling per replica", ceiling, "tok/s",
               f"{ceiling_batch} ÷ {fmt.ms(ceiling_step)} = {fmt.num(ceiling)} tok/s (bandwidth only: no "
               "efficiency, all-reduce or prefill)"),
    )
    return Section("decode", "Decode: step time and capacity", figures)


def prefill_section(brief: Brief, rep: Replica, load: Load, replicas: int) -> Section:
    cost, f, h, m = rep.cost, brief.factors, brief.hardware, brief.model
    flops = m.flops_per_token()
    dtype = cost.compute_dtype
    peak = h.flops(dtype)
    replica_flops = cost.replica_flops_per_s()
    per_replica = cost.prefill_tokens_per_s()
    fleet = per_replica * replicas
    share = cost.allreduce_share
    if f.compute_dtype == AUTO:
        dtype_note = (f"matmuls in {dtype}: the weights are {m.weight_precision} and {h.name} "
                      f"{'has' if dtype == m.weight_precision else 'has no'} {m.weight_precision} tensor "
                      "cores (efficiency.compute_dtype: auto)")
    else:
        dtype_note = (f"matmuls priced at {dtype} ({fmt.tflops(peak)} dense) as the brief states "
                      f"(efficiency.compute_dtype), with {m.weight_precision} weights")
    allreduce = (f" × (1 − {fmt.num(share, 3)} all-reduce at TP {rep.tp})" if share else "")
    figures = (
        Figure("prefill.flops_per_token", "FLOPs per prefill token", flops, "FLOP",
               f"2 × {fmt.num(m.num_params / 1e9)}e9 params = {fmt.gflop(flops)}"),
        Figure("prefill.replica_flops", "achieved FLOP/s of a replica", replica_flops, "FLOP/s",
               f"{rep.tp} GPUs × {fmt.tflops(peak)} ({dtype} dense) × "
               f"{fmt.num(f.achieved_flops_fraction)} achieved = {fmt.tflops(replica_flops)}", dtype_note),
        Figure("prefill.tok_per_s_per_replica", "prefill capacity per replica", per_replica, "tok/s",
               f"{fmt.tflops(replica_flops)} ÷ {fmt.gflop(flops)}{allreduce} = {fmt.num(per_replica)} tok/s"
               + (" (every TP step pays the all-reduce, prefill too)" if share else "")),
        Figure("prefill.tok_per_s", "prefill capacity of the fleet", fleet, "tok/s",
               f"{fmt.num(per_replica)} × {replicas} replicas = {fmt.num(fleet)} tok/s, "
               f"{fmt.times(fleet / load.prefill_tok_per_s)} the {fmt.num(load.prefill_tok_per_s)} tok/s "
               "needed"),
    )
    return Section("prefill", "Prefill: compute-bound capacity", figures)


def with_precision(brief: Brief, rep: Replica, weights: str, kv: str) -> Replica:
    """The same replica with the model stored at other precisions (the FP8 → BF16 scenario)."""
    model = brief.model.with_precision(weights, kv)
    return replace(rep, cost=cost_model(model, brief.hardware, rep.tp, brief.factors))
