"""Traffic policy through the Admin API and admission on the real PostgreSQL (no replicas): the
deadline condition of a permitted fallback, and the checks and audit of the traffic RPCs."""

from __future__ import annotations

import math
import uuid

import grpc
import grpc.aio
import pytest
from sluice.services import admin_traffic

from sluice.config import load_settings
from sluice.v1 import admin_pb2, admission_pb2, common_pb2
from tests.support.admin_services import Gateway
from tests.support.ledger_services import key_metadata

pytestmark = pytest.mark.integration

PROMPT = "alpha bravo charlie delta echo"     # 5 tokens of the word tokenizer
CAP = 100


async def refused(call, code: grpc.StatusCode) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return str(caught.value.details())


async def submit(gateway: Gateway, key: str, deadline_ms: int,
                 fallback: admission_pb2.FallbackRequest | None = None) -> admission_pb2.SubmitResponse:
    request = admission_pb2.SubmitRequest(model="big", input=PROMPT.encode(), max_output_tokens=CAP,
                                          request_key=uuid.uuid4().hex, deadline_ms=deadline_ms,
                                          fallback=fallback)
    return await gateway.admission.Submit(request, metadata=key_metadata(key))


async def set_rules(gateway: Gateway, tenant: str, *rules: admin_pb2.FallbackRule) -> admin_pb2.Fallbacks:
    return await gateway.admin.SetFallbacks(admin_pb2.SetFallbacksRequest(tenant=tenant, rules=rules),
                                            metadata=gateway.as_admin)


async def test_a_queue_bound_deadline_falls_back_only_when_the_deadline_condition_is_permitted(
        gateway: Gateway):
    await gateway.model("big-v1", alias="big")
    await gateway.model("small-v1", alias="small")
    key = await gateway.tenant("acme")
    pace = load_settings().admission
    backlog = 5
    for _ in range(backlog):                                   # nothing claims them: they wait
        await submit(gateway, key, 0)
    # The configured pace: 5 runs waiting drain in 100 ms; the run itself needs its prefill and cap.
    queue_ms = math.ceil(backlog * 1000 / pace.pool_drain_runs_per_s)
    service_ms = (math.ceil(5 * pace.expected_ms_per_prompt_token)
                  + math.ceil(CAP * pace.expected_ms_per_output_token))
    deadline = queue_ms + service_ms - 1                       # met on an empty queue, missed behind this one

    await refused(submit(gateway, key, deadline), grpc.StatusCode.DEADLINE_EXCEEDED)
    await set_rules(gateway, "acme", admin_pb2.FallbackRule(from_model="big", to_model="small",
                                                            conditions=["backlog"]))
    await refused(submit(gateway, key, deadline), grpc.StatusCode.DEADLINE_EXCEEDED)
    await set_rules(gateway, "acme", admin_pb2.FallbackRule(from_model="big", to_model="small",
                                                            conditions=["deadline"]))
    # Too long for any pool: not the queue's fault, so no fallback.
    await refused(submit(gateway, key, service_ms - 1), grpc.StatusCode.DEADLINE_EXCEEDED)

    taken = await submit(gateway, key, deadline)
    assert (taken.model_version, taken.route.reason, taken.route.fallback_from) == (
        "small-v1", common_pb2.ROUTE_REASON_FALLBACK, "big-v1")
    assert taken.route.detail == (f"deadline: big-v1 queue wait {queue_ms} ms + run {service_ms} ms"
                                  f" > deadline {deadline} ms")


async def test_fallback_rules_are_checked_replaced_whole_and_audited(gateway: Gateway):
    await gateway.model("big-v1", alias="big")
    await gateway.model("small-v1")
    await gateway.tenant("acme")
    unknown = admin_pb2.FallbackRule(from_model="big", to_model="tiny")
    details = await refused(set_rules(gateway, "acme", unknown), grpc.StatusCode.NOT_FOUND)
    assert details == admin_traffic.FALLBACK_UNKNOWN_MODEL.format(index=0, model="tiny")
    details = await refused(set_rules(gateway, "acme", admin_pb2.FallbackRule(
        from_model="big", to_model="small-v1", conditions=["always"])), grpc.StatusCode.INVALID_ARGUMENT)
    assert details == admin_traffic.FALLBACK_BAD_CONDITION.format(index=0, condition="always")

    saved = await set_rules(gateway, "acme", admin_pb2.FallbackRule(from_model="big", to_model="small-v1"))
    assert [(r.from_model, r.to_model, list(r.conditions)) for r in saved.rules] == [
        ("big", "small-v1", ["backlog", "deadline"])]                 # no conditions: both
    shown = await gateway.admin.GetFallbacks(admin_pb2.GetFallbacksRequest(tenant="acme"),
                                             metadata=gateway.as_admin)
    assert shown == saved
    cleared = await set_rules(gateway, "acme")
    assert list(cleared.rules) == []
    audit = await gateway.admin.ListAudit(admin_pb2.ListAuditRequest(action="tenant.set_fallbacks"),
                                          metadata=gateway.as_admin)
    assert len(audit.entries) == 2                                    # the refused ones wrote nothing


async def test_canary_admin_checks_and_a_manual_stop_records_its_reason(gateway: Gateway):
    await gateway.model("big-v1", alias="big")
    await gateway.model("big-v2")

    def start(alias: str, version: str, share_bp: int):  # type: ignore[no-untyped-def]
        return gateway.admin.StartCanary(admin_pb2.StartCanaryRequest(
            alias=alias, candidate_version=version, share_bp=share_bp), metadata=gateway.as_admin)

    assert await refused(start("none", "big-v2", 100), grpc.StatusCode.NOT_FOUND) == \
        admin_traffic.ALIAS_UNHELD.format(alias="none")
    assert await refused(start("big", "big-v1", 100), grpc.StatusCode.FAILED_PRECONDITION) == \
        admin_traffic.CANARY_SAME_VERSION.format(version="big-v1", alias="big")
    await refused(start("big", "big-v2", 10_001), grpc.StatusCode.INVALID_ARGUMENT)
    started = await start("big", "big-v2", 1_000)
    assert (started.baseline_version, started.share_bp, started.guardrails.min_samples) == (
        "big-v1", 1_000, 20)
    assert await refused(start("big", "big-v2", 100), grpc.StatusCode.FAILED_PRECONDITION) == \
        admin_traffic.CANARY_ACTIVE.format(alias="big", candidate="big-v2")

    stopped = await gateway.admin.StopCanary(admin_pb2.StopCanaryRequest(alias="big"),
                                             metadata=gateway.as_admin)
    assert (stopped.state, stopped.share_bp, stopped.reason) == (
        "rolled_back", 0, admin_traffic.STOPPED_BY_ADMIN)
    again = await start("big", "big-v2", 500)                       # an ended canary is replaced
    assert (again.state, again.share_bp, again.reason) == ("active", 500, "")


async def test_moving_the_alias_by_hand_ends_its_canary(gateway: Gateway):
    await gateway.model("big-v1", alias="big")
    await gateway.model("big-v2")
    await gateway.model("big-v3")
    await gateway.admin.StartCanary(admin_pb2.StartCanaryRequest(alias="big", candidate_version="big-v2",
                                                                 share_bp=2_000), metadata=gateway.as_admin)
    await gateway.admin.MoveAlias(admin_pb2.MoveAliasRequest(alias="big", version="big-v3"),
                                  metadata=gateway.as_admin)
    listed = await gateway.admin.ListCanaries(admin_pb2.ListCanariesRequest(), metadata=gateway.as_admin)
    (canary,) = listed.canaries
    assert (canary.state, canary.share_bp, canary.reason) == (
        "rolled_back", 0, admin_traffic.MOVED_BY_HAND.format(alias="big", version="big-v3"))
