"""Priority classes and the degradation ladder on the fleet simulator (issue 14 points 4 and 6):
batch fills idle slots without ever going ahead of a waiting interactive request, and under a traffic
step the ladder's steps are first taken in their order. The figures (interactive p95 TTFT with and
without batch) are in bench/bench_traffic.py; here the rules."""

from __future__ import annotations

import dataclasses

from sluice.engine.profiles import get_model
from sluice.engine.types import EngineConfig
from sluice.sim.fleet import FleetConfig, run_fleet
from sluice.sim.traffic import BatchWork, LadderSim, TrafficPolicy, ladder_for
from sluice.sim.workload import WorkloadConfig
from sluice.traffic.ladder import Step
from sluice.traffic.priority import Headroom

SLOTS = 16


def fleet(traffic: TrafficPolicy | None) -> FleetConfig:
    return FleetConfig(replicas=2, tp=1, model=get_model("llama-3-8b"), traffic=traffic,
                       engine=EngineConfig(block_size=32, max_num_seqs=SLOTS, max_num_tokens=2048,
                                           stream_tokens=False))


def trough(duration_s: float = 60.0) -> WorkloadConfig:
    return WorkloadConfig(duration_s=duration_s, arrival="poisson", conversation_rate=1.0, think_time_s=20.0,
                          model_version="llama-3-8b", seed=5)


def test_batch_fills_idle_slots_within_its_share_and_never_ahead_of_a_waiting_interactive_request():
    batch = BatchWork(backlog=10_000, prompt_tokens=200, output_tokens=500,
                      headroom=Headroom(max_slot_utilization=0.25))
    alone = run_fleet(fleet(None), trough(), "round_robin")
    filled = run_fleet(fleet(TrafficPolicy(batch=batch)), trough(), "round_robin")

    traffic = filled.traffic
    assert traffic is not None and alone.traffic is None
    assert traffic.batch_completed > 0 and traffic.batch_output_tokens == 500 * traffic.batch_completed
    assert traffic.batch_dispatched_past_interactive == 0
    # Its share: dispatched only while (running + waiting) / (2 x 16 slots) < 0.25, i.e. with at most 7
    # in the pool, so the pool holds at most 8 batch requests at once (fewer beside interactive ones).
    assert traffic.batch_peak == 8
    # Interactive figures count interactive requests only: every completed one is a chat turn.
    assert filled.requests_completed == filled.ttft.count
    assert filled.requests_rejected == 0


def test_under_a_traffic_step_the_ladder_takes_its_steps_in_order_and_each_acts():
    thresholds = ladder_for(120, 50.0)            # shed batch at 30, fallbacks at 60, shed at 120
    policy = TrafficPolicy(
        batch=BatchWork(backlog=0, rate_per_s=1.0, prompt_tokens=200, output_tokens=1000,
                        headroom=Headroom(max_slot_utilization=0.25)),
        ladder=LadderSim(thresholds, fallback_share=0.5))
    step = dataclasses.replace(trough(150.0), conversation_rate=1.0, ramp_factor=12.0, ramp_start_s=30.0,
                               ramp_s=60.0, seed=3)

    report = run_fleet(fleet(policy), step, "round_robin")

    traffic = report.traffic
    assert traffic is not None
    labels = [label for label, _ in traffic.steps_first_at]
    times = [at for _, at in traffic.steps_first_at]
    assert labels == [s.label for s in Step]           # normal, defer batch, shed batch, fallback, shed
    assert times == sorted(times) and len(set(times)) == len(times)
    actions = dict(traffic.actions)
    assert all(actions.get(s.label, 0) > 0 for s in Step if s is not Step.NORMAL)
    assert traffic.batch_shed == actions["shed_batch"]
    assert traffic.interactive_shed == actions["shed_interactive"]
    assert traffic.interactive_fell_back == actions["fallback"]
    assert report.requests_rejected >= traffic.interactive_shed
    # The last shed was told a retry-after from the drain rate measured over its window.
    assert traffic.last_drain_measured and traffic.last_retry_after_ms > 0
    assert traffic.batch_dispatched_past_interactive == 0
