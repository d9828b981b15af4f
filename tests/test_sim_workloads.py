"""The routing suite's simulator pieces: bursty arrivals, a throttled replica, the hit-rate timeline."""

from __future__ import annotations

import math

import pytest

from sluice.sim.fleet import FleetConfig
from sluice.sim.metrics import RequestRecord, hit_timeline
from sluice.sim.workload import Workload, WorkloadConfig


def test_bursty_arrivals_fall_only_in_bursts_at_the_burst_rate() -> None:
    on, off, rate, duration = 2.0, 3.0, 20.0, 100.0
    config = WorkloadConfig(arrival="bursty", conversation_rate=rate, burst_on_s=on, burst_off_s=off,
                            duration_s=duration, system_prompt_tokens=0, seed=3)
    times = [at for at, _ in Workload(config).initial_arrivals()]
    assert all(at % (on + off) < on for at in times)
    assert times == sorted(times) and max(times) < duration
    # 20 bursts of 2 s at 20/s: 800 arrivals expected, Poisson sd ~28; 5 sd either way
    expected = rate * on * duration / (on + off)
    assert abs(len(times) - expected) < 5 * math.sqrt(expected)


def test_a_throttled_replica_takes_one_over_its_speed_as_long_per_step() -> None:
    config = FleetConfig(slow_replicas=((0, 0.6),))
    slow, normal = config.cost_model(0), config.cost_model(1)
    for batch, context in ((1, 512), (64, 2048), (160, 4096)):
        assert slow.decode_step_s(batch, context) == pytest.approx(normal.decode_step_s(batch, context) / 0.6)
    assert slow.prefill_tokens_per_s() == pytest.approx(normal.prefill_tokens_per_s() * 0.6)


def test_the_hit_timeline_is_cached_over_prompt_tokens_per_window_of_first_tokens() -> None:
    records = [
        RequestRecord("a", "r0", arrival_s=0.0, input_tokens=100, first_token_s=1.0, cached_tokens=50),
        RequestRecord("b", "r0", arrival_s=0.5, input_tokens=300, first_token_s=4.9, cached_tokens=0),
        RequestRecord("c", "r1", arrival_s=9.0, input_tokens=200, first_token_s=12.0, cached_tokens=200),
        RequestRecord("d", "r1", arrival_s=9.5, input_tokens=200),           # no first token yet: left out
    ]
    assert hit_timeline(records, window_s=5.0) == ((0.0, 50 / 400), (10.0, 1.0))
