"""API keys and scopes through the Admin API, on real PostgreSQL: a revoke holds on another gateway
process from its next Submit, rotation overlaps, expiry, and every scope stays in its lane."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import ApiKey, AuditEntry, Run
from sluice.services import errors
from sluice.services.finance import CROSS_TENANT_USAGE
from sqlalchemy import select

from sluice.config.settings import env_overrides
from sluice.v1 import admin_pb2, admin_pb2_grpc, admission_pb2_grpc, routing_pb2, usage_pb2
from tests.support import REPO_ROOT
from tests.support.admin_services import Gateway
from tests.support.ledger_services import key_metadata

pytestmark = pytest.mark.integration

GATEWAY_READY = "gateway (admission, runs, usage) listening"
OVERLAP_S = 3  # long enough for two submits on a busy machine, short enough to wait out


async def sleep_past(instant: dt.datetime) -> None:
    await asyncio.sleep(max(0.0, (instant - dt.datetime.now(dt.UTC)).total_seconds()) + 0.2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def second_gateway(database_dsn: str, tmp_path: Path) -> Iterator[str]:
    """Another gateway PROCESS (`python -m sluice.services.main --role gateway`) on the same ledger."""
    address = f"127.0.0.1:{free_port()}"
    # No HTTP edge: its fixed port may be taken by another gateway on this machine.
    env = {**os.environ, **env_overrides("database", {"dsn": database_dsn}),
           **env_overrides("http", {"enabled": False}), "PYTHONPATH": str(REPO_ROOT)}
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.services.main", "--role", "gateway", "--listen", address],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        started = time.monotonic()
        while GATEWAY_READY not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() - started < 60, log_path.read_text(errors="replace")
            time.sleep(0.05)
        yield address
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def rpc_error(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_a_revoked_key_is_refused_by_the_next_submit_on_another_gateway_process(
    gateway: Gateway, second_gateway: str
):
    await gateway.model("m-v1", alias="chat")
    key = await gateway.tenant("acme")
    async with grpc.aio.insecure_channel(second_gateway) as channel:
        other = admission_pb2_grpc.AdmissionStub(channel)
        assert (await gateway.submit(key, "alpha", 4)).model_version == "m-v1"
        assert (await gateway.submit(key, "alpha", 4, stub=other)).model_version == "m-v1"
        keys = await gateway.admin.ListApiKeys(
            admin_pb2.ListApiKeysRequest(tenant="acme"), metadata=gateway.as_admin
        )
        (listed,) = keys.keys
        assert key.startswith(listed.prefix + "_") and listed.scope == "tenant"

        revoked = await gateway.admin.RevokeApiKey(
            admin_pb2.RevokeApiKeyRequest(id=listed.prefix), metadata=gateway.as_admin
        )
        assert revoked.revoked_at != ""

        error = await rpc_error(gateway.submit(key, "alpha", 4, stub=other))
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, errors.UNKNOWN_API_KEY)


async def test_rotation_keeps_the_old_key_for_the_overlap_then_only_the_new_one(gateway: Gateway):
    await gateway.model("m-v1", alias="chat")
    old = await gateway.tenant("acme")
    (listed,) = (
        await gateway.admin.ListApiKeys(
            admin_pb2.ListApiKeysRequest(tenant="acme"), metadata=gateway.as_admin
        )
    ).keys

    rotated = await gateway.admin.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(id=listed.id, overlap_s=OVERLAP_S), metadata=gateway.as_admin
    )

    assert rotated.secret != old and rotated.key.rotated_from == listed.id
    assert (rotated.key.tenant, rotated.key.scope, rotated.replaced.prefix) == (
        "acme",
        "tenant",
        listed.prefix,
    )
    expires_at = dt.datetime.fromisoformat(rotated.replaced.expires_at)
    assert 0 < (expires_at - dt.datetime.now(dt.UTC)).total_seconds() <= OVERLAP_S
    await gateway.submit(old, "alpha", 4)  # within the overlap: both work
    await gateway.submit(rotated.secret, "alpha", 4)
    await sleep_past(expires_at)
    error = await rpc_error(gateway.submit(old, "alpha", 4))
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, errors.UNKNOWN_API_KEY)
    await gateway.submit(rotated.secret, "alpha", 4)


async def test_a_key_created_with_an_expiry_is_refused_after_it(gateway: Gateway):
    await gateway.model("m-v1", alias="chat")
    await gateway.tenant("acme")
    created = await gateway.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant="acme", expires_in_s=OVERLAP_S), metadata=gateway.as_admin
    )
    await gateway.submit(created.secret, "alpha", 4)
    await sleep_past(dt.datetime.fromisoformat(created.key.expires_at))
    error = await rpc_error(gateway.submit(created.secret, "alpha", 4))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_only_the_hash_and_salt_of_a_key_are_stored(gateway: Gateway):
    secret = await gateway.key(scope="finance")
    async with gateway.sessionmaker() as session:
        rows = (
            await session.execute(select(AuditEntry.after).where(AuditEntry.action == "api_key.create"))
        ).all()
        stored = (
            await session.execute(
                select(ApiKey.key_hash, ApiKey.key_salt, ApiKey.key_prefix).where(ApiKey.scope == "finance")
            )
        ).one()
    assert secret not in str(rows) and secret not in str(stored)
    assert secret.startswith(stored.key_prefix + "_") and len(stored.key_salt) == 32


def admin_rpcs() -> list[tuple[str, object]]:
    """Every Admin RPC with an empty request of its type."""
    service = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
    rpcs = []
    for method in service.methods:
        module = admin_pb2 if method.input_type.file.name == "sluice/v1/admin.proto" else routing_pb2
        rpcs.append((method.name, getattr(module, method.input_type.name)()))
    return rpcs


@pytest.mark.parametrize("scope", ["tenant", "finance"])
async def test_a_tenant_or_finance_key_is_denied_every_admin_rpc_and_changes_nothing(gateway: Gateway, scope):
    await gateway.tenant("acme")
    key = await gateway.key(tenant="acme") if scope == "tenant" else await gateway.key(scope="finance")
    async with gateway.sessionmaker() as session:
        audit_rows = len((await session.scalars(select(AuditEntry.id))).all())
    needed = errors.KEY_SCOPE_NOT_ALLOWED.format(scope=scope, what="the Admin API", needed="'admin'")
    rpcs = admin_rpcs()
    assert len(rpcs) == 26   # 19 + SetFallbacks, GetFallbacks and five canary RPCs (issue 14)

    for name, request in rpcs:
        error = await rpc_error(getattr(gateway.admin, name)(request, metadata=key_metadata(key)))
        assert (name, error.code(), error.details()) == (name, grpc.StatusCode.PERMISSION_DENIED, needed)

    async with gateway.sessionmaker() as session:
        assert len((await session.scalars(select(AuditEntry.id))).all()) == audit_rows


async def test_a_tenant_key_reads_only_its_own_usage_and_cannot_reconcile(gateway: Gateway):
    key = await gateway.tenant("acme")
    await gateway.tenant("globex")
    window = {"to": "2026-12-31", "group_by": ["tenant"]}
    request = usage_pb2.QueryUsageRequest(tenant="globex", **window)
    setattr(request, "from", "2026-01-01")

    error = await rpc_error(gateway.usage.QueryUsage(request, metadata=key_metadata(key)))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.PERMISSION_DENIED,
        CROSS_TENANT_USAGE.format(asked="globex"),
    )
    error = await rpc_error(gateway.usage.Reconcile(usage_pb2.ReconcileRequest(), metadata=key_metadata(key)))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    request.tenant = ""
    own = await gateway.usage.QueryUsage(request, metadata=key_metadata(key))  # its own tenant: allowed
    assert list(own.groups) == []


async def test_finance_and_admin_keys_cannot_submit(gateway: Gateway):
    await gateway.model("m-v1", alias="chat")
    finance = await gateway.key(scope="finance")
    for key, scope in ((finance, "finance"), (gateway.admin_key, "admin")):
        error = await rpc_error(gateway.submit(key, "alpha", 4))
        assert (error.code(), error.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            errors.KEY_SCOPE_NOT_ALLOWED.format(scope=scope, what="this tenant API", needed="'tenant'"),
        )


async def test_a_suspended_tenant_submits_nothing_while_its_accepted_run_stays(gateway: Gateway):
    await gateway.model("m-v1", alias="chat")
    key = await gateway.tenant("acme")
    accepted = await gateway.submit(key, "alpha", 4)

    suspended = await gateway.admin.SuspendTenant(
        admin_pb2.SuspendTenantRequest(name="acme"), metadata=gateway.as_admin
    )
    assert suspended.suspended
    error = await rpc_error(gateway.submit(key, "alpha", 4))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.PERMISSION_DENIED,
        errors.TENANT_SUSPENDED.format(tenant="acme"),
    )
    async with gateway.sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(accepted.run_id))
    assert run is not None and run.status == "ACCEPTED"  # untouched: a routing worker may still run it

    await gateway.admin.SuspendTenant(
        admin_pb2.SuspendTenantRequest(name="acme", resume=True), metadata=gateway.as_admin
    )
    await gateway.submit(key, "alpha", 4)


def test_admin_stub_names_match_the_servicer():
    assert {name for name, _ in admin_rpcs()} <= set(dir(admin_pb2_grpc.AdminServicer))
