"""The peer policies (SGLang cache_aware, llm-d, Dynamo) decide as their published rules say."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sluice.router.peers import (
    NEEDS_PROBE,
    OUTCOME_CACHE_MATCH,
    OUTCOME_SHORTEST_QUEUE,
    OUTCOME_SMALLEST_TREE,
    UNKNOWN_PEER,
    DynamoKv,
    Llmd,
    SglangCacheAware,
    SglangOptions,
    make_peer_policy,
)
from sluice.router.policy import ReplicaView, RouteDecision, RouteRequest, RoutingPolicy

BLOCK = 16


def view(name: str, waiting: int = 0, kv_used: int = 0, capacity: int = 1000) -> ReplicaView:
    return ReplicaView(name=name, pool="m", block_size=BLOCK, kv_capacity_blocks=capacity,
                       waiting=waiting, kv_used_blocks=kv_used)


def request(request_id: str, tokens: Sequence[int]) -> RouteRequest:
    return RouteRequest(request_id=request_id, model_version="m", token_ids=tuple(tokens),
                        max_output_tokens=8)


def route(policy: RoutingPolicy, req: RouteRequest, views: Sequence[ReplicaView]) -> RouteDecision:
    decision = policy.choose(req, views, 1.0)
    assert decision is not None
    policy.on_routed(req, decision, 1.0)
    return decision


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


# -- SGLang cache_aware ---------------------------------------------------------------------------


def test_sglang_follows_a_prefix_matching_more_than_the_threshold_of_the_prompt() -> None:
    policy = SglangCacheAware()
    views = [view("a"), view("b")]
    shared = tokens(0, 64)                                            # 4 blocks
    first = route(policy, request("q1", shared + tokens(1000, 32)), views)
    # 64 of 100 tokens match the first worker's tree: 0.64 > 0.3
    second = route(policy, request("q2", shared + tokens(2000, 36)), views)
    assert second.replica == first.replica
    assert second.outcome == OUTCOME_CACHE_MATCH
    assert second.predicted_cached_tokens == 64


def test_sglang_sends_a_weak_match_to_the_smallest_tree() -> None:
    policy = SglangCacheAware()
    views = [view("a"), view("b")]
    route(policy, request("q1", tokens(0, 160)), views)     # 'a' (both empty: name order) grows 10 blocks
    # 16 of 100 tokens match 'a' (0.16 <= 0.3): the smaller tree, 'b', gets it
    decision = route(policy, request("q2", tokens(0, 16) + tokens(5000, 84)), views)
    assert decision.replica == "b"
    assert decision.outcome == OUTCOME_SMALLEST_TREE
    assert policy.tree_size("a") == 10 and policy.tree_size("b") == 100 // BLOCK


def test_sglang_balances_only_when_both_thresholds_are_passed() -> None:
    options = SglangOptions(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy = SglangCacheAware(options)
    views = [view("a"), view("b")]
    prompt = tokens(0, 64)
    for index in range(5):                                            # 5 in flight on 'a', 0 on 'b'
        assert route(policy, request(f"warm{index}", prompt), views).replica == "a"
    # max - min = 5 > 4 and 5 > 1.5 * 0: imbalanced, the cached worker is passed over
    decision = route(policy, request("q", prompt), views)
    assert (decision.replica, decision.outcome) == ("b", OUTCOME_SHORTEST_QUEUE)
    for index in range(5):
        policy.on_finished(request(f"warm{index}", prompt), "a", 2.0)
    policy.on_finished(request("q", prompt), "b", 2.0)
    # balanced again: cache affinity decides
    assert route(policy, request("q2", prompt), views).outcome == OUTCOME_CACHE_MATCH


def test_sglang_keeps_a_restarted_workers_tree_as_the_gateway_is_never_told() -> None:
    policy = SglangCacheAware()
    views = [view("a"), view("b")]
    route(policy, request("q1", tokens(0, 64)), views)
    policy.on_replica_restarted("a")
    assert policy.tree_size("a") == 4


# -- llm-d -----------------------------------------------------------------------------------------


def learned_holder(policy: Llmd, prompt: Sequence[int]) -> tuple[str, str]:
    """Route `prompt` once on an idle pair (a tie, broken at random); (holder, the other)."""
    holder = route(policy, request("teach", prompt), [view("a"), view("b")]).replica
    return holder, "b" if holder == "a" else "a"


@pytest.mark.parametrize(("holder_kv_used", "winner"), [(900, "other"), (500, "holder")])
def test_llmd_adds_its_weighted_scores(holder_kv_used: int, winner: str) -> None:
    policy = Llmd()
    prompt = tokens(0, 160)                                           # 10 blocks
    holder, other = learned_holder(policy, prompt)
    # holder: all 10 blocks, the longest queue:  3*1 + 2*0 + 2*(1 - kv)  = 3.2 at 90% KV, 4.0 at 50%
    # other:  no block, the shortest queue, 10% KV: 3*0 + 2*1 + 2*0.9      = 3.8
    views = [view(holder, waiting=6, kv_used=holder_kv_used), view(other, waiting=2, kv_used=100)]
    chosen = route(policy, request("q", prompt), views).replica
    assert chosen == (holder if winner == "holder" else other)


def test_llmd_precise_reads_the_engines_caches_not_its_history() -> None:
    exact = {"a": 0, "b": 160}
    policy = Llmd(cached_tokens=lambda replica, prompt: exact[replica])
    decision = route(policy, request("q", tokens(0, 160)), [view("a"), view("b")])
    assert decision.replica == "b" and decision.predicted_cached_tokens == 160
    assert policy.name == "llmd_precise"


# -- Dynamo ----------------------------------------------------------------------------------------


def test_dynamo_costs_blocks_to_prefill_plus_active_decode_blocks() -> None:
    prompt = tokens(0, 320)                                           # 20 blocks
    exact = {"a": 320, "b": 0}
    policy = DynamoKv(cached_tokens=lambda replica, _: exact[replica])
    # a: (20 - 20) + 30 = 30;  b: (20 - 0) + 5 = 25  -> b
    assert route(policy, request("q1", prompt), [view("a", kv_used=30), view("b", kv_used=5)]).replica == "b"
    # a: 0 + 15 = 15; b: max(kv 5, own in flight 20 blocks) + 20 = 40 -> a
    assert route(policy, request("q2", prompt), [view("a", kv_used=15), view("b", kv_used=5)]).replica == "a"


def test_the_peer_factory_names_what_it_knows_and_what_it_needs() -> None:
    assert make_peer_policy("sglang_cache_aware").name == "sglang_cache_aware"
    assert make_peer_policy("llmd").name == "llmd"
    with pytest.raises(ValueError) as needs:
        make_peer_policy("dynamo_kv")
    assert str(needs.value) == NEEDS_PROBE.format(name="dynamo_kv")
    with pytest.raises(ValueError) as error:
        make_peer_policy("random")
    assert str(error.value) == UNKNOWN_PEER.format(name="random")
