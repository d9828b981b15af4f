"""The replica registry: config tables, pools, run-time edits, views joined with health and load."""

from __future__ import annotations

import pytest

from sluice.config import load_settings
from sluice.router.health import HealthBook
from sluice.router.load import LoadSnapshot, LoadTracker
from sluice.router.policy import ReplicaView
from sluice.router.registry import (
    BAD_STATE,
    BAD_VALUE,
    DRAINING,
    DUPLICATE_NAME,
    MISSING_KEY,
    SERVING,
    WARM,
    RegistryError,
    ReplicaRegistry,
    ReplicaSpec,
)


def test_the_shipped_config_yields_the_development_replicas():
    registry = ReplicaRegistry.from_config({"replicas": load_settings(environ={}).replica_tables()})
    assert [spec.name for spec in registry.specs()] == ["r0", "r1"]
    # The development replicas serve the real SmolLM2 (their entries' `replica` table picks the model
    # executor; the registry ignores it).
    assert registry.get("r0") == ReplicaSpec(name="r0", pool="smollm2-135m-instruct",
                                             grpc_address="127.0.0.1:18001",
                                             metrics_url="http://127.0.0.1:18002/metrics")


def test_a_table_sets_every_field():
    spec = ReplicaSpec.from_table({"name": "big", "pool": "llama-70b", "grpc_address": "10.0.0.9:8001",
                                   "metrics_url": "http://10.0.0.9:8002/metrics", "block_size": 32,
                                   "kv_capacity_blocks": 50_000, "long_context": True})
    assert spec == ReplicaSpec("big", "llama-70b", "10.0.0.9:8001", "http://10.0.0.9:8002/metrics",
                               32, 50_000, True)


def test_malformed_tables_are_rejected_with_what_to_fix():
    with pytest.raises(RegistryError, match=MISSING_KEY.format(index=3, key="grpc_address")):
        ReplicaSpec.from_table({"name": "x"}, index=3)
    with pytest.raises(RegistryError) as bad:
        ReplicaSpec.from_table({"name": "x", "grpc_address": "h:1", "block_size": 0})
    assert str(bad.value) == BAD_VALUE.format(name="x", key="block_size", value=0)
    with pytest.raises(RegistryError, match=DUPLICATE_NAME.format(name="x")):
        ReplicaRegistry([ReplicaSpec("x", "m", "h:1"), ReplicaSpec("x", "m", "h:2")])


def test_pools_group_replicas_by_model_version_and_shared_replicas_serve_every_pool():
    registry = ReplicaRegistry([ReplicaSpec("a", "m1", "h:1"), ReplicaSpec("b", "m2", "h:2"),
                                ReplicaSpec("any", "", "h:3")])
    assert registry.pools() == {"m1": ["a"], "m2": ["b"], "": ["any"]}
    assert [spec.name for spec in registry.members("m1")] == ["a", "any"]


def test_only_serving_replicas_take_new_runs_warm_and_draining_ones_stay_registered():
    registry = ReplicaRegistry([ReplicaSpec("a", "m", "h:1"), ReplicaSpec("w", "m", "h:2", state=WARM),
                                ReplicaSpec("d", "m", "h:3", state=DRAINING)])
    assert [view.name for view in registry.views("m", 0.0)] == ["a"]
    assert [spec.name for spec in registry.members("m")] == ["a", "d", "w"]     # health-checked, scraped
    registry.upsert(ReplicaSpec("w", "m", "h:2", state=SERVING))               # promoted
    assert [view.name for view in registry.views("m", 0.0)] == ["a", "w"]
    assert ReplicaSpec.from_table({"name": "x", "grpc_address": "h:1", "state": "warm"}).state == WARM
    with pytest.raises(RegistryError) as bad:
        ReplicaSpec.from_table({"name": "x", "grpc_address": "h:1", "state": "idle"})
    assert str(bad.value) == BAD_STATE.format(name="x", states="serving, warm, draining", value="idle")


def test_replicas_can_be_added_replaced_and_removed_at_run_time():
    registry = ReplicaRegistry([ReplicaSpec("a", "m", "h:1")])
    assert registry.upsert(ReplicaSpec("b", "m", "h:2")) is None
    assert registry.upsert(ReplicaSpec("a", "m", "h:9")) == ReplicaSpec("a", "m", "h:1")
    assert registry.remove("b") == ReplicaSpec("b", "m", "h:2")
    assert registry.remove("b") is None
    assert registry.specs() == [ReplicaSpec("a", "m", "h:9")]


def test_views_skip_unhealthy_replicas_and_carry_scraped_load():
    registry = ReplicaRegistry([ReplicaSpec("a", "m", "h:1", block_size=16, kv_capacity_blocks=100),
                                ReplicaSpec("b", "m", "h:2")])
    health = HealthBook()
    health.sync(["a", "b"], now=0.0)
    for t in (0.0, 0.1, 0.2):
        health.record_failure("b", t)
    loads = LoadTracker()
    loads.on_scrape("a", LoadSnapshot(active=2, waiting=1, kv_used_blocks=30, kv_max_blocks=400,
                                      kv_tokens_per_block=32, start_time=9.0))
    loads.on_sent("a")
    assert registry.views("m", 1.0, health, loads) == [
        ReplicaView(name="a", pool="m", block_size=32, kv_capacity_blocks=400, waiting=2, running=2,
                    kv_used_blocks=30, in_flight=1, start_time=9.0),
    ]


def test_views_are_reused_between_decisions_but_never_stale():
    registry = ReplicaRegistry([ReplicaSpec("a", "m", "h:1"), ReplicaSpec("b", "m", "h:2")])
    loads = LoadTracker()
    first = registry.views("m", 0.0, None, loads)
    assert registry.views("m", 0.0, None, loads)[0] is first[0]            # unchanged: the same object
    loads.on_sent("a")
    assert [view.in_flight for view in registry.views("m", 0.0, None, loads)] == [1, 0]
    loads.on_scrape("b", LoadSnapshot(active=4, kv_max_blocks=50, kv_tokens_per_block=32))
    assert [view.running for view in registry.views("m", 0.0, None, loads)] == [0, 4]
    registry.upsert(ReplicaSpec("b", "m", "h:2", long_context=True))
    registry.upsert(ReplicaSpec("c", "", "h:3"))
    assert [(view.name, view.long_context) for view in registry.views("m", 0.0, None, loads)] == [
        ("a", False), ("b", True), ("c", False)]
    registry.remove("a")
    assert [view.name for view in registry.views("m", 0.0, None, loads)] == ["b", "c"]
