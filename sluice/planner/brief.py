"""The brief: what the planner is asked to size, validated into typed values.

A brief is YAML (see examples/briefs/). Everything with a sensible default may
be left out; every default the planner takes is listed in `Brief.defaults` with
its source, and the plan prints that list, so no assumption is silent.

Units in the YAML are the ones people write (ms, GB, TB/s, TFLOP/s, $/GPU-hour);
the typed brief holds SI units (s, bytes, bytes/s, FLOP/s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import yaml

from sluice.engine.cost_model import AUTO, CostFactors
from sluice.engine.profiles import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    PRECISION_BYTES,
    HardwareProfile,
    ModelProfile,
    get_model,
)
from sluice.planner.errors import (
    DUTY_OR_READ_TIME,
    KV_HEADS_ABOVE_HEADS,
    NO_COMPUTE_DTYPE,
    NOT_A_BRIEF,
    P95_BELOW_MEAN,
    PRECISION_NOT_ON_GPU,
    PRESET_OR_SHAPE,
    TURN_SHORTER_THAN_ANSWER,
    UNKNOWN_HARDWARE_PRESET,
    UNKNOWN_MODEL_PRESET,
    UNKNOWN_PRECISION,
    YAML_SYNTAX,
    BriefError,
)
from sluice.planner.reader import Reader

FIXED_BUDGET = "fixed_budget"   # seed 003: a GPU budget is given; the plan reports its utilization
GOODPUT = "goodput"             # seed 000: replicas = demand ÷ measured goodput per replica ÷ decode share
USERS = "users"                 # users alone: the smallest fleet the per-replica model says meets the brief
SIZING_MODES = (FIXED_BUDGET, GOODPUT, USERS)

_MODEL_SHAPE = ("name", "num_params", "num_layers", "hidden_size", "num_attention_heads",
                "num_kv_heads", "head_dim")
_HARDWARE_SHAPE = ("name", "hbm_gb", "hbm_bandwidth_tb_per_s", "dense_tflops",
                   "nvlink_allreduce_overhead_fraction")
_DEFAULT_FACTORS = CostFactors()
SEED_003 = "seed 003"
MAX_GPUS_PER_NODE = 72   # the largest NVLink domain sold (GB200 NVL72)
MAX_TOKENS = 1e7         # ten million tokens: beyond any context window served today


@dataclass(frozen=True, slots=True)
class TokenLengths:
    mean: float   # tokens
    p95: float    # tokens; defaults to the mean when the brief gives none


@dataclass(frozen=True, slots=True)
class Demand:
    users: float                          # concurrent users (conversations) at peak
    duty_cycle: float | None              # share of users generating at any instant, when stated
    turn_period_s: float | None           # seconds between one user's requests, when stated
    read_and_type_s: float | None         # otherwise: turn = answer time + this
    generation_tok_per_s: float | None    # pace a user sees while generating; None → 1 ÷ p95 ITL SLO


@dataclass(frozen=True, slots=True)
class Workload:
    input_tokens: TokenLengths
    output_tokens: TokenLengths
    kv_context_tokens: int        # context held per generating sequence for KV and decode sizing
    decode_batch: int | None      # batch for the roofline decode ceiling; None → the planned batch
    prefix_hit_rate: float        # expected share of input tokens served from the prefix cache
    prefix_credit_in_sizing: bool  # whether the sizing counts on that hit rate (seed 003 does not)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p95_s: float
    ttft_input_tokens: int        # the TTFT SLO applies to inputs up to this length
    itl_p95_s: float              # p95 inter-token latency (TPOT)
    availability: float


@dataclass(frozen=True, slots=True)
class Sizing:
    mode: str                                       # FIXED_BUDGET or GOODPUT
    gpus: int | None                                # the budget (FIXED_BUDGET)
    goodput_tok_per_s_per_replica: float | None     # measured decode goodput at the ITL SLO (GOODPUT)
    prefill_share: float | None                     # share of each replica prefill takes (GOODPUT)
    tp: int | None                                  # None → fill one NVSwitch domain (gpus_per_node)
    search_tp: bool                                 # `tp: auto`: the TP that needs the fewest GPUs
    precisions: tuple[str, ...]                     # `precision`: weights+KV searched; () → fixed
    spare_replicas: int                             # N + spare for availability
    max_utilization: float                          # above this, queueing puts the TTFT SLO at risk


@dataclass(frozen=True, slots=True)
class LatencyBudget:
    """Fixed TTFT and ITL components the roofline cannot see (seed 003 §5 defaults)."""

    network_rtt_s: float
    gateway_s: float
    tokenization_s: float
    first_sample_s: float
    sse_first_write_s: float
    scheduler_overhead_s: float   # per decode step: scheduling and sampling


@dataclass(frozen=True, slots=True)
class EngineChoices:
    memory_fraction: float         # vLLM gpu-memory-utilization / TRT-LLM free_gpu_memory_fraction
    max_num_seqs_headroom: float   # above the expected batch with one failure domain lost


@dataclass(frozen=True, slots=True)
class Scenarios:
    """Seed 003 §6's failure modes, with the brief's own magnitudes."""

    prefix_hit_rate: float
    traffic_factor: float
    input_factor: float
    nodes_lost: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReferenceFigure:
    value: float   # in the plan figure's SI unit (bytes, seconds, fractions)
    why: str       # why the reference's printed figure differs from the arithmetic, if it does


@dataclass(frozen=True, slots=True)
class Reference:
    """Figures a source document printed, to be compared with the plan's own arithmetic."""

    source: str
    figures: Mapping[str, ReferenceFigure]


@dataclass(frozen=True, slots=True)
class Lora:
    """Fine-tuned variants served as LoRA adapters on one base model (seed 003 §9 C)."""

    adapters: int         # resident adapters
    adapter_bytes: float  # each (rank-16 on a 70B: ~40 MB)
    overhead: float       # step-time overhead of the batched adapter matmuls (seed: 5–15%)


@dataclass(frozen=True, slots=True)
class Brief:
    name: str
    model: ModelProfile               # at the brief's weight and KV precision
    hardware: HardwareProfile
    gpus_per_node: int                # one NVSwitch domain
    price_per_gpu_hour: float
    sizing: Sizing
    demand: Demand
    workload: Workload
    slo: Slo
    factors: CostFactors
    latency: LatencyBudget
    engine: EngineChoices
    average_to_peak_traffic: float    # daily average ÷ peak output traffic, for $ per token
    scenarios: Scenarios
    reference: Reference | None
    lora: Lora | None                 # multi-LoRA serving (seed 003 §9 C), already folded into `factors`
    defaults: tuple[str, ...]         # "field = value (why)" for every default taken


def load_brief(path: str | Path) -> Brief:
    """Read and validate a YAML brief; `BriefError` names the offending field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        detail = " ".join(str(error).split())
        raise BriefError("brief", YAML_SYNTAX.format(detail=detail)) from None
    except UnicodeDecodeError as error:
        raise BriefError("brief", YAML_SYNTAX.format(detail=f"not UTF-8 text ({error.reason})")) from None
    return parse_brief(data, default_name=path.stem)


def parse_brief(data: object, default_name: str = "brief") -> Brief:
    if not isinstance(data, Mapping):
        raise BriefError("brief", NOT_A_BRIEF.format(value=data))
    defaults: list[str] = []
    root = Reader(data, "", defaults, ("name", "model", "hardware", "sizing", "demand", "workload", "slo",
                                       "efficiency", "latency", "engine", "cost", "scenarios", "reference",
                                       "lora"))
    name = root.text("name", default_name)
    hardware_section = root.section("hardware", ("preset",) + _HARDWARE_SHAPE + (
        "gpus_per_node", "price_per_gpu_hour"))
    hardware = _hardware(hardware_section)
    workload = _workload(root.section("workload", (
        "input_tokens", "output_tokens", "kv_context_tokens", "decode_batch", "prefix_hit_rate",
        "prefix_credit_in_sizing")))
    model_section = root.section("model", ("preset", "weights", "kv_cache") + _MODEL_SHAPE)
    model = _model(model_section)
    _check_precisions_run_on(model, hardware, model_section)
    slo = _slo(root.section("slo", ("ttft_p95_ms", "ttft_input_tokens", "itl_p95_ms", "availability")),
               workload)
    demand_section = root.section("demand", (
        "users", "duty_cycle", "turn_period_s", "read_and_type_s", "generation_tok_per_s"))
    demand = _demand(demand_section)
    _check_turn_outlasts_answer(demand, workload, slo, demand_section)
    engine = _engine(root.section("engine", ("memory_fraction", "max_num_seqs_headroom"), required=False))
    lora = _lora(root.section("lora", ("adapters", "adapter_gb", "overhead"), required=False))
    return Brief(
        name=name,
        model=model,
        hardware=hardware,
        gpus_per_node=hardware_section.integer("gpus_per_node", 8, "one NVSwitch domain of an HGX node",
                                              maximum=MAX_GPUS_PER_NODE),
        price_per_gpu_hour=hardware_section.number("price_per_gpu_hour"),
        sizing=_sizing(root.section("sizing", (
            "mode", "gpus", "goodput_tok_per_s_per_replica", "prefill_share", "tp", "spare_replicas",
            "max_utilization", "precision")), hardware),
        demand=demand,
        workload=workload,
        slo=slo,
        factors=_with_lora(_factors(root.section("efficiency", (
            "achieved_bandwidth_fraction", "achieved_flops_fraction", "allreduce_fraction",
            "fixed_overhead_ms", "activation_reserve_gb", "compute_dtype"),
            required=False), hardware, engine), lora),
        latency=_latency(root.section("latency", (
            "network_rtt_ms", "gateway_ms", "tokenization_ms", "first_sample_ms", "sse_first_write_ms",
            "scheduler_overhead_ms"), required=False)),
        engine=engine,
        average_to_peak_traffic=_average_to_peak(root.section("cost", ("average_to_peak_traffic",),
                                                              required=False)),
        scenarios=_scenarios(root.section("scenarios", (
            "prefix_hit_rate", "traffic_factor", "input_factor", "nodes_lost"), required=False)),
        reference=_reference(root.section("reference", ("source", "figures"), required=False)),
        lora=lora,
        defaults=tuple(defaults),
    )


def _model(section: Reader) -> ModelProfile:
    weights = section.text("weights", "bf16", "the checkpoint's own precision")
    kv = section.text("kv_cache", weights, "follows the weights")
    for key, precision in (("weights", weights), ("kv_cache", kv)):
        if precision not in PRECISION_BYTES:
            field = section.field(key)
            raise BriefError(field, UNKNOWN_PRECISION.format(field=field, value=precision,
                                                             known=", ".join(PRECISION_BYTES)))
    shape_given = [key for key in _MODEL_SHAPE if section.has(key)]
    if section.has("preset"):
        if shape_given:
            raise BriefError(section.path, PRESET_OR_SHAPE.format(field=section.path,
                                                                  known=", ".join(_MODEL_SHAPE)))
        preset = section.text("preset")
        if preset not in MODEL_PRESETS:
            field = section.field("preset")
            raise BriefError(field, UNKNOWN_MODEL_PRESET.format(field=field, value=preset,
                                                                known=", ".join(MODEL_PRESETS)))
        return get_model(preset, weights=weights, kv=kv)
    heads = section.integer("num_attention_heads")
    hidden = section.integer("hidden_size")
    kv_heads = section.integer("num_kv_heads")
    if kv_heads > heads or heads % kv_heads:
        field = section.field("num_kv_heads")
        raise BriefError(field, KV_HEADS_ABOVE_HEADS.format(field=field, value=kv_heads, heads=heads))
    return ModelProfile(
        name=section.text("name"),
        num_params=section.number("num_params"),
        num_layers=section.integer("num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=section.integer("head_dim", hidden // heads, "hidden_size ÷ num_attention_heads"),
        bytes_per_weight=2.0, bytes_per_kv_element=2.0,
    ).with_precision(weights, kv)


def _check_precisions_run_on(model: ModelProfile, hardware: HardwareProfile, section: Reader) -> None:
    """FP8 storage needs FP8 tensor cores (Hopper and later); A100 runs int8 instead."""
    for key, precision in (("weights", model.weight_precision), ("kv_cache", model.kv_precision)):
        if not hardware.supports_precision(precision):
            field = section.field(key)
            known = ", ".join(p for p in PRECISION_BYTES if hardware.supports_precision(p))
            raise BriefError(field, PRECISION_NOT_ON_GPU.format(field=field, hardware=hardware.name,
                                                                value=precision, known=known))


def _check_turn_outlasts_answer(demand: Demand, workload: Workload, slo: Slo, section: Reader) -> None:
    """A stated turn period must hold the answer it contains (the read-and-type form always does)."""
    if demand.turn_period_s is None:
        return
    rate = demand.generation_tok_per_s or 1.0 / slo.itl_p95_s
    answer = workload.output_tokens.mean / rate
    if demand.turn_period_s <= answer:
        field = section.field("turn_period_s")
        raise BriefError(field, TURN_SHORTER_THAN_ANSWER.format(
            field=field, value=demand.turn_period_s, answer=answer,
            tokens=workload.output_tokens.mean, rate=rate))


def _hardware(section: Reader) -> HardwareProfile:
    if section.has("preset"):
        preset = section.text("preset")
        if preset not in HARDWARE_PRESETS:
            field = section.field("preset")
            raise BriefError(field, UNKNOWN_HARDWARE_PRESET.format(field=field, value=preset,
                                                                   known=", ".join(HARDWARE_PRESETS)))
        return HARDWARE_PRESETS[preset]
    dtypes = ("bf16", "fp16", "fp8", "int8", "int4")
    flops = section.section("dense_tflops", dtypes)
    dense = {dtype: flops.number(dtype) * 1e12 for dtype in dtypes if flops.has(dtype)}
    if not dense:
        dense["bf16"] = flops.number("bf16")   # raises: at least the bf16 peak is needed
    return HardwareProfile(
        name=section.text("name"),
        hbm_bytes=section.number("hbm_gb") * 1e9,
        hbm_bandwidth_bytes_per_s=section.number("hbm_bandwidth_tb_per_s") * 1e12,
        dense_flops_per_s=MappingProxyType(dense),
        nvlink_allreduce_overhead_fraction=section.fraction(
            "nvlink_allreduce_overhead_fraction", 0.2, SEED_003),
    )


SEARCHED_PRECISIONS = ("bf16", "fp8")   # `precision: auto`: the quality-neutral serving precisions


def _sizing(section: Reader, hardware: HardwareProfile) -> Sizing:
    mode = section.choice("mode", SIZING_MODES)
    fixed, goodput = mode == FIXED_BUDGET, mode == GOODPUT
    search_tp = section.raw("tp") == AUTO
    return Sizing(
        mode=mode,
        gpus=section.integer("gpus") if fixed else section.optional_integer("gpus"),
        goodput_tok_per_s_per_replica=section.number("goodput_tok_per_s_per_replica") if goodput else None,
        prefill_share=section.fraction("prefill_share") if goodput else None,
        tp=None if search_tp else section.optional_integer("tp", maximum=MAX_GPUS_PER_NODE),
        search_tp=search_tp,
        precisions=_precisions(section, hardware),
        spare_replicas=section.integer("spare_replicas", 1, "N+1: survive one replica lost",
                                       allow_zero=True),
        max_utilization=section.number("max_utilization", 0.85,
                                       "queueing delay grows as 1/(1 − ρ); past ~85% p95 TTFT degrades"),
    )


def _precisions(section: Reader, hardware: HardwareProfile) -> tuple[str, ...]:
    """`sizing.precision`: absent → the model's own, no search; `auto` → bf16 and fp8; or a list of names.
    Each candidate stores weights and KV alike; those the GPU cannot run are dropped, none left is refused."""
    raw = section.raw("precision")
    if raw is None:
        return ()
    field = section.field("precision")
    given = SEARCHED_PRECISIONS if raw == AUTO else tuple(raw) if isinstance(raw, list) else (raw,)
    names: list[str] = []
    for name in given:
        if not isinstance(name, str) or name not in PRECISION_BYTES:
            raise BriefError(field, UNKNOWN_PRECISION.format(field=field, value=name,
                                                             known=", ".join((AUTO, *PRECISION_BYTES))))
        names.append(name)
    runs = tuple(dict.fromkeys(name for name in names if hardware.supports_precision(name)))
    if not runs:
        known = ", ".join(p for p in PRECISION_BYTES if hardware.supports_precision(p))
        raise BriefError(field, PRECISION_NOT_ON_GPU.format(field=field, hardware=hardware.name,
                                                            value=" / ".join(names), known=known))
    return runs


def _demand(section: Reader) -> Demand:
    duty = section.fraction("duty_cycle") if section.has("duty_cycle") else None
    if duty is not None and duty == 0:
        field = section.field("duty_cycle")
        raise BriefError(field, DUTY_OR_READ_TIME.format(field=field))
    turn = section.optional_number("turn_period_s")
    read = section.optional_number("read_and_type_s")
    if not ((duty is not None and turn is not None) or (duty is None and turn is None and read is not None)):
        raise BriefError(section.path, DUTY_OR_READ_TIME.format(field=section.path))
    return Demand(
        users=section.number("users"),
        duty_cycle=duty,
        turn_period_s=turn,
        read_and_type_s=read,
        generation_tok_per_s=section.optional_number("generation_tok_per_s"),
    )


def _lengths(section: Reader) -> TokenLengths:
    mean = section.number("mean", maximum=MAX_TOKENS)
    p95 = section.number("p95", mean, "no p95 given: the mean", maximum=MAX_TOKENS)
    if p95 < mean:
        field = section.field("p95")
        raise BriefError(field, P95_BELOW_MEAN.format(field=field, value=p95, mean=mean))
    return TokenLengths(mean=mean, p95=p95)


def _workload(section: Reader) -> Workload:
    inputs = _lengths(section.section("input_tokens", ("mean", "p95")))
    outputs = _lengths(section.section("output_tokens", ("mean", "p95")))
    return Workload(
        input_tokens=inputs,
        output_tokens=outputs,
        kv_context_tokens=section.integer(
            "kv_context_tokens", int(inputs.mean + outputs.mean),
            "mean input + mean output: the context a sequence reaches as it ends", maximum=2 * MAX_TOKENS),
        decode_batch=section.optional_integer("decode_batch"),
        prefix_hit_rate=section.fraction("prefix_hit_rate", 0.0, "no prefix cache"),
        prefix_credit_in_sizing=section.flag(
            "prefix_credit_in_sizing", False, "size for a cold cache, as seed 003's verdict does"),
    )


def _slo(section: Reader, workload: Workload) -> Slo:
    return Slo(
        ttft_p95_s=section.number("ttft_p95_ms") / 1e3,
        ttft_input_tokens=section.integer("ttft_input_tokens", int(workload.input_tokens.p95),
                                          "the p95 input"),
        itl_p95_s=section.number("itl_p95_ms") / 1e3,
        availability=section.fraction("availability", 0.999, "three nines"),
    )


def _factors(section: Reader, hardware: HardwareProfile, engine: EngineChoices) -> CostFactors:
    base = _DEFAULT_FACTORS
    dtype = section.text("compute_dtype", base.compute_dtype,
                         "follows the hardware: matmuls in the weights' dtype where the GPU has tensor "
                         "cores for it (FP8 on Hopper, int8 on A100), else bf16")
    if dtype != AUTO and dtype not in hardware.dense_flops_per_s:
        field = section.field("compute_dtype")
        raise BriefError(field, NO_COMPUTE_DTYPE.format(field=field, hardware=hardware.name, value=dtype,
                                                        known=", ".join(hardware.dense_flops_per_s)))
    return CostFactors(
        achieved_bandwidth_fraction=section.number(
            "achieved_bandwidth_fraction", base.achieved_bandwidth_fraction, SEED_003),
        achieved_flops_fraction=section.number("achieved_flops_fraction", base.achieved_flops_fraction,
                                               SEED_003),
        allreduce_fraction=section.fraction("allreduce_fraction", hardware.nvlink_allreduce_overhead_fraction,
                                            f"{hardware.name}'s NVLink all-reduce share at TP 8, seed 003; "
                                            "scaled by ring traffic 2(tp − 1)/tp at other degrees"),
        fixed_overhead_s=section.number("fixed_overhead_ms", base.fixed_overhead_s * 1e3,
                                        "step overhead is budgeted in latency.scheduler_overhead_ms",
                                        allow_zero=True) / 1e3,
        activation_reserve_bytes=section.number("activation_reserve_gb", base.activation_reserve_bytes / 1e9,
                                                SEED_003, allow_zero=True) * 1e9,
        # One memory rule: the KV pool, the smallest TP and the engine configuration all use the
        # share of HBM the emitted engine configuration gives the engine.
        memory_fraction=engine.memory_fraction,
        compute_dtype=dtype,
    )


def _lora(section: Reader) -> Lora | None:
    if not section.has("adapters"):
        return None
    return Lora(
        adapters=section.integer("adapters"),
        adapter_bytes=section.number("adapter_gb", 0.04, "seed 003 §9 C: ~4 GB for 100 adapters") * 1e9,
        overhead=section.fraction("overhead", 0.10, "seed 003 §9 C: 5–15% overhead, the middle"),
    )


def _with_lora(factors: CostFactors, lora: Lora | None) -> CostFactors:
    """Adapters live in every GPU's HBM beside the weights (held whole: the conservative side of TP
    sharding), and their batched matmuls slow every step by `overhead`."""
    if lora is None:
        return factors
    slower = 1.0 + lora.overhead
    adapters = lora.adapters * lora.adapter_bytes
    return replace(factors,
                   activation_reserve_bytes=factors.activation_reserve_bytes + adapters,
                   achieved_bandwidth_fraction=factors.achieved_bandwidth_fraction / slower,
                   achieved_flops_fraction=factors.achieved_flops_fraction / slower)


def _latency(section: Reader) -> LatencyBudget:
    def ms(key: str, default: float) -> float:
        return section.number(key, default, SEED_003, allow_zero=True) / 1e3

    return LatencyBudget(
        network_rtt_s=ms("network_rtt_ms", 25),
        gateway_s=ms("gateway_ms", 12),
        tokenization_s=ms("tokenization_ms", 4),
        first_sample_s=ms("first_sample_ms", 2),
        sse_first_write_s=ms("sse_first_write_ms", 6),
        scheduler_overhead_s=ms("scheduler_overhead_ms", 3),
    )


def _engine(section: Reader) -> EngineChoices:
    return EngineChoices(
        memory_fraction=section.number("memory_fraction", 0.90,
                                       "vLLM's default; seed 003 keeps 0.90 for activation headroom"),
        max_num_seqs_headroom=section.number("max_num_seqs_headroom", 0.2, "seed 003: 20% headroom",
                                             allow_zero=True),
    )


def _average_to_peak(section: Reader) -> float:
    return section.number("average_to_peak_traffic", 1.0, "no daily curve given: priced at peak")


def _scenarios(section: Reader) -> Scenarios:
    raw_lost = section.raw("nodes_lost")
    if raw_lost is None:
        lost: tuple[int, ...] = (1, 2)
        section.note_default("nodes_lost", "[1, 2]", SEED_003)
    elif isinstance(raw_lost, list):
        items = Reader({str(i): v for i, v in enumerate(raw_lost)}, section.field("nodes_lost"), [],
                       tuple(str(i) for i in range(len(raw_lost))))
        lost = tuple(items.integer(str(i)) for i in range(len(raw_lost)))
    else:
        lost = (section.integer("nodes_lost"),)
    return Scenarios(
        prefix_hit_rate=section.fraction("prefix_hit_rate", 0.2, SEED_003),
        traffic_factor=section.number("traffic_factor", 2.0, SEED_003),
        input_factor=section.number("input_factor", 2.0, SEED_003),
        nodes_lost=lost,
    )


def _reference(section: Reader) -> Reference | None:
    if not section.has("source"):
        return None
    figures_section = section.raw("figures") or {}
    keys = tuple(str(key) for key in figures_section) if isinstance(figures_section, Mapping) else ()
    figures = section.section("figures", keys, required=False)
    parsed: dict[str, ReferenceFigure] = {}
    for key in keys:
        if isinstance(figures.raw(key), Mapping):
            entry = figures.section(key, ("value", "why"))
            parsed[key] = ReferenceFigure(entry.number("value", allow_zero=True), entry.text("why", ""))
        else:
            parsed[key] = ReferenceFigure(figures.number(key, allow_zero=True), "")
    return Reference(source=section.text("source"), figures=MappingProxyType(parsed))
