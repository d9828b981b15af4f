"""Named simulations. `seed003` is seed 003's design: 8 nodes of 8 × H100 serving Llama-3-70B in FP8
(weights and KV) at TP8, 10,000 concurrent chat users, 10 simulated minutes.

Workload calibration (seed 003's brief: 1,200 input tokens on average with history, 350 output,
p95 output 1,200, a turn every ~180 s per user):
- output: log-normal with mean 350 and p95 1,200 (median 180);
- input: a 400-token system prompt shared by every conversation, user messages log-normal with
  mean 120 and p95 400, and a geometric number of turns with mean 2.5, so turn n carries the
  n − 1 earlier exchanges: the mean prompt over all requests comes to ~1,200 tokens;
- think time: exponential with mean 166 s after each answer (~14 s of answer → ~180 s a turn).
Engine: the seed's vLLM settings mapped to TensorRT-LLM's (max_num_seqs 160, max_num_tokens
2,048, chunked context, block reuse, 90% of HBM), 32-token blocks, guaranteed_no_evict, and the
seed's "+3 ms scheduler and sampling overhead" per step as the cost model's fixed overhead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from sluice.engine.cost_model import CostFactors
from sluice.engine.types import EngineConfig
from sluice.sim.fleet import FleetConfig
from sluice.sim.metrics import SLO
from sluice.sim.workload import WorkloadConfig

UNKNOWN_PRESET = "unknown simulation preset {name!r}; known: {known}"


@dataclass(frozen=True, slots=True)
class Preset:
    fleet: FleetConfig
    workload: WorkloadConfig
    slo: SLO
    policy: str


def _seed003() -> Preset:
    return Preset(
        fleet=FleetConfig(
            replicas=8, tp=8, efficiency=CostFactors(memory_fraction=0.9, fixed_overhead_s=0.003),
            engine=EngineConfig(block_size=32, max_num_seqs=160, max_num_tokens=2048, stream_tokens=False),
        ),
        workload=WorkloadConfig(duration_s=600.0, users=10_000, think_time_s=166.0, warmup_s=60.0),
        slo=SLO(ttft_s=0.5, tpot_s=0.04, itl_s=0.04),
        policy="prefix_aware",
    )


def _small() -> Preset:
    """A quick one: 2 replicas of Llama-3-8B on one H100 each, 300 users for 2 minutes."""
    from sluice.engine.profiles import get_model

    return Preset(
        fleet=FleetConfig(replicas=2, tp=1, model=get_model("llama-3-8b"),
                          engine=EngineConfig(block_size=32, max_num_seqs=64, max_num_tokens=2048,
                                              stream_tokens=False)),
        workload=WorkloadConfig(duration_s=120.0, users=300, think_time_s=30.0, warmup_s=10.0,
                                model_version="llama-3-8b"),
        slo=SLO(ttft_s=0.5, tpot_s=0.05, itl_s=0.05),
        policy="round_robin",
    )


PRESETS: Mapping[str, Preset] = MappingProxyType({"seed003": _seed003(), "small": _small()})


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(UNKNOWN_PRESET.format(name=name, known=", ".join(PRESETS))) from None
