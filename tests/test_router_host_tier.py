"""The router's prefix index and prefix_aware cost with replicas that have a host-memory KV tier."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sluice.router.policies import PolicyOptions, PrefixAware
from sluice.router.policy import ReplicaView, RouteRequest
from sluice.router.prefix_index import PrefixIndex, block_hashes

BS = 4
EXACT = PolicyOptions(index_unit_tokens=BS)          # one index entry per KV block
P = list(range(100, 116))                            # 4 blocks
Q = list(range(200, 216))                            # 4 other blocks


# -- the index ----------------------------------------------------------------------------------


def test_entries_pushed_off_the_gpu_side_move_to_the_host_side_and_leave_it_least_recent_first() -> None:
    index = PrefixIndex()
    a, b, c = (block_hashes(range(start, start + 2 * BS), BS) for start in (0, 100, 200))
    index.set_capacity("r0", 2, now=0.0, host_capacity_blocks=2)
    index.record("r0", a, now=1.0)
    index.record("r0", b, now=2.0)                   # a no longer fits the GPU side: it goes to host
    tiers = index.overlap_tiers(a, ["r0"])
    assert (tiers.gpu, tiers.either) == ({"r0": 0}, {"r0": 2})
    index.record("r0", c, now=3.0)                   # b to host; the host side holds 2: a leaves
    assert index.overlap_tiers(a, ["r0"]).either == {"r0": 0}
    assert index.overlap_tiers(b, ["r0"]).either == {"r0": 2}
    index.record("r0", b, now=4.0)                   # sent again: back on the GPU
    tiers = index.overlap_tiers(b, ["r0"])
    assert (tiers.gpu, tiers.either) == ({"r0": 2}, {"r0": 2})
    assert (index.entries("r0"), index.host_entries("r0")) == (2, 2)     # b on GPU; c in host


def test_without_a_host_tier_an_evicted_entry_is_gone() -> None:
    index = PrefixIndex()
    a, b = (block_hashes(range(start, start + 2 * BS), BS) for start in (0, 100))
    index.set_capacity("r0", 2, now=0.0)
    index.record("r0", a, now=1.0)
    index.record("r0", b, now=2.0)
    assert index.overlap_tiers(a, ["r0"]).either == {"r0": 0}
    assert not index.has_host_entries()


def test_a_restart_forgets_the_host_side_too() -> None:
    index = PrefixIndex()
    a, b = (block_hashes(range(start, start + 2 * BS), BS) for start in (0, 100))
    index.set_capacity("r0", 2, now=0.0, host_capacity_blocks=2)
    index.record("r0", a, now=1.0)
    index.record("r0", b, now=2.0)
    index.drop_replica("r0")
    assert not index.has_host_entries() and index.stats().host_entries == 0


# -- prefix_aware ---------------------------------------------------------------------------------


def view(name: str, kv_used: int = 0, capacity: int = 1000) -> ReplicaView:
    # Copying a block back costs half a prefill here: big enough to see in a hand-worked cost.
    return ReplicaView(name=name, pool="m", block_size=BS, kv_capacity_blocks=capacity,
                       kv_used_blocks=kv_used, host_kv_capacity_blocks=100, host_block_cost=0.5)


def send(policy: PrefixAware, request_id: str, tokens: Sequence[int], only: ReplicaView) -> None:
    req = RouteRequest(request_id=request_id, model_version="m", token_ids=list(tokens), max_output_tokens=8)
    decision = policy.choose(req, [only], 0.0)
    assert decision is not None
    policy.on_routed(req, decision, 0.0)
    policy.on_finished(req, decision.replica, 0.0)


def fleet_with_p_on_each_tier() -> PrefixAware:
    """c_gpu holds P on its GPU; b_host held P until Q pushed it to host memory (its GPU side holds 4
    entries); a_none never saw P. Names sort the wrong way round, so the name tie-break cannot help."""
    policy = PrefixAware(EXACT)
    send(policy, "p1", P, view("c_gpu"))
    send(policy, "p2", P, view("b_host", capacity=4))
    send(policy, "q", Q, view("b_host", capacity=4))
    return policy


def choose(policy: PrefixAware, views: list[ReplicaView]) -> tuple[str, int]:
    req = RouteRequest(request_id="next", model_version="m", token_ids=list(P), max_output_tokens=8)
    decision = policy.choose(req, views, 1.0)
    assert decision is not None
    return decision.replica, decision.predicted_cached_tokens


def test_a_gpu_holder_beats_a_host_holder_which_beats_none() -> None:
    # P is 4 blocks, prefill weight 64, nothing decoding anywhere:
    #   c_gpu  64 × 0                     =   0
    #   b_host 64 × (0 + 0.5 × 4 copied)  = 128
    #   a_none 64 × 4                     = 256
    policy = fleet_with_p_on_each_tier()
    gpu, host, none = view("c_gpu"), view("b_host", capacity=4), view("a_none")
    assert choose(policy, [none, host, gpu])[0] == "c_gpu"
    # From the host tier too, the prompt's whole blocks but the last (always computed) are not prefilled.
    assert choose(policy, [none, host]) == ("b_host", 3 * BS)
    assert choose(policy, [none])[0] == "a_none"


def test_a_host_hit_is_worth_its_copy_cost_against_load_and_no_more() -> None:
    # b_host's cost is 128 + the KV it decodes; a_none's is 256. 100 blocks decoding: 228, still
    # cheaper; 200: 328, now dearer than prefilling on the idle a_none.
    policy = fleet_with_p_on_each_tier()
    assert choose(policy, [view("a_none"), view("b_host", kv_used=100, capacity=4)])[0] == "b_host"
    assert choose(policy, [view("a_none"), view("b_host", kv_used=200, capacity=4)])[0] == "a_none"


# -- what a replica reports, as the router reads it ---------------------------------------------


def test_the_router_reads_a_replicas_host_tier_from_its_metrics() -> None:
    from prometheus_client import generate_latest

    from sluice.replica.engine_core_adapter import CoreEngine, CoreSettings
    from sluice.replica.metrics import ReplicaMetrics
    from sluice.router.load import LoadTracker, parse_metrics
    from sluice.router.registry import ReplicaRegistry, ReplicaSpec

    settings = CoreSettings(model="llama-3-8b", hardware="h100-sxm", block_size=32, host_kv_blocks=-1)
    engine = CoreEngine(settings)
    metrics = ReplicaMetrics(start_time=1.0)
    metrics.update(engine.stats())
    snapshot = parse_metrics(generate_latest(metrics.registry).decode())
    # Llama-3-8B bf16: 131,072 bytes of KV a token. Host: 256 GB per H100, half pinned for KV.
    assert snapshot.host_max_blocks == int(256e9 * 0.5 // 131_072) // 32
    # A block back over PCIe Gen5 (51.2 GB/s achieved) against its prefill on one H100 in bf16
    # (989 TFLOP/s × 0.5 over 2 × 8.03e9 FLOPs a token, no all-reduce at TP 1).
    prefill_tokens_per_s = 989e12 * 0.5 / (2 * 8.03e9)
    assert snapshot.host_block_cost == pytest.approx(131_072 / 51.2e9 * prefill_tokens_per_s, rel=1e-6)

    tracker = LoadTracker()
    tracker.on_scrape("r0", snapshot)
    registry = ReplicaRegistry([ReplicaSpec(name="r0", pool="m", grpc_address="127.0.0.1:1")])
    (seen,) = registry.views("m", now=0.0, loads=tracker)
    assert (seen.host_kv_capacity_blocks, seen.host_block_cost) == (snapshot.host_max_blocks,
                                                                   snapshot.host_block_cost)
