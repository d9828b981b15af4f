"""The durable replica registry: an Admin API change reaches every routing process's registry
(here two RegistrySync instances, each with its own registry and poll loop; in one process they share
its listening connection, services/notify.py),
and a routing process started later begins from it. Config stays the bootstrap underneath."""

from __future__ import annotations

import asyncio
import time

import pytest
from sluice.services.routing.registry_sync import RegistrySync, follow_durable_registry

from sluice.router.registry import ReplicaRegistry, ReplicaSpec
from sluice.v1 import routing_pb2
from tests.support.admin_services import Gateway

pytestmark = pytest.mark.integration

BOOTSTRAP = (ReplicaSpec("r0", "m-v1", "127.0.0.1:18001"), ReplicaSpec("r1", "m-v1", "127.0.0.1:18011"))
SEEN_WITHIN_S = 5.0  # the design asks for a second; the margin is for a loaded test machine


def addresses(registry: ReplicaRegistry) -> dict[str, str]:
    return {spec.name: spec.grpc_address for spec in registry.specs()}


async def until(condition, timeout_s: float = SEEN_WITHIN_S) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "the change did not reach the registry in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_admin_changes_reach_every_routing_process_and_a_new_one_starts_from_them(
    gateway: Gateway, database_dsn: str
):
    registries = [ReplicaRegistry(BOOTSTRAP), ReplicaRegistry(BOOTSTRAP)]
    changes = [0, 0]

    def counter(index: int):  # type: ignore[no-untyped-def]
        def changed() -> None:
            changes[index] += 1

        return changed

    syncs = [
        await follow_durable_registry(registry, gateway.sessionmaker, database_dsn, counter(index))
        for index, registry in enumerate(registries)
    ]
    try:
        assert changes == [0, 0]  # an empty table leaves the bootstrap as it is
        await gateway.admin.UpsertReplica(
            routing_pb2.Replica(name="r9", pool="m-v1", grpc_address="10.0.0.9:1"), metadata=gateway.as_admin
        )
        await until(lambda: all("r9" in addresses(r) for r in registries))
        await gateway.admin.RemoveReplica(
            routing_pb2.RemoveReplicaRequest(name="r0"), metadata=gateway.as_admin
        )
        await gateway.admin.UpsertReplica(
            routing_pb2.Replica(name="r1", pool="m-v1", grpc_address="10.0.0.1:2", block_size=32),
            metadata=gateway.as_admin,
        )
        expected = {"r1": "10.0.0.1:2", "r9": "10.0.0.9:1"}
        await until(lambda: all(addresses(r) == expected for r in registries))
        assert all(r.get("r1").block_size == 32 for r in registries)  # type: ignore[union-attr]
        assert min(changes) >= 2

        listed = await gateway.admin.ListReplicas(
            routing_pb2.ListReplicasRequest(), metadata=gateway.as_admin
        )
        # The gateway's own config bootstraps r0 too; its tombstone removes it there as well.
        assert {r.name: r.grpc_address for r in listed.replicas} == expected
    finally:
        for sync in syncs:
            await sync.close()

    late = ReplicaRegistry(BOOTSTRAP)
    assert await RegistrySync(late, gateway.sessionmaker, None).sync_once()
    assert addresses(late) == expected


async def test_without_a_notification_the_poll_still_brings_the_change(gateway: Gateway):
    registry = ReplicaRegistry(BOOTSTRAP)
    sync = RegistrySync(registry, gateway.sessionmaker, dsn=None, poll_s=0.2)  # no LISTEN at all
    sync.start()
    try:
        await gateway.admin.RemoveReplica(
            routing_pb2.RemoveReplicaRequest(name="r1"), metadata=gateway.as_admin
        )
        await until(lambda: "r1" not in addresses(registry))
    finally:
        await sync.close()


async def test_while_its_listen_is_up_the_sync_does_not_poll(gateway: Gateway, database_dsn: str):
    """The NOTIFY brings every change while LISTEN is up: the table is read once at start, once when
    LISTEN is established, then not again for as long as nothing changes (not every 0.5 s)."""
    sync = await follow_durable_registry(ReplicaRegistry(BOOTSTRAP), gateway.sessionmaker, database_dsn,
                                         lambda: None)
    try:
        listener = sync._listener
        assert listener is not None
        await until(lambda: listener.listening)
        await asyncio.sleep(0.1)             # the read LISTEN's establishment asked for
        reads = sync.reads
        await asyncio.sleep(1.6)             # three polls at the 0.5 s interval
        assert sync.reads == reads
    finally:
        await sync.close()
