"""The autoscaler on the simulator: it grows with a traffic step (warm pool first), drains when traffic
falls without interrupting a run, and stays inside its bounds."""

from __future__ import annotations

from sluice.autoscaler.control import ScalerConfig
from sluice.engine.profiles import get_hardware, get_model
from sluice.engine.sampling import FixedLength, GeometricLength
from sluice.engine.types import EngineConfig
from sluice.router.factory import make_policy
from sluice.sim.fleet import Fleet, FleetConfig
from sluice.sim.metrics import FleetReport
from sluice.sim.scaling import Autoscaling
from sluice.sim.workload import WorkloadConfig

SLOTS = 5


def small_fleet(initial_serving: int, warm_pool: int, min_replicas: int = 1) -> FleetConfig:
    scaler = ScalerConfig(runs_per_replica=8, min_replicas=min_replicas, max_replicas=SLOTS,
                          warm_pool=warm_pool, cold_start_s=10.0, scale_out_cooldown_s=5.0,
                          scale_in_cooldown_s=10.0)
    return FleetConfig(replicas=SLOTS, model=get_model("llama-3-8b"), hardware=get_hardware("h100-sxm"), tp=1,
                       engine=EngineConfig(block_size=32, max_num_seqs=8, max_num_tokens=2048,
                                           stream_tokens=False),
                       autoscaling=Autoscaling(scaler=scaler, initial_serving=initial_serving,
                                               initial_warm=warm_pool, interval_s=2.0, window_s=6.0,
                                               shed_queue_wait_s=None))


def traffic(rate: float, factor: float, duration_s: float = 80.0) -> WorkloadConfig:
    return WorkloadConfig(duration_s=duration_s, arrival="poisson", conversation_rate=rate, think_time_s=1.0,
                          turns=GeometricLength(1.0), system_prompt_tokens=64, user_tokens=FixedLength(64),
                          output_tokens=FixedLength(256), max_output_tokens=256, ramp_factor=factor,
                          ramp_start_s=10.0, ramp_s=10.0, model_version="llama-3-8b", seed=2)


def simulate(config: FleetConfig, workload: WorkloadConfig) -> FleetReport:
    return Fleet(config, workload).run(make_policy("least_loaded"))


def test_a_traffic_step_promotes_the_warm_replica_then_starts_cold_ones() -> None:
    report = simulate(small_fleet(initial_serving=1, warm_pool=1), traffic(rate=4.0, factor=6.0))
    serving = [sample.serving for sample in report.scaling]
    assert serving[0] == 1 and max(serving) > 2
    first_growth = next(sample for sample in report.scaling if sample.serving > 1)
    # the warm replica serves 5 s (one promotion) after the decision, long before a 10 s cold start
    assert first_growth.at_s - report.scaling[0].at_s < 10.0
    assert max(s.serving + s.warm + s.starting + s.draining for s in report.scaling) <= SLOTS
    assert report.requests_interrupted == 0


def test_falling_traffic_drains_replicas_without_interrupting_a_run() -> None:
    report = simulate(small_fleet(initial_serving=SLOTS, warm_pool=0), traffic(rate=6.0, factor=0.1))
    serving = [sample.serving for sample in report.scaling]
    assert serving[0] == SLOTS and serving[-1] < SLOTS
    assert min(serving) >= 1                                     # min_replicas
    assert report.requests_interrupted == 0
    assert report.requests_rejected == 0


def test_min_replicas_holds_when_there_is_no_traffic_at_all() -> None:
    report = simulate(small_fleet(initial_serving=3, warm_pool=0, min_replicas=2),
                      traffic(rate=0.001, factor=1.0))
    assert [sample.serving for sample in report.scaling][-1] == 2
