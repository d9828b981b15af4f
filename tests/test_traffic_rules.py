"""The pure traffic rules (sluice/traffic): permitted fallback, the canary split, the guardrails."""

from __future__ import annotations

import math

import pytest

from sluice.traffic.canary import (
    SHARE_SCALE,
    ArmStats,
    Guardrails,
    RunSample,
    Verdict,
    judge,
    p95,
    split_point,
    summarize,
    takes_candidate,
)
from sluice.traffic.fallback import (
    Candidate,
    Condition,
    FallbackRule,
    Narrowing,
    Unusable,
    permitted,
    queue_bound,
    unusable,
)

BOTH = frozenset({Condition.BACKLOG, Condition.DEADLINE})
RULES = (
    FallbackRule("chat-70b", "chat-8b", BOTH),
    FallbackRule("chat-70b", "chat-3b", frozenset({Condition.BACKLOG})),
    FallbackRule("chat-70b-v3", "chat-8b", BOTH),          # the same target through the version: once
    FallbackRule("code-34b", "code-7b", BOTH),
)


# --- permitted fallback ------------------------------------------------------------------------


def test_the_tenants_rules_for_the_requested_name_or_its_version_apply_in_order_once_each():
    assert permitted(RULES, "chat-70b", "chat-70b-v3", Condition.BACKLOG) == ("chat-8b", "chat-3b")
    assert permitted(RULES, "chat-70b", "chat-70b-v3", Condition.DEADLINE) == ("chat-8b",)
    assert permitted(RULES, "chat-70b-v3", "chat-70b-v3", Condition.DEADLINE) == ("chat-8b",)
    assert permitted(RULES, "embed", "embed-v1", Condition.BACKLOG) == ()


def test_a_request_only_narrows_the_permission():
    assert permitted(RULES, "chat-70b", "v3", Condition.BACKLOG, Narrowing(refuse=True)) == ()
    assert permitted(RULES, "chat-70b", "v3", Condition.BACKLOG,
                     Narrowing(models=frozenset({"chat-3b"}))) == ("chat-3b",)
    assert permitted(RULES, "chat-70b", "v3", Condition.BACKLOG,
                     Narrowing(conditions=frozenset({Condition.DEADLINE}))) == ()
    # Naming a model or condition the tenant never permitted adds nothing.
    assert permitted(RULES, "chat-70b", "v3", Condition.DEADLINE,
                     Narrowing(models=frozenset({"chat-3b", "chat-1b"}))) == ()


def candidate(tier: str = "standard", backlog: int = 0, version: str | None = "chat-8b-v1") -> Candidate:
    return Candidate("chat-8b", version, tier, 8192, backlog)


@pytest.mark.parametrize(("found", "why"), [
    (candidate(), None),
    (candidate(version=None), Unusable.UNKNOWN),
    (candidate(version="chat-70b-v3"), Unusable.SAME_MODEL),
    (candidate(tier="premium"), Unusable.TIER),
    (candidate(backlog=10), Unusable.BACKLOG),
    (candidate(backlog=9), None),
])
def test_a_candidate_is_usable_only_in_an_allowed_tier_with_room_in_its_own_pool(found, why):
    assert unusable(found, "chat-70b-v3", ("standard",), max_backlog=10) is why


def test_the_deadline_condition_holds_only_when_the_queue_is_what_misses_it():
    assert queue_bound(deadline_ms=1_000, queue_ms=800, service_ms=300)        # 1,100 > 1,000 >= 300
    assert not queue_bound(deadline_ms=1_000, queue_ms=700, service_ms=300)    # fits as it is
    assert not queue_bound(deadline_ms=1_000, queue_ms=0, service_ms=1_200)    # too long on any pool


# --- canary split ---------------------------------------------------------------------------------


def test_a_conversation_always_lands_on_the_same_side_and_a_larger_share_keeps_it_there():
    points = {conversation: split_point("chat", conversation) for conversation in map(str, range(2_000))}
    assert all(0 <= point < SHARE_SCALE for point in points.values())
    assert points == {conversation: split_point("chat", conversation) for conversation in points}
    at_20 = {c for c, point in points.items() if takes_candidate(point, 2_000)}
    at_50 = {c for c, point in points.items() if takes_candidate(point, 5_000)}
    assert at_20 < at_50
    assert not any(takes_candidate(point, 0) for point in points.values())


def test_the_split_sends_the_configured_share_within_binomial_tolerance():
    # n conversations each take the candidate with p = 0.2: the count is Binomial(n, p); with a hash
    # that behaves uniformly it lies within 4 standard deviations with probability > 0.9999.
    n, p = 10_000, 0.2
    taken = sum(takes_candidate(split_point("chat", f"conversation-{i}"), 2_000) for i in range(n))
    sd = math.sqrt(n * p * (1 - p))
    assert abs(taken - n * p) <= 4 * sd, (taken, n * p, sd)


# --- guardrails -----------------------------------------------------------------------------------

LIMITS = Guardrails(min_samples=20, max_ttft_ratio=1.5, max_tpot_ratio=1.5, max_failure_rate_increase=0.05,
                    ttft_slack_s=0.05, tpot_slack_s=0.002)


def arm(n: int, ttft_s: float, tpot_s: float, failures: int = 0) -> ArmStats:
    return summarize([RunSample(ttft_s, tpot_s, i < failures) for i in range(n)])


def test_p95_is_the_nearest_rank():
    assert p95([float(v) for v in range(1, 101)]) == 95.0
    assert p95([float(v) for v in range(1, 21)]) == 19.0
    assert p95([3.0]) == 3.0 and p95([]) is None


def test_the_guardrail_holds_until_both_arms_have_the_minimum_samples():
    judged = judge(arm(19, 9.0, 9.0, failures=19), arm(200, 0.2, 0.02), LIMITS)
    assert judged.verdict is Verdict.HOLD
    assert judged.reason == "waiting for 20 samples per arm (candidate 19, baseline 200 runs)"


def test_a_candidate_within_the_limits_passes():
    assert judge(arm(20, 0.29, 0.029), arm(40, 0.2, 0.02), LIMITS).verdict is Verdict.PASS


def test_a_slower_candidate_breaches_on_ttft_and_tpot_and_says_by_how_much():
    judged = judge(arm(20, 0.4, 0.05), arm(40, 0.2, 0.02), LIMITS)
    assert judged.verdict is Verdict.BREACH
    assert judged.reason == ("p95 TTFT 400.0 ms vs baseline 200.0 ms (limit x1.5); "
                             "p95 TPOT 50.0 ms vs baseline 20.0 ms (limit x1.5) "
                             "over 20 candidate / 40 baseline runs")


def test_a_tiny_absolute_difference_is_never_a_breach():
    # 3x the baseline's TTFT, but only 40 ms more: within the slack.
    assert judge(arm(20, 0.06, 0.02), arm(20, 0.02, 0.02), LIMITS).verdict is Verdict.PASS


def test_more_failures_than_the_baseline_plus_the_margin_breach():
    judged = judge(arm(20, 0.2, 0.02, failures=2), arm(20, 0.2, 0.02), LIMITS)   # 10% vs 0% (+5%)
    assert judged.verdict is Verdict.BREACH
    assert judged.reason.startswith("FAILED/INTERRUPTED rate 10.0% vs baseline 0.0% (limit +5.0%)")
    assert judge(arm(20, 0.2, 0.02, failures=1), arm(20, 0.2, 0.02), LIMITS).verdict is Verdict.PASS
