"""Models, price cards, budgets and the audit trail through the Admin API, on real PostgreSQL."""

from __future__ import annotations

import json
import uuid

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import AuditEntry, Model, Run, RunStatus, UsageEntry
from sluice.ledger.pricing import cost_micros
from sluice.ledger.settlement import settle_run
from sluice.services import admin as admin_service
from sluice.services import errors
from sqlalchemy import select, update

from sluice.v1 import admin_pb2, routing_pb2
from tests.support.admin_services import Gateway
from tests.support.ledger_factories import MICROS, prompt_of

pytestmark = pytest.mark.integration

V1_PRICES = (500_000, 50_000, 1_500_000)  # $0.50 / $0.05 / $1.50 per million tokens
V2_PRICES = (2_000_000, 200_000, 6_000_000)  # four times dearer


class Card:
    def __init__(self, prices: tuple[int, int, int]) -> None:
        (
            self.price_input_per_m_micros,
            self.price_cached_input_per_m_micros,
            self.price_output_per_m_micros,
        ) = prices


async def rpc_error(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def run_row(gateway: Gateway, run_id: str) -> Run:
    async with gateway.sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(run_id))
    assert run is not None
    return run


async def finish(gateway: Gateway, run_id: str, output_tokens: int) -> UsageEntry:
    """Settle a run as a routing worker would after the replica streamed `output_tokens`."""
    async with gateway.sessionmaker() as session, session.begin():
        await session.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(replica="r0"))
        assert await settle_run(session, run_id, RunStatus.COMPLETED, output_tokens, 0, None)
    async with gateway.sessionmaker() as session:
        entry = await session.scalar(select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))
    assert entry is not None
    return entry


async def test_moving_an_alias_pins_new_runs_to_the_new_version_and_leaves_accepted_runs_on_theirs(
    gateway: Gateway,
):
    await gateway.model("m-v1", alias="chat", prices=V1_PRICES)
    await gateway.model("m-v2", prices=V2_PRICES)
    key = await gateway.tenant("acme")
    before = await gateway.submit(key, prompt_of(100), 50)

    moved = await gateway.admin.MoveAlias(
        admin_pb2.MoveAliasRequest(alias="chat", version="m-v2"), metadata=gateway.as_admin
    )
    after = await gateway.submit(key, prompt_of(100), 50)

    assert moved.alias == "chat"
    assert (before.model_version, after.model_version) == ("m-v1", "m-v2")
    assert (await run_row(gateway, before.run_id)).model_version == "m-v1"  # still pinned, still in flight
    old_entry = await finish(gateway, before.run_id, 40)
    new_entry = await finish(gateway, after.run_id, 40)
    assert old_entry.cost_micros == cost_micros(Card(V1_PRICES), 100, 0, 40)  # 50 + 60 = 110
    assert new_entry.cost_micros == cost_micros(Card(V2_PRICES), 100, 0, 40)  # 200 + 240 = 440
    assert (old_entry.cost_micros, new_entry.cost_micros) == (110, 440)
    models = (await gateway.admin.ListModels(admin_pb2.ListModelsRequest(), metadata=gateway.as_admin)).models
    assert {m.version: m.alias for m in models} == {"m-v1": "", "m-v2": "chat"}


async def test_a_price_change_applies_to_runs_admitted_after_it(gateway: Gateway):
    await gateway.model("m-v1", alias="chat", prices=V1_PRICES)
    key = await gateway.tenant("acme")
    early = await gateway.submit(key, prompt_of(100), 50)

    changed = await gateway.admin.SetPriceCard(
        admin_pb2.SetPriceCardRequest(
            version="m-v1",
            price_input_per_m_micros=V2_PRICES[0],
            price_cached_input_per_m_micros=V2_PRICES[1],
            price_output_per_m_micros=V2_PRICES[2],
        ),
        metadata=gateway.as_admin,
    )
    late = await gateway.submit(key, prompt_of(100), 50)

    early_run, late_run = await run_row(gateway, early.run_id), await run_row(gateway, late.run_id)
    assert late_run.price_card_id == changed.price_card_id != early_run.price_card_id
    # Reserved at the card in force at admission: 100 prompt + 50 cap.
    assert (early_run.reserved_cost_micros, late_run.reserved_cost_micros) == (125, 500)
    assert (await finish(gateway, early.run_id, 40)).cost_micros == 110  # settled at its own card
    assert (await finish(gateway, late.run_id, 40)).cost_micros == 440


async def test_a_retired_version_admits_nothing_and_an_aliased_one_cannot_be_retired(gateway: Gateway):
    await gateway.model("m-v1", alias="chat")
    await gateway.model("m-v2")
    key = await gateway.tenant("acme")

    error = await rpc_error(
        gateway.admin.RetireModel(admin_pb2.RetireModelRequest(version="m-v1"), metadata=gateway.as_admin)
    )
    assert (error.code(), error.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        admin_service.RETIRE_ALIASED.format(version="m-v1", alias="chat"),
    )
    retired = await gateway.admin.RetireModel(
        admin_pb2.RetireModelRequest(version="m-v2"), metadata=gateway.as_admin
    )
    assert retired.retired_at != ""
    error = await rpc_error(gateway.submit(key, "alpha", 4, model="m-v2"))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.NOT_FOUND,
        errors.UNKNOWN_MODEL.format(model="m-v2"),
    )


async def test_a_budget_lowered_below_what_is_reserved_refuses_new_work_and_the_run_in_flight_settles(
    gateway: Gateway,
):
    await gateway.model("m-v1", alias="chat")
    key = await gateway.tenant("acme", token_budget=10_000, cost_budget_micros=MICROS)
    in_flight = await gateway.submit(key, prompt_of(1_000), 1_000)  # reserves 2,000 tokens

    lowered = await gateway.admin.SetBudget(
        admin_pb2.SetBudgetRequest(tenant="acme", token_budget=1_500, cost_budget_micros=MICROS),
        metadata=gateway.as_admin,
    )
    assert (lowered.token_budget, lowered.reserved_tokens) == (1_500, 2_000)

    error = await rpc_error(gateway.submit(key, "alpha", 1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await finish(gateway, in_flight.run_id, 10)  # untouched, settles as usual
    shown = await gateway.admin.GetTenant(admin_pb2.GetTenantRequest(name="acme"), metadata=gateway.as_admin)
    assert (shown.budget.reserved_tokens, shown.budget.used_tokens) == (0, 1_010)
    await gateway.submit(key, "alpha", 1)  # 1,010 + 2 fits 1,500 again


async def test_every_admin_change_writes_one_audit_row_with_who_what_before_and_after(gateway: Gateway):
    admin = gateway.admin
    as_admin = gateway.as_admin
    await gateway.model("m-v1", alias="chat")
    await gateway.model("m-v2")
    await admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name="acme", token_budget=100, cost_budget_micros=10), metadata=as_admin
    )
    created = await admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(tenant="acme"), metadata=as_admin)
    await admin.RotateApiKey(admin_pb2.RotateApiKeyRequest(id=created.key.id), metadata=as_admin)
    await admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(id=created.key.prefix), metadata=as_admin)
    await admin.SetLimits(admin_pb2.SetLimitsRequest(name="acme", tokens_per_minute=500), metadata=as_admin)
    await admin.SetBudget(
        admin_pb2.SetBudgetRequest(tenant="acme", token_budget=200, cost_budget_micros=20), metadata=as_admin
    )
    await admin.SuspendTenant(admin_pb2.SuspendTenantRequest(name="acme"), metadata=as_admin)
    await admin.SuspendTenant(admin_pb2.SuspendTenantRequest(name="acme", resume=True), metadata=as_admin)
    await admin.SetPriceCard(
        admin_pb2.SetPriceCardRequest(version="m-v1", price_output_per_m_micros=7), metadata=as_admin
    )
    await admin.MoveAlias(admin_pb2.MoveAliasRequest(alias="chat", version="m-v2"), metadata=as_admin)
    await admin.RetireModel(admin_pb2.RetireModelRequest(version="m-v1"), metadata=as_admin)
    await admin.UpsertReplica(
        routing_pb2.Replica(name="r9", grpc_address="127.0.0.1:1", pool="m-v2"), metadata=as_admin
    )
    await admin.RemoveReplica(routing_pb2.RemoveReplicaRequest(name="r9"), metadata=as_admin)
    # Reads are not audited.
    await admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=as_admin)

    log = (await admin.ListAudit(admin_pb2.ListAuditRequest(), metadata=as_admin)).entries
    assert [entry.action for entry in reversed(log)] == [
        "model.register",
        "model.register",
        "tenant.create",
        "budget.set",
        "api_key.create",
        "api_key.rotate",
        "api_key.revoke",
        "tenant.set_limits",
        "budget.set",
        "tenant.suspend",
        "tenant.resume",
        "model.set_price_card",
        "model.move_alias",
        "model.retire",
        "replica.upsert",
        "replica.remove",
    ]
    admin_prefix = gateway.admin_key.split("_")[0]
    assert {entry.actor for entry in log} == {admin_prefix}
    by_action = {entry.action: entry for entry in log}
    limits = by_action["tenant.set_limits"]
    assert (
        json.loads(limits.before_json)["tokens_per_minute"],
        json.loads(limits.after_json)["tokens_per_minute"],
    ) == (None, 500)
    revoke = by_action["api_key.revoke"]
    assert (
        json.loads(revoke.before_json)["revoked_at"] is None and json.loads(revoke.after_json)["revoked_at"]
    )
    assert json.loads(by_action["model.move_alias"].before_json) == {"alias": "chat", "version": "m-v1"}
    assert by_action["tenant.create"].before_json == "" and by_action["tenant.create"].target == "acme"
    budget_sets = [entry for entry in log if entry.action == "budget.set"]
    assert [json.loads(entry.after_json)["token_budget"] for entry in reversed(budget_sets)] == [100, 200]
    async with gateway.sessionmaker() as session:
        assert all(row.at is not None for row in await session.scalars(select(AuditEntry)))


async def test_a_registered_chat_template_is_stored_with_the_version(gateway: Gateway):
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}" + " " * 8_000  # > 4 KiB
    await gateway.admin.RegisterModel(
        admin_pb2.RegisterModelRequest(version="m-v1", tokenizer=gateway.tokenizer, context_limit=512,
                                       price_output_per_m_micros=1, chat_template=template),
        metadata=gateway.as_admin,
    )
    async with gateway.sessionmaker() as session:
        stored = await session.scalar(select(Model.chat_template).where(Model.version == "m-v1"))
    assert stored == template
