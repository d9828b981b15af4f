"""The autoscaler's control law: leading demand, warm pool first, hysteresis, cool-downs, bounds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sluice.autoscaler.control import (
    BAD_BOUNDS,
    BAD_HYSTERESIS,
    Autoscaler,
    PoolSignals,
    ScalerConfig,
)

CONFIG = ScalerConfig(runs_per_replica=10, min_replicas=1, max_replicas=16, warm_pool=1,
                      target_utilization=0.8, scale_in_utilization=0.5, cold_start_s=90,
                      scale_out_cooldown_s=15, scale_in_cooldown_s=120)


def signals(now: float = 100.0, serving: int = 2, warm: int = 1, starting: int = 0, in_flight: int = 0,
            queue: int = 0, kv: float = 0.0, ttft: float | None = None, rate: float = 0.0,
            slope: float = 0.0) -> PoolSignals:
    return PoolSignals(now_s=now, serving=serving, warm=warm, starting=starting, draining=0,
                       in_flight=in_flight, queue_depth=queue, kv_utilization=kv, ttft_p95_s=ttft,
                       arrival_rate=rate, arrival_slope=slope)


def test_a_queue_step_promotes_the_warm_pool_first_and_starts_the_rest_cold() -> None:
    decision = Autoscaler(CONFIG).decide(signals(serving=2, warm=1, in_flight=16, queue=20))
    # 36 runs wanted at 8 per replica (10 x 0.8): 5 serving; 1 warm promoted, 2 started for the
    # missing serving replicas and 1 more to refill the warm pool
    assert decision.serving_target == math.ceil(36 / 8) == 5
    assert (decision.promote, decision.start, decision.drain) == (1, 3, 0)
    assert decision.reason == "queue"


def test_cold_starts_under_way_count_toward_what_is_missing() -> None:
    decision = Autoscaler(CONFIG).decide(signals(serving=2, warm=0, starting=2, in_flight=16, queue=20))
    # missing 3 serving + 1 warm = 4 wanted, 2 already starting
    assert (decision.promote, decision.start) == (0, 2)


def test_the_leading_indicator_sizes_for_the_traffic_one_cold_start_ahead() -> None:
    # 2 runs/s, 20 in flight: runs last 10 s; +0.02 runs/s per s over 90 s: 3.8 runs/s -> 38 runs
    decision = Autoscaler(CONFIG).decide(signals(serving=3, warm=0, in_flight=20, rate=2.0, slope=0.02))
    assert decision.reason == "leading"
    assert decision.demand_runs == pytest.approx(38.0)
    assert decision.serving_target == math.ceil(38 / 8)


def test_ttft_past_its_headroom_adds_a_replica_even_when_load_looks_fine() -> None:
    decision = Autoscaler(CONFIG).decide(signals(serving=3, warm=1, in_flight=10, ttft=0.45))
    assert (decision.serving_target, decision.promote, decision.reason) == (4, 1, "ttft")


def test_scale_out_waits_out_its_cool_down() -> None:
    scaler = Autoscaler(CONFIG)
    assert scaler.decide(signals(now=100, serving=2, warm=1, queue=40)).promote == 1
    held = scaler.decide(signals(now=110, serving=3, warm=0, starting=4, queue=80))
    assert (held.promote, held.start, held.reason) == (0, 0, "scale-out cool-down")
    assert scaler.decide(signals(now=116, serving=3, warm=0, starting=4, queue=80)).start > 0


def test_scale_in_drains_only_below_the_lower_threshold_and_after_its_cool_down() -> None:
    scaler = Autoscaler(CONFIG)
    # 20 runs on 4 replicas: out target 3 (<= 4) but in target ceil(20 / 5) = 4: the hysteresis band holds
    assert scaler.decide(signals(now=100, serving=4, warm=1, in_flight=20)).drain == 0
    # 10 runs on 6: in target 2, drain 4
    assert scaler.decide(signals(now=200, serving=6, warm=1, in_flight=10)).drain == 4
    assert scaler.decide(signals(now=300, serving=2 + 2, warm=1, in_flight=3)).reason == "scale-in cool-down"
    assert scaler.decide(signals(now=321, serving=4, warm=1, in_flight=3)).drain == 3


def test_bounds_hold_min_serving_and_max_gpus() -> None:
    low = ScalerConfig(runs_per_replica=10, min_replicas=2, max_replicas=4, warm_pool=1)
    assert Autoscaler(low).decide(signals(serving=3, warm=1, in_flight=0)).drain == 1      # not below 2
    # 3 serving + 0 warm + 0 starting of 4: one GPU of room whatever the demand
    grown = Autoscaler(low).decide(signals(serving=3, warm=0, queue=400))
    assert (grown.serving_target, grown.start) == (4, 1)


def test_the_warm_pool_is_kept_at_its_size_while_holding() -> None:
    held = Autoscaler(CONFIG).decide(signals(serving=2, warm=3, in_flight=12))
    assert (held.retire_warm, held.start) == (2, 0)
    refill = Autoscaler(CONFIG).decide(signals(serving=2, warm=0, in_flight=12))
    assert refill.start == 1


def test_bad_configurations_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError) as bounds:
        ScalerConfig(runs_per_replica=1, min_replicas=5, max_replicas=2)
    assert str(bounds.value) == BAD_BOUNDS.format(low=5, high=2)
    with pytest.raises(ValueError) as band:
        ScalerConfig(runs_per_replica=1, scale_in_utilization=0.9, target_utilization=0.8)
    assert str(band.value) == BAD_HYSTERESIS.format(low=0.9, high=0.8)


def test_a_draining_replica_holds_its_gpus_and_refills_the_warm_pool_so_nothing_starts_for_it() -> None:
    # max 3: 2 serving + 1 draining hold all three; the drained one will return to the warm pool
    config = dataclasses.replace(CONFIG, max_replicas=3, warm_pool=1)
    draining = dataclasses.replace(signals(serving=2, warm=0, in_flight=6), draining=1)
    decision = Autoscaler(config).decide(draining)
    assert decision.reason == "steady"
    assert (decision.promote, decision.start, decision.drain, decision.retire_warm) == (0, 0, 0, 0)
    # the same pool without the draining replica refills its warm pool with one cold start
    assert Autoscaler(config).decide(signals(serving=2, warm=0, in_flight=6)).start == 1


def test_a_surge_while_replicas_drain_cancels_the_drains_before_promoting_or_starting() -> None:
    # 2 serving, 1 draining, 1 warm; 36 runs want 5 serving (8 a replica): the drain is cancelled, the
    # warm one promoted, and 2 started: the fifth serving replica and the warm pool's refill
    surge = dataclasses.replace(signals(serving=2, warm=1, in_flight=16, queue=20), draining=1)
    decision = Autoscaler(CONFIG).decide(surge)
    assert (decision.undrain, decision.promote, decision.start) == (1, 1, 2)
    # a surge of one replica with two draining: one drain cancelled, nothing promoted or started
    small = dataclasses.replace(signals(serving=2, warm=1, in_flight=16, queue=2), draining=2)
    decision = Autoscaler(CONFIG).decide(small)
    assert decision.serving_target == math.ceil(18 / 8) == 3
    assert (decision.undrain, decision.promote, decision.start) == (1, 0, 0)


def test_a_cold_start_that_lands_during_the_scale_out_cool_down_is_kept_for_promotion() -> None:
    # no warm pool: the replica started for the second serving slot arrives warm while the cool-down
    # still holds growth; retiring it as "beyond the warm pool" would start it again and again
    config = dataclasses.replace(CONFIG, warm_pool=0)
    scaler = Autoscaler(config)
    assert scaler.decide(signals(now=100, serving=1, warm=0, queue=12)).start == 1
    held = scaler.decide(signals(now=105, serving=1, warm=1, queue=12))
    assert (held.reason, held.retire_warm, held.start) == ("scale-out cool-down", 0, 0)
    assert scaler.decide(signals(now=116, serving=1, warm=1, queue=12)).promote == 1
    # once nothing wants it, an extra warm replica is retired as before
    assert scaler.decide(signals(now=300, serving=2, warm=1, in_flight=12)).retire_warm == 1
