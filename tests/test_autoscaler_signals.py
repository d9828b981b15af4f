"""From the ledger's pool load and the replicas' scrapes to the control law's signals (pure)."""

from __future__ import annotations

import pytest
from sluice.ledger.pool_load import PoolLoad

from sluice.autoscaler.signals import ArrivalTrend, Members, pool_signals, predicted_wait_s
from sluice.router.load import LoadSnapshot

WINDOW_S = 30.0


def load(accepted: int = 0, in_flight: int = 0, arrivals: int = 0, completions: int = 0,
         ttft: float | None = None, by_replica: dict[str, int] | None = None) -> PoolLoad:
    return PoolLoad(accepted=accepted, in_flight=in_flight, arrivals=arrivals, completions=completions,
                    ttft_p95_s=ttft, by_replica=by_replica or {})


def test_the_predicted_wait_is_the_queue_over_the_rate_runs_ended_at():
    # 12 waiting, 60 ended in 30 s: 2 runs/s drain 12 in 6 s
    assert predicted_wait_s(load(accepted=12, completions=60), WINDOW_S) == 12 / (60 / 30) == 6.0
    assert predicted_wait_s(load(accepted=0, completions=60), WINDOW_S) == 0.0
    # nothing ended in the window: the queue is at least a window old
    assert predicted_wait_s(load(accepted=3, completions=0), WINDOW_S) == WINDOW_S


def test_runs_in_engine_queues_count_as_queue_and_a_draining_replicas_runs_not_at_all():
    members = Members(serving=2, warm=1, starting=0, draining=["d"])
    scraped = {"a": LoadSnapshot(waiting=3, kv_fraction=0.5), "b": LoadSnapshot(waiting=1, kv_fraction=0.25)}
    signals = pool_signals(100.0, load(accepted=5, in_flight=20, completions=30, ttft=0.2,
                                       by_replica={"d": 4}),
                           members, scraped, WINDOW_S, rate=1.0, slope=0.0)
    # 20 in flight in the ledger: 4 on the draining replica, 3 + 1 still waiting in an engine queue
    assert signals.in_flight == 20 - 4 - (3 + 1) == 12
    assert signals.queue_depth == 5 + 3 + 1 == 9
    assert signals.kv_utilization == pytest.approx((0.5 + 0.25) / 2)
    assert (signals.serving, signals.warm, signals.draining) == (2, 1, 1)
    # the 5 runs waiting leave the queue in 5 s at 1 run/s: past the 0.2 s measured p95
    assert signals.ttft_p95_s == 5 / (30 / 30) == 5.0


def test_the_measured_ttft_stands_when_nothing_waits():
    signals = pool_signals(0.0, load(in_flight=2, ttft=0.3), Members(1, 0, 0, []), {}, WINDOW_S, 0.0, 0.0)
    assert signals.ttft_p95_s == 0.3 and signals.queue_depth == 0 and signals.kv_utilization == 0.0


def test_the_arrival_slope_waits_for_a_full_window_then_compares_with_slope_windows_ago():
    trend = ArrivalTrend(window_s=10.0, interval_s=5.0, slope_windows=2)
    # 5 s in: 10 arrivals over the 5 s elapsed, no slope from a window still filling
    assert trend.observe(10, elapsed_s=5.0) == (2.0, 0.0)
    assert trend.observe(20, elapsed_s=10.0) == (2.0, 0.0)
    assert trend.observe(30, elapsed_s=15.0) == (3.0, (3.0 - 2.0) / 5.0)
    # two intervals back: (5 - 2) / 10 s
    assert trend.observe(50, elapsed_s=20.0) == (5.0, (5.0 - 2.0) / 10.0)
