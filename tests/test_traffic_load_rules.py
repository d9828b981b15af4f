"""Issue 14 points 4-6, the pure rules: claim order and batch headroom, the GPU-memory (KV token)
budget at dispatch, and the degradation ladder. Expected values are worked out in each test."""

from __future__ import annotations

import pytest

from sluice.traffic.gpu_budget import Candidate, claimable, kv_tokens, never_fits
from sluice.traffic.ladder import (
    LadderThresholds,
    PoolSignals,
    Step,
    allows_fallback,
    climb,
    drain_rate,
    retry_after_ms,
    sheds_batch,
    sheds_interactive,
)
from sluice.traffic.priority import (
    Headroom,
    PoolLoad,
    ReplicaLoad,
    has_headroom,
)

# --- priority: headroom ----------------------------------------------------------------------------------


def pool(*loads: ReplicaLoad) -> PoolLoad:
    return PoolLoad.of(loads)


def test_pool_load_sums_replicas_and_derives_depth_and_utilizations() -> None:
    load = pool(ReplicaLoad(waiting=1, running=10, kv_used_blocks=30, kv_capacity_blocks=100, max_slots=32),
                ReplicaLoad(waiting=0, running=14, kv_used_blocks=50, kv_capacity_blocks=100, max_slots=32))
    assert load.queue_depth == 0.5               # 1 waiting over 2 replicas
    assert load.kv_utilization == 0.4           # 80 / 200
    assert load.slot_utilization == 25 / 64     # (24 running + 1 waiting) / 64 slots


def test_slots_unknown_on_any_replica_leaves_slot_use_out_of_the_rule() -> None:
    load = pool(ReplicaLoad(0, 60, 0, 100, max_slots=32), ReplicaLoad(0, 60, 0, 100, max_slots=0))
    assert load.slots == 0 and load.slot_utilization == 0.0


@pytest.mark.parametrize(("replica", "expected"), [
    (ReplicaLoad(waiting=0, running=23, kv_used_blocks=69, kv_capacity_blocks=100, max_slots=32), True),
    (ReplicaLoad(waiting=1, running=0, kv_used_blocks=0, kv_capacity_blocks=100, max_slots=32), False),  # 1
    (ReplicaLoad(waiting=0, running=0, kv_used_blocks=70, kv_capacity_blocks=100, max_slots=32), False),  # kv
    (ReplicaLoad(waiting=0, running=24, kv_used_blocks=0, kv_capacity_blocks=100, max_slots=32), False),  # sl
])
def test_batch_is_dispatched_only_strictly_below_every_threshold(replica: ReplicaLoad,
                                                                   expected: bool) -> None:
    assert has_headroom(pool(replica), Headroom(max_queue_depth=1.0, max_kv_utilization=0.7,
                                                max_slot_utilization=0.75)) is expected


def test_a_pool_with_no_serving_replica_has_no_headroom() -> None:
    assert has_headroom(pool(), Headroom()) is False


def test_headroom_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_kv_utilization"):
        Headroom(max_kv_utilization=1.5)
    with pytest.raises(ValueError, match="max_queue_depth"):
        Headroom(max_queue_depth=0)


# --- GPU-memory budget ------------------------------------------------------------------------------


def test_a_run_holds_its_prompt_plus_output_cap() -> None:
    assert kv_tokens(900, 100) == 1000


def test_a_run_larger_than_the_whole_budget_never_fits() -> None:
    assert never_fits(1001, 1000) and not never_fits(1000, 1000) and not never_fits(10**9, None)


def test_runs_are_taken_in_order_while_their_tenant_stays_within_its_budget() -> None:
    # Tenant a: cap 1,000, already holds 600. Its runs of 300 (→ 900) fit, the next 300 (→ 1,200) does
    # not, and a's 50 after it waits too (a tenant's runs start in order). Tenant b has no cap.
    candidates = [Candidate("a1", "a", 300), Candidate("b1", "b", 5000), Candidate("a2", "a", 300),
                  Candidate("a3", "a", 50), Candidate("b2", "b", 5000)]
    assert claimable(candidates, held={"a": 600}, budgets={"a": 1000}) == ["a1", "b1", "b2"]


def test_a_tenant_exactly_at_its_budget_may_take_a_run_that_ends_exactly_on_it() -> None:
    assert claimable([Candidate("x", "a", 400)], held={"a": 600}, budgets={"a": 1000}) == ["x"]
    assert claimable([Candidate("x", "a", 401)], held={"a": 600}, budgets={"a": 1000}) == []


# --- the degradation ladder -------------------------------------------------------------------------


THRESHOLDS = LadderThresholds(shed_batch_backlog=250, fallback_backlog=500, shed_backlog=1000,
                              configured_drain_runs_per_s=50.0, min_drained_to_measure=10,
                              max_retry_after_ms=60_000)


@pytest.mark.parametrize(("backlog", "headroom", "step"), [
    (0, None, Step.NORMAL),
    (0, True, Step.NORMAL),
    (0, False, Step.DEFER_BATCH),          # no headroom: batch waits
    (1, True, Step.DEFER_BATCH),           # an interactive run waiting: batch waits behind it
    (249, True, Step.DEFER_BATCH),
    (250, True, Step.SHED_BATCH),
    (499, None, Step.SHED_BATCH),
    (500, None, Step.FALLBACK),
    (999, None, Step.FALLBACK),
    (1000, None, Step.SHED_INTERACTIVE),
])
def test_each_step_is_taken_at_its_threshold(backlog: int, headroom: bool | None, step: Step) -> None:
    assert climb(PoolSignals(interactive_backlog=backlog, headroom=headroom), THRESHOLDS).step is step


def test_a_growing_backlog_takes_the_steps_in_order_and_never_skips_one_back() -> None:
    steps = [climb(PoolSignals(backlog), THRESHOLDS).step for backlog in range(0, 1200)]
    firsts = [steps.index(step) for step in Step]
    assert firsts == [0, 1, 250, 500, 1000]
    assert steps == sorted(steps)


def test_the_predicates_follow_the_step() -> None:
    at = {backlog: climb(PoolSignals(backlog), THRESHOLDS) for backlog in (249, 250, 500, 1000)}
    assert [sheds_batch(at[b]) for b in (249, 250, 500, 1000)] == [False, True, True, True]
    assert [allows_fallback(at[b]) for b in (249, 250, 500, 1000)] == [False, False, True, True]
    assert [sheds_interactive(at[b]) for b in (249, 250, 500, 1000)] == [False, False, False, True]


def test_retry_after_uses_the_measured_drain_rate_when_the_window_saw_enough_claims() -> None:
    # 1,000 waiting; 40 runs claimed in the last 10 s → 4 runs/s measured → 1000 / 4 = 250 s, clamped
    # to 60 s. With 200 waiting: 200 / 4 = 50 s = 50,000 ms. The configured 50/s would have said 4 s.
    rung = climb(PoolSignals(1000, drained_runs=40, window_s=10.0), THRESHOLDS)
    assert (rung.step, rung.retry_after_ms, rung.drain_runs_per_s, rung.measured) == \
        (Step.SHED_INTERACTIVE, 60_000, 4.0, True)
    assert climb(PoolSignals(200, drained_runs=40, window_s=10.0), THRESHOLDS).retry_after_ms == 50_000


def test_too_few_claims_to_trust_fall_back_to_the_configured_rate() -> None:
    # 9 claims < 10: configured 50 runs/s; 1,000 waiting → 20,000 ms.
    rung = climb(PoolSignals(1000, drained_runs=9, window_s=10.0), THRESHOLDS)
    assert (rung.retry_after_ms, rung.drain_runs_per_s, rung.measured) == (20_000, 50.0, False)
    assert drain_rate(PoolSignals(1000), THRESHOLDS) == (50.0, False)


def test_retry_after_is_at_least_one_ms_and_rounds_up() -> None:
    assert retry_after_ms(0, 50.0, 60_000) == 1
    assert retry_after_ms(1, 3.0, 60_000) == 334      # 333.3… → 334


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="shed_batch <= fallback"):
        LadderThresholds(shed_batch_backlog=600, fallback_backlog=500, shed_backlog=1000,
                         configured_drain_runs_per_s=50.0)


def test_thresholds_from_fractions_of_the_shedding_backlog() -> None:
    thresholds = LadderThresholds.from_fractions(1000, 0.25, 0.5, 50.0)
    assert (thresholds.shed_batch_backlog, thresholds.fallback_backlog) == (250, 500)
    tiny = LadderThresholds.from_fractions(2, 0.25, 0.5, 50.0)   # ceil(0.5) = 1, ceil(1.0) = 1
    assert (tiny.shed_batch_backlog, tiny.fallback_backlog, tiny.shed_backlog) == (1, 1, 2)
