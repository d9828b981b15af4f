"""least_loaded and prefix_aware: affinity, the imbalance bound, restarts, long-context pool, factory."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import replace

import pytest

from sluice.router.factory import (
    BAD_POLICY_OPTIONS,
    ORACLE_NEEDS_PROBE,
    UNKNOWN_POLICY,
    make_policy,
    make_policy_from_config,
)
from sluice.router.load import LoadSnapshot, LoadTracker
from sluice.router.policies import (
    NOT_WHOLE,
    OUTCOME_AFFINITY_HIT,
    OUTCOME_BALANCED_AWAY,
    OUTCOME_FALLBACK,
    UNKNOWN_OPTION,
    Home,
    LeastLoaded,
    PolicyOptions,
    PrefillBacklog,
    PrefixAware,
    load_limit,
)
from sluice.router.policy import ReplicaView, RoundRobin, RouteDecision, RouteRequest, explain

BS = 4
EXACT = PolicyOptions(index_unit_tokens=BS)                          # one index entry per KV block
SYSTEM = list(range(1000, 1016))                                    # 4 blocks shared by every chat


def view(name: str, running: int = 0, kv_used: int = 0, long_context: bool = False,
         capacity: int = 1000) -> ReplicaView:
    return ReplicaView(name=name, pool="m", block_size=BS, kv_capacity_blocks=capacity,
                       running=running, kv_used_blocks=kv_used, long_context=long_context)


def request(request_id: str, tokens: Sequence[int], conversation: str | None = None) -> RouteRequest:
    return RouteRequest(request_id=request_id, model_version="m", token_ids=list(tokens),
                        max_output_tokens=16, conversation_id=conversation)


def route(policy: PrefixAware | LeastLoaded, req: RouteRequest, views: Sequence[ReplicaView],
          now: float = 1.0) -> RouteDecision:
    decision = policy.choose(req, views, now)
    assert decision is not None
    policy.on_routed(req, decision, now)
    return decision


def turn(conversation: int, number: int) -> list[int]:
    """Prompt of a chat's turn `number`: system prompt, then 8 tokens of history per turn."""
    history = [conversation * 10_000 + i for i in range(8 * number)]
    return SYSTEM + history


# -- least_loaded --------------------------------------------------------------------------------


def test_least_loaded_picks_the_replica_with_fewest_requests():
    policy = LeastLoaded()
    decision = policy.choose(request("a", range(8)), [view("r0", running=3), view("r1", running=1)], 0.0)
    assert decision == RouteDecision(replica="r1", outcome="least_loaded")


def test_least_loaded_breaks_ties_by_kv_utilization_then_name():
    policy = LeastLoaded()
    views = [view("r0", running=2, kv_used=500), view("r1", running=2, kv_used=100), view("r2", running=2,
                                                                                          kv_used=100)]
    assert policy.choose(request("a", range(8)), views, 0.0) == RouteDecision("r1", "least_loaded")


def test_least_loaded_sees_a_burst_between_scrapes_through_its_own_in_flight_count():
    policy = LeastLoaded()
    views = [view(f"r{i}") for i in range(4)]                       # scrape says: all idle
    chosen = [route(policy, request(str(n), range(8)), views).replica for n in range(8)]
    assert sorted(chosen) == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]


def test_finished_runs_no_longer_count_as_load():
    policy = LeastLoaded()
    views = [view("r0"), view("r1")]
    first = request("a", range(8))
    route(policy, first, views)                                     # r0 now has 1
    policy.on_finished(first, "r0", 2.0)
    assert policy.choose(request("b", range(8)), views, 2.0) == RouteDecision("r0", "least_loaded")


# -- prefix_aware: affinity ------------------------------------------------------------------------


@pytest.mark.parametrize("home_in_cost", [1, 0], ids=["credited in the cost", "sticky"])
def test_a_follow_up_turn_goes_to_the_replica_that_served_the_previous_turn(home_in_cost: int):
    policy = PrefixAware(replace(EXACT, home_in_cost=home_in_cost))
    views = [view(f"r{i}") for i in range(4)]
    previous = request("t1", turn(7, 1), conversation="c7")         # 24 tokens
    first = route(policy, previous, views)
    policy.on_finished(previous, first.replica, 1.5, output_tokens=5)   # holds 24 + 5 - 1 = 28: 7 blocks
    # The previous replica is now slightly busier, but within the bound; it lacks one block of turn 2's 8,
    # the others all 8.
    busier = [view(v.name, running=2 if v.name == first.replica else 0) for v in views]
    second = route(policy, request("t2", turn(7, 2), conversation="c7"), busier, now=2.0)
    assert second.replica == first.replica
    assert second.outcome == OUTCOME_AFFINITY_HIT
    assert second.predicted_cached_tokens == 7 * BS


def test_a_follow_up_without_conversation_id_still_follows_its_cached_prefix():
    policy = PrefixAware(EXACT)
    views = [view(f"r{i}") for i in range(4)]
    previous = request("t1", turn(7, 3))
    first = route(policy, previous, views)
    policy.on_finished(previous, first.replica, 1.5)                # the user reads the reply, then writes
    busier = [view(v.name, running=1 if v.name == first.replica else 0) for v in views]
    second = route(policy, request("t2", turn(7, 4)), busier, now=2.0)
    assert (second.replica, second.outcome) == (first.replica, OUTCOME_AFFINITY_HIT)
    assert second.predicted_cached_tokens == len(turn(7, 3))


def test_a_follow_up_goes_elsewhere_when_its_replica_is_past_the_imbalance_bound():
    policy = PrefixAware(PolicyOptions(imbalance_bound=0.1, imbalance_slack=2))
    views = [view("r0"), view("r1"), view("r2")]
    first = route(policy, request("t1", turn(7, 1), conversation="c7"), views)
    # limit = mean (16 + 10 + 10) / 3 = 12, * 1.1 + 2 = 15.2: the previous replica at 16 is past it.
    loaded = [view(v.name, running=16 if v.name == first.replica else 10) for v in views]
    second = route(policy, request("t2", turn(7, 2), conversation="c7"), loaded)
    assert second.replica != first.replica
    assert second.outcome == OUTCOME_BALANCED_AWAY


def test_a_follow_up_at_exactly_the_bound_still_goes_home():
    policy = PrefixAware(PolicyOptions(imbalance_bound=0.1, imbalance_slack=2))
    views = [view("r0"), view("r1")]
    previous = request("t1", turn(7, 1), conversation="c7")
    first = route(policy, previous, views)
    policy.on_finished(previous, first.replica, 1.5, output_tokens=5)
    # limit = mean (13 + 10) / 2 = 11.5, * 1.1 + 2 = 14.65: the home at 13 is within it; it holds 7 of
    # 8 blocks.
    loaded = [view(v.name, running=13 if v.name == first.replica else 10) for v in views]
    second = route(policy, request("t2", turn(7, 2), conversation="c7"), loaded, now=2.0)
    assert second.replica == first.replica


def test_requests_sharing_only_the_system_prompt_are_a_fallback_decided_by_load():
    policy = PrefixAware(EXACT)
    assert route(policy, request("a", turn(1, 1)), [view("r0"), view("r1", running=100)]).replica == "r0"
    assert route(policy, request("b", turn(2, 1)), [view("r0", running=100), view("r1")]).replica == "r1"
    decision = policy.choose(request("c", turn(3, 1)), [view("r0", running=3), view("r1", running=2)], 1.0)
    assert decision is not None
    assert (decision.replica, decision.outcome) == ("r1", OUTCOME_FALLBACK)
    assert decision.predicted_cached_tokens == len(SYSTEM)


def test_with_dynamo_weight_the_cost_trades_saved_prefill_block_for_block_against_decode_load():
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100, prefill_weight=1.0))
    views = [view("r0"), view("r1")]
    previous = request("t1", turn(7, 10))                           # 96 tokens: 24 blocks cached there
    first = route(policy, previous, views)
    policy.on_finished(previous, first.replica, 1.0)
    other = "r1" if first.replica == "r0" else "r0"
    # 23 blocks more decode KV on the holder: the 24 blocks of saved prefill still win ...
    near = [view(first.replica, kv_used=23), view(other)]
    decision = policy.choose(request("t2", turn(7, 11)), near, 2.0)   # t1 prefilled long since
    assert decision is not None and decision.replica == first.replica
    # ... 30 blocks more do not.
    far = [view(first.replica, kv_used=30), view(other)]
    decision = policy.choose(request("t3", turn(7, 11)), far, 2.0)
    assert decision is not None and (decision.replica, decision.outcome) == (other, OUTCOME_BALANCED_AWAY)


def test_predicted_cached_tokens_leave_the_last_prompt_token_to_compute():
    policy = PrefixAware(EXACT)
    views = [view("r0")]
    route(policy, request("a", list(range(16))), views)
    decision = policy.choose(request("b", list(range(16))), views, 1.0)   # identical prompt: 4 blocks held
    assert decision is not None and decision.predicted_cached_tokens == 12


def test_the_index_keeps_one_entry_per_64_tokens_by_default():
    policy = PrefixAware()                                          # index_unit_tokens=64: 16 blocks of 4
    views = [view("r0", capacity=100)]
    route(policy, request("a", list(range(200))), views)            # 3 whole units of 64 tokens
    assert policy.index.entries("r0") == 3                          # of at most 100 // 16 = 6
    decision = policy.choose(request("b", list(range(190)) + [7] * 50), views, 1.0)
    assert decision is not None and decision.predicted_cached_tokens == 128   # 2 units: 190 tokens match


def test_by_default_a_saved_prefill_block_outweighs_64_blocks_of_decode_load():
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100))
    views = [view("r0"), view("r1")]
    previous = request("t1", turn(7, 10))                           # 24 blocks cached on its replica
    first = route(policy, previous, views)
    policy.on_finished(previous, first.replica, 1.0)
    other = "r1" if first.replica == "r0" else "r0"
    # Saving 24 blocks of prefill is worth 24 * 64 = 1,536 blocks of decode KV.
    near = policy.choose(request("t2", turn(7, 11)), [view(first.replica, kv_used=1535), view(other)], 2.0)
    far = policy.choose(request("t3", turn(7, 11)), [view(first.replica, kv_used=1537), view(other)], 2.0)
    assert near is not None and near.replica == first.replica
    assert far is not None and far.replica == other


# -- prefix_aware: prompt blocks queued for prefill ------------------------------------------------


def test_the_prefill_backlog_drains_at_its_rate_and_never_below_zero():
    backlog = PrefillBacklog()
    assert backlog.blocks("r0", 0.0, 50.0) == 0.0
    backlog.add("r0", 100, 0.0, 50.0)
    assert backlog.blocks("r0", 1.0, 50.0) == 50.0                 # 100 - 1 s x 50 blocks/s
    assert backlog.blocks("r0", 3.0, 50.0) == 0.0                  # worked off at 2 s, not -50
    backlog.add("r0", 10, 3.0, 50.0)
    assert backlog.blocks("r0", 3.0, 50.0) == 10.0
    backlog.drop_replica("r0")
    assert backlog.blocks("r0", 3.0, 50.0) == 0.0


def prefill_view(name: str, kv_used: int = 0) -> ReplicaView:
    # 400 prompt tokens/s in blocks of 4: each replica prefills 100 blocks a second
    return replace(view(name, kv_used=kv_used), prefill_tokens_per_s=400.0)


def test_a_follow_up_leaves_a_home_deep_in_prefill_and_returns_once_it_is_worked_off():
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100))   # no load bound
    busy = [prefill_view("r0"), prefill_view("r1", kv_used=5000)]   # r1 decodes 5,000 blocks of KV
    first = request("a1", turn(7, 10))                              # 96 tokens: 24 blocks
    assert route(policy, first, busy, now=0.0).replica == "r0"
    policy.on_finished(first, "r0", 0.5)                            # its 24 blocks were prefilled by 0.24 s
    # A new 200-block prompt, unrelated, also goes to r0: 64 x 200 there against 64 x 200 + 5,000 on r1.
    assert route(policy, request("b", range(50_000, 50_800)), busy, now=1.0).replica == "r0"
    # The conversation's next turn (25 blocks, 24 cached on r0). r0 would cost 64 x (1 + 200 queued)
    # + 200 in flight = 13,064; r1 64 x 25 + 5,000 = 6,600. Without the queue, r0's 264 would win.
    away = policy.choose(request("a2", turn(7, 11)), busy, 1.0)
    assert away is not None and (away.replica, away.outcome) == ("r1", OUTCOME_BALANCED_AWAY)
    # 1.5 s later 50 blocks are left: r0 costs 64 x 51 + 200 = 3,464 < 6,600, and the turn goes home.
    home = policy.choose(request("a2", turn(7, 11)), busy, 2.5)
    assert home is not None and (home.replica, home.outcome) == ("r0", OUTCOME_AFFINITY_HIT)


def test_the_queue_counts_at_most_its_cap_so_a_larger_saving_keeps_the_turn_home():
    # The same fleet as above with the queue capped at 200 tokens (50 blocks of 4).
    options = replace(EXACT, imbalance_bound=10.0, imbalance_slack=100, prefill_queue_cap_tokens=200)
    policy = PrefixAware(options)
    busy = [prefill_view("r0"), prefill_view("r1", kv_used=5000)]
    first = request("a1", turn(7, 10))
    assert route(policy, first, busy, now=0.0).replica == "r0"
    policy.on_finished(first, "r0", 0.5)
    assert route(policy, request("b", range(50_000, 50_800)), busy, now=1.0).replica == "r0"
    assert policy.prefill_backlog("r0", 1.0) == 200                 # queued, but counted as 50:
    # r0 costs 64 x (1 + 50) + 200 = 3,464, r1 64 x 25 + 5,000 = 6,600: the 24 saved blocks win.
    home = policy.choose(request("a2", turn(7, 11)), busy, 1.0)
    assert home is not None and (home.replica, home.outcome) == ("r0", OUTCOME_AFFINITY_HIT)


def test_only_the_blocks_not_expected_cached_join_the_queue():
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100))
    views = [prefill_view("r0")]
    route(policy, request("a1", turn(7, 10)), views, now=0.0)          # 24 blocks at t=0
    repeat = route(policy, request("a2", turn(7, 10)), views, now=1.0)  # worked off; 23 found cached
    assert repeat.predicted_cached_tokens == 23 * BS
    assert policy.prefill_backlog("r0", 1.0) == 24 - 23


def test_a_restart_empties_the_replicas_prefill_queue():
    policy = PrefixAware(EXACT)
    route(policy, request("b", range(50_000, 50_800)), [prefill_view("r0")], now=1.0)
    assert policy.prefill_backlog("r0", 1.0) == 200
    policy.on_replica_restarted("r0")
    assert policy.prefill_backlog("r0", 1.0) == 0


def test_a_follow_up_leaves_a_home_whose_queue_outweighs_the_saving_unless_the_home_is_sticky():
    # With home_in_cost (the default), session affinity is cache knowledge priced by the cost, not an
    # override: a home deep in prefill loses the turn as any holder would.
    options = replace(EXACT, imbalance_bound=10.0, imbalance_slack=100)                # no load bound
    sticky = PrefixAware(replace(options, home_in_cost=0))
    policy = PrefixAware(options)
    busy = [prefill_view("r0"), prefill_view("r1", kv_used=5000)]   # 100 blocks/s each; r1 decodes 5,000
    first = request("a1", turn(7, 1), conversation="c7")            # 24 tokens: 6 blocks
    for each in (sticky, policy):
        assert route(each, first, busy, now=0.0).replica == "r0"    # 64 x 6 against 64 x 6 + 5,000
        each.on_finished(first, "r0", 0.5)
        assert route(each, request("b", range(50_000, 50_800)), busy, now=1.0).replica == "r0"  # 200 queued
    # Sticky, the home takes every turn within the bound, whatever its queue.
    kept = sticky.choose(request("a2", turn(7, 2), conversation="c7"), busy, 1.0)
    assert kept is not None and (kept.replica, kept.outcome) == ("r0", OUTCOME_AFFINITY_HIT)
    # Turn 2 (8 blocks). Home r0, credited with turn 1's 6 blocks (no answer length was given):
    # 64 x (2 + 200 queued) + 200 in flight = 13,128; r1: 64 x 8 + 5,000 = 5,512.
    away = policy.choose(request("a2", turn(7, 2), conversation="c7"), busy, 1.0)
    assert away is not None and (away.replica, away.outcome) == ("r1", OUTCOME_BALANCED_AWAY)
    # 1.9 s later 10 blocks are left: r0 costs 64 x (2 + 10) + 200 = 968, and the turn goes home.
    home = policy.choose(request("a2", turn(7, 2), conversation="c7"), busy, 2.9)
    assert home is not None and (home.replica, home.outcome) == ("r0", OUTCOME_AFFINITY_HIT)


FIRST = request("a1", SYSTEM + list(range(70_000, 70_008)), conversation="c7")   # 24 tokens: 6 blocks
SECOND = request("a2", list(FIRST.token_ids) + list(range(80_000, 80_050)), conversation="c7")
"""Turn 2: turn 1's 24 tokens, its 40-token answer and a 10-token message: 74 tokens, 19 blocks."""


def first_turn_on_r0(policy: PrefixAware, views: Sequence[ReplicaView], answer: int | None) -> None:
    """Turn 1 to r0 at 0 s (prefilled by 0.06 s); it finishes at 0.5 s with `answer` tokens (None: the
    host does not say), or not at all while `answer` is 0."""
    assert route(policy, FIRST, views, now=0.0).replica == "r0"
    if answer is None:
        policy.on_finished(FIRST, "r0", 0.5)
    elif answer:
        policy.on_finished(FIRST, "r0", 0.5, output_tokens=answer)


def test_the_home_is_credited_with_the_previous_prompt_and_its_answer_and_queues_the_message_only():
    policy = PrefixAware(EXACT)
    views = [prefill_view("r0"), prefill_view("r1")]                # 100 blocks/s each
    first_turn_on_r0(policy, views, answer=40)
    # r0 computed the prompt and the answer but its last token (computed only if the engine sampled past
    # it): 24 + 40 - 1 = 63 tokens, 15 whole blocks; the other 4 (the message and the answer's last,
    # partly filled block) are new.
    follow_up = route(policy, SECOND, views, now=1.0)
    assert (follow_up.replica, follow_up.outcome) == ("r0", OUTCOME_AFFINITY_HIT)
    assert follow_up.predicted_cached_tokens == 15 * BS
    assert policy.prefill_backlog("r0", 1.0) == 19 - 15


def test_without_the_answers_length_the_home_is_credited_with_what_the_index_saw():
    policy = PrefixAware(EXACT)
    views = [prefill_view("r0"), prefill_view("r1")]
    first_turn_on_r0(policy, views, answer=None)                    # a host that does not count tokens
    follow_up = route(policy, SECOND, views, now=1.0)
    assert follow_up.predicted_cached_tokens == 6 * BS              # the 24-token prompt the index holds
    assert policy.prefill_backlog("r0", 1.0) == 19 - 6


def test_only_the_finish_of_the_turn_the_home_was_given_adds_its_answer():
    policy = PrefixAware(EXACT)
    views = [prefill_view("r0"), prefill_view("r1")]
    first_turn_on_r0(policy, views, answer=0)                       # still running
    late = request("a0", SYSTEM, conversation="c7")                 # an earlier turn finishing late
    policy.on_finished(late, "r0", 0.5, output_tokens=400)
    follow_up = policy.choose(SECOND, views, 1.0)
    assert follow_up is not None and follow_up.predicted_cached_tokens == 6 * BS


def test_a_resent_shorter_prompt_is_credited_with_at_most_itself_but_its_last_token():
    held = Home("r0", 0, "a1", held_tokens=63)                      # a 24-token prompt and a 40-token answer
    assert held.cached_blocks(74, BS) == 63 // BS                   # the next turn: all it holds
    assert held.cached_blocks(24, BS) == (24 - 1) // BS             # turn 1 resent (regenerate): 5, not 15
    assert held.cached_blocks(1, BS) == 0


def test_a_restarted_home_gets_no_credit_for_what_it_held():
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100))
    views = [prefill_view("r0"), prefill_view("r1", kv_used=10)]
    first_turn_on_r0(policy, views, answer=40)
    policy.on_replica_restarted("r0")                               # cache, index entries and home gone
    # r0 now holds nothing, r1 nothing of this conversation: 19 blocks to prefill on either, and r1's
    # 10 blocks of decode send it to r0 by load, expecting nothing cached (not the 15 blocks it held).
    decision = policy.choose(SECOND, views, 1.0)
    assert decision is not None
    assert (decision.replica, decision.outcome) == ("r0", OUTCOME_FALLBACK)
    assert decision.predicted_cached_tokens == 0


def test_the_home_holding_prompt_and_answer_outweighs_decode_load_elsewhere():
    # The index learns prompts; the replica also caches each answer. Turn 2 (19 blocks) extends turn 1's
    # 6 recorded blocks by 13 the index has not seen, 9 of them (the answer) cached on the home.
    policy = PrefixAware(replace(EXACT, imbalance_bound=10.0, imbalance_slack=100))
    first_turn_on_r0(policy, [prefill_view("r0"), prefill_view("r1")], answer=40)
    views = [prefill_view("r0", kv_used=900), prefill_view("r1")]
    # Home: 64 x (19 - 15) + 900 decode = 1,156 against r1's 64 x 19 = 1,216.
    follow_up = policy.choose(SECOND, views, 2.0)
    assert follow_up is not None and (follow_up.replica, follow_up.outcome) == ("r0", OUTCOME_AFFINITY_HIT)
    assert follow_up.predicted_cached_tokens == 15 * BS
    # The same prompt from no known conversation: r0 by the index alone, 64 x 13 + 900 = 1,732.
    anonymous = policy.choose(request("x2", SECOND.token_ids), views, 2.0)
    assert anonymous is not None and anonymous.replica == "r1"


# -- prefix_aware: the imbalance bound -----------------------------------------------------------


@pytest.mark.parametrize("options", [replace(EXACT, imbalance_bound=0.1, imbalance_slack=2), PolicyOptions()],
                         ids=["bound 0.1 + 2", "defaults"])
def test_the_bound_holds_under_a_skewed_workload(options: PolicyOptions):
    """Nine in ten requests continue one hot conversation; runs finish at random.

    Every decision picks a replica whose load is within the bound of the mean load."""
    policy = PrefixAware(options)
    bound, slack = options.imbalance_bound, options.imbalance_slack
    names = [f"r{i}" for i in range(8)]
    running: dict[str, list[RouteRequest]] = {name: [] for name in names}
    rng = random.Random(4)
    hot_turn = 1
    served: dict[str, int] = dict.fromkeys(names, 0)
    outcomes: dict[str, int] = {}
    for n in range(3000):
        if rng.random() < 0.9:
            hot_turn += 1
            req = request(f"q{n}", turn(0, hot_turn % 200 + 1), conversation="hot")
        else:
            req = request(f"q{n}", turn(n, 2), conversation=f"c{n}")
        views = [view(name) for name in names]                      # stale scrape: only own counts
        decision = policy.choose(req, views, float(n))
        assert decision is not None
        loads = {name: policy.in_flight(name) for name in names}
        assert loads[decision.replica] <= load_limit(statistics.fmean(loads.values()), bound, slack)
        policy.on_routed(req, decision, float(n))
        running[decision.replica].append(req)
        served[decision.replica] += 1
        outcomes[decision.outcome] = outcomes.get(decision.outcome, 0) + 1
        for name in names:                                          # each run finishes w.p. 1/50 per tick
            for done in [r for r in running[name] if rng.random() < 0.02]:
                running[name].remove(done)
                policy.on_finished(done, name, float(n))
    # The hot conversation could not keep its home: the bound pushed its turns around the fleet.
    # One arrival per tick, each run ending w.p. 1/50 per tick: ~50 runs in flight, 50 / 8 per
    # replica on average, so no replica holds more than (50 / 8 * (1 + bound) + slack) of the 50,
    # and serves no more than that share of the requests (10% over for the draw's fluctuation).
    in_flight = 50
    most = (in_flight / len(names) * (1 + bound) + slack) / in_flight
    assert max(served.values()) <= 3000 * most * 1.1
    assert min(served.values()) > 0
    assert outcomes[OUTCOME_BALANCED_AWAY] > 0                      # and it was moved by the bound


def test_the_bound_uses_the_larger_of_scraped_and_own_counts():
    policy = PrefixAware(PolicyOptions(imbalance_bound=0.0, imbalance_slack=0))
    views = [view("r0", running=5), view("r1", running=0)]
    # r1 looks idle in the scrape, but this router just sent it 6 runs.
    for n in range(6):
        policy.on_routed(request(f"x{n}", [n]), RouteDecision("r1", "fallback"), 0.0)
    decision = policy.choose(request("a", turn(1, 1)), views, 1.0)
    assert decision is not None and decision.replica == "r0"


# -- prefix_aware: restarts ----------------------------------------------------------------------


def test_a_restarted_replica_loses_its_prefixes_and_its_conversations():
    policy = PrefixAware(EXACT)
    views = [view("r0"), view("r1")]
    first = route(policy, request("t1", turn(7, 5), conversation="c7"), views)
    assert policy.index.entries(first.replica) > 0
    policy.on_replica_restarted(first.replica)
    assert policy.index.entries(first.replica) == 0
    assert policy.in_flight(first.replica) == 0
    other = "r1" if first.replica == "r0" else "r0"
    # After the restart the old home is no better than any other: load decides.
    decision = policy.choose(request("t2", turn(7, 6), conversation="c7"),
                             [view(first.replica, running=1), view(other)], 2.0)
    assert decision is not None
    assert (decision.replica, decision.outcome) == (other, OUTCOME_FALLBACK)
    assert decision.predicted_cached_tokens == 0


def test_a_restart_seen_in_a_scrape_drops_the_replica_from_the_index():
    policy = PrefixAware(EXACT)
    loads = LoadTracker()
    loads.on_scrape("r0", LoadSnapshot(start_time=100.0))
    route(policy, request("t1", turn(7, 5), conversation="c7"), [view("r0")])
    assert policy.index.entries("r0") > 0
    if loads.on_scrape("r0", LoadSnapshot(start_time=160.0)):     # what the host does on each scrape
        policy.on_replica_restarted("r0")
    assert policy.index.entries("r0") == 0


# -- long-context pool ---------------------------------------------------------------------------


def test_long_prompts_go_to_the_long_context_pool_and_short_ones_stay_off_it():
    views = [view("g0"), view("g1"), view("long0", long_context=True)]
    for policy in (PrefixAware(PolicyOptions(long_context_threshold_tokens=64)),
                   LeastLoaded(PolicyOptions(long_context_threshold_tokens=64))):
        long_decision = policy.choose(request("l", range(65)), views, 0.0)
        short_decision = policy.choose(request("s", range(64)), views, 0.0)
        assert long_decision is not None and long_decision.replica == "long0"
        assert short_decision is not None and short_decision.replica in ("g0", "g1")


def test_without_a_long_context_pool_long_prompts_use_the_general_pool():
    policy = PrefixAware(PolicyOptions(long_context_threshold_tokens=64))
    decision = policy.choose(request("l", range(100)), [view("g0")], 0.0)
    assert decision is not None and decision.replica == "g0"


def test_no_candidates_means_no_decision():
    assert PrefixAware(EXACT).choose(request("a", range(8)), [], 0.0) is None
    assert LeastLoaded().choose(request("a", range(8)), [], 0.0) is None


# -- oracle --------------------------------------------------------------------------------------


def test_the_oracle_uses_the_probed_exact_cache_instead_of_the_index():
    cached = {"r0": 0, "r1": 40}
    policy = make_policy("oracle", cached_tokens=lambda replica, tokens: cached[replica])
    decision = policy.choose(request("a", range(48)), [view("r0"), view("r1")], 0.0)
    assert decision is not None
    assert (decision.replica, decision.outcome) == ("r1", OUTCOME_AFFINITY_HIT)
    assert decision.predicted_cached_tokens == 40
    assert policy.name == "oracle"


# -- factory -------------------------------------------------------------------------------------


def test_make_policy_builds_each_known_policy():
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("prefix_aware"), PrefixAware)
    assert make_policy("prefix_aware").name == "prefix_aware"


def test_make_policy_applies_options_with_their_field_types():
    policy = make_policy("prefix_aware", imbalance_bound=0.25, imbalance_slack=4.0)
    assert isinstance(policy, PrefixAware)
    assert policy.options == PolicyOptions(imbalance_bound=0.25, imbalance_slack=4)
    assert isinstance(policy.options.imbalance_slack, int)


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError) as unknown_name:
        make_policy("random")
    assert str(unknown_name.value) == UNKNOWN_POLICY.format(name="random")
    with pytest.raises(ValueError) as unknown_option:
        make_policy("prefix_aware", temperature=0.5)
    assert str(unknown_option.value).startswith(UNKNOWN_OPTION.format(option="temperature", known="")[:-1])
    with pytest.raises(ValueError, match=ORACLE_NEEDS_PROBE):
        make_policy("oracle")
    with pytest.raises(ValueError) as fractional:
        make_policy("prefix_aware", imbalance_slack=2.5)
    assert str(fractional.value) == NOT_WHOLE.format(option="imbalance_slack", value=2.5)


def test_the_config_section_names_the_policy_and_its_options():
    policy = make_policy_from_config({"policy": "prefix_aware", "policy_options": {
        "imbalance_bound": 0.2, "long_context_threshold_tokens": 32768}})
    assert isinstance(policy, PrefixAware)
    assert policy.options == PolicyOptions(imbalance_bound=0.2, long_context_threshold_tokens=32768)
    assert isinstance(make_policy_from_config({"policy": "round_robin"}), RoundRobin)
    with pytest.raises(ValueError) as bad:
        make_policy_from_config({"policy": "prefix_aware", "policy_options": {"imbalance_bound": "high"}})
    assert str(bad.value) == BAD_POLICY_OPTIONS.format(value={"imbalance_bound": "high"})


def test_explain_answers_without_changing_the_next_decision():
    views = [view("r0"), view("r1"), view("r2")]
    rotation = make_policy("round_robin")
    answers = [explain(rotation, request("x", range(8)), views, 0.0) for _ in range(3)]
    assert answers == [RouteDecision("r0", "round_robin")] * 3
    policy = PrefixAware(EXACT)
    first = route(policy, request("t1", turn(7, 3), conversation="c7"), views)
    follow_up = request("t2", turn(7, 4), conversation="c7")
    asked = explain(policy, follow_up, views, 2.0)
    assert asked is not None and asked.replica == first.replica
    assert asked == policy.choose(follow_up, views, 2.0)
    assert policy.in_flight(first.replica) == 1


def test_a_reused_request_id_with_another_prompt_is_hashed_afresh():
    policy = PrefixAware(EXACT)
    views = [view("r0"), view("r1")]
    route(policy, request("t1", turn(7, 4)), [view("r0"), view("r1", running=50)])
    asked = policy.choose(request("same-id", turn(7, 4)), views, 2.0)      # whole chain now hashed
    assert asked is not None and (asked.replica, asked.predicted_cached_tokens) == ("r0", 44)
    other = policy.choose(request("same-id", turn(9, 4)), views, 2.0)      # same length, another chat
    assert other is not None and other.predicted_cached_tokens == len(SYSTEM)


# -- a slow replica: load weighted by step time ----------------------------------------------------


def test_least_loaded_counts_a_replica_twice_as_slow_as_twice_as_loaded():
    slow = replace(view("slow", running=3), step_time_s=0.020)
    fast = replace(view("fast", running=5), step_time_s=0.010)
    # 3 requests stepping at 20 ms hold 6 fast-step equivalents; 5 at 10 ms hold 5: the fast one wins
    assert route(LeastLoaded(), request("q", range(8)), [slow, fast]).replica == "fast"
    unknown = [view("slow", running=3), view("fast", running=5)]                   # no step times
    assert route(LeastLoaded(), request("q", range(8)), unknown).replica == "slow"


def test_prefix_aware_bounds_a_slow_replica_by_its_weighted_load():
    prompt = list(range(64))
    for step_times, expected in (((0.010, 0.010), "slow"), ((0.020, 0.010), "fast")):
        policy = PrefixAware(EXACT)
        route(policy, request("warm", prompt), [view("slow"), view("fast", running=100)])
        # 'slow' holds the prompt with 20 running; 'fast' is idle. At an equal step time the loads
        # are 20 and 0, the bound (20 + 0) / 2 * 1.5 + 8 = 23 and 20 passes; at twice the time they
        # are 40 and 0, the bound 20 * 1.5 + 8 = 38 and 40 does not.
        views = [replace(view("slow", running=20), step_time_s=step_times[0]),
                 replace(view("fast"), step_time_s=step_times[1])]
        assert route(policy, request("q", prompt + [7]), views, now=2.0).replica == expected


# -- round_robin ---------------------------------------------------------------------------------


def rotate(policy: RoundRobin, views: Sequence[ReplicaView], times: int) -> list[str]:
    picks = []
    for n in range(times):
        decision = policy.choose(request(f"q{n}", range(8)), views, float(n))
        assert decision is not None
        picks.append(decision.replica)
    return picks


def test_round_robin_takes_replicas_of_equal_speed_strictly_in_turn_by_name():
    views = [view("r2"), view("r0"), view("r1")]
    assert rotate(RoundRobin(), views, 7) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_round_robin_gives_a_slower_replica_its_share_by_speed_never_its_count():
    # Seed 000's slow replica: one GPU throttled to 60% steps 1 / 0.6 times as long. Four replicas
    # then hold 3 + 0.6 = 3.6 fast-replica units of capacity, of which the slow one is 0.6 / 3.6 = 1/6:
    # over 36 decisions, 6 turns (plain rotation gave it 9, a quarter).
    views = [replace(view(f"r{i}"), step_time_s=0.030) for i in range(3)] + \
        [replace(view("slow"), step_time_s=0.030 / 0.6)]
    picks = rotate(RoundRobin(), views, 36)
    assert picks.count("slow") == round(36 * 0.6 / 3.6) == 6
    assert all(picks.count(f"r{i}") == 10 for i in range(3))
    # Spread out, not bunched: never two turns of the slow replica within any 4 decisions in a row.
    slow_turns = [n for n, name in enumerate(picks) if name == "slow"]
    assert min(b - a for a, b in zip(slow_turns, slow_turns[1:], strict=False)) >= 4
