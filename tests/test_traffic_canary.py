"""Canary on the real stack: an alias splits a configured share of new runs to a candidate version
(sticky per conversation), and the guard rolls a slowed candidate back to 0% with the reason kept
where the Admin API shows it.

The candidate `tiny-chat-v2` is served by its own replica, r2, at 80 ms per token against the
baseline replica's 20 ms (the simple engine's fixed pace), so its TPOT is four times the baseline's.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest
from sluice.ledger.models import TERMINAL_STATUSES, CanaryState
from sluice.services.admin_servicer import add_admin_servicer
from sluice.services.admission import add_admission_servicer
from sluice.services.canary_guard import ROLLBACK_REASON, CanaryGuard
from sqlalchemy import text

from sluice.traffic.canary import Verdict, split_point, takes_candidate
from sluice.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc, common_pb2
from tests.support.admin_services import make_admin_key
from tests.support.ledger_factories import ModelSpec, add_model
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica
from tests.support.routing_stack import MODEL, TOKENIZER, Stack

pytestmark = pytest.mark.integration

CANDIDATE = ModelSpec(version="tiny-chat-v2", alias=None, context_limit=4096)
SLOW_TOKEN_DELAY_MS = 80
PROMPT = "Tell me about sluice gates."
TERMINAL = {status.value for status in TERMINAL_STATUSES}


@pytest.fixture(scope="module")
def slow_replica(replica_logs: Path) -> Iterator[ReplicaProcess]:
    replica = start_replica("r2", replica_logs, {"engine": "simple", "token_delay_ms": SLOW_TOKEN_DELAY_MS})
    try:
        yield replica
    finally:
        stop_replica(replica)


@dataclass(slots=True)
class Canaried:
    stack: Stack
    admission: admission_pb2_grpc.AdmissionStub
    admin: admin_pb2_grpc.AdminStub
    admin_key: str

    async def submit(self, conversation: str, model: str = "chat",
                     cap: int = 8) -> admission_pb2.SubmitResponse:
        request = admission_pb2.SubmitRequest(model=model, input=PROMPT.encode(), max_output_tokens=cap,
                                              request_key=uuid.uuid4().hex, conversation_id=conversation)
        return await self.admission.Submit(request, metadata=(("x-api-key", self.stack.tenant.api_key),))

    @property
    def as_admin(self) -> tuple[tuple[str, str], ...]:
        return (("x-api-key", self.admin_key),)

    async def start(self, share_bp: int, **limits: float) -> admin_pb2.Canary:
        return await self.admin.StartCanary(admin_pb2.StartCanaryRequest(
            alias="chat", candidate_version=CANDIDATE.version, share_bp=share_bp,
            guardrails=admin_pb2.CanaryGuardrails(**limits)), metadata=self.as_admin)

    async def canary(self) -> admin_pb2.Canary:
        listed = await self.admin.ListCanaries(admin_pb2.ListCanariesRequest(), metadata=self.as_admin)
        (only,) = listed.canaries
        return only


@pytest.fixture
async def canaried(stack: Stack, slow_replica: ReplicaProcess) -> AsyncIterator[Canaried]:
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, CANDIDATE)
    baseline = stack.config.replica_tables()[0]
    stack.config = stack.config.updated(replicas=[
        {**baseline, "pool": MODEL.version},
        {"name": slow_replica.name, "pool": CANDIDATE.version, "grpc_address": slow_replica.grpc_address,
         "metrics_port": slow_replica.metrics_port}])
    server = grpc.aio.server()
    admission = add_admission_servicer(server, stack.sessionmaker, stack.config)
    add_admin_servicer(server, stack.sessionmaker, stack.config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Canaried(stack, admission_pb2_grpc.AdmissionStub(channel), admin_pb2_grpc.AdminStub(channel),
                       await make_admin_key(stack.sessionmaker))
    finally:
        await channel.close()
        await server.stop(None)
        await admission.close()


async def test_a_20_percent_canary_routes_a_binomial_share_sticky_per_conversation_and_promotion_moves_it(
        canaried: Canaried):
    started = await canaried.start(2_000)
    assert (started.baseline_version, started.state) == (MODEL.version, "active")

    n, p = 400, 0.2
    answers = [await canaried.submit(f"conversation-{i}") for i in range(n)]
    on_candidate = [a for a in answers if a.model_version == CANDIDATE.version]
    # Each conversation takes the candidate with p = 0.2, so the count is Binomial(400, 0.2): mean 80,
    # sd 8; 4 sd either side holds it with probability above 0.9999.
    sd = math.sqrt(n * p * (1 - p))
    assert abs(len(on_candidate) - n * p) <= 4 * sd, len(on_candidate)
    assert all(a.route.reason == common_pb2.ROUTE_REASON_CANARY and a.route.pool == CANDIDATE.version
               for a in on_candidate)
    assert on_candidate[0].route.detail == (
        f"canary of chat: 20% of new runs to {CANDIDATE.version} (baseline {MODEL.version})")
    on_baseline = [a for a in answers if a.model_version == MODEL.version]
    assert {a.route.reason for a in on_baseline} == {common_pb2.ROUTE_REASON_ALIAS}

    # Sticky: every later run of a conversation lands where its first did.
    for i in range(0, n, 40):
        again = {(await canaried.submit(f"conversation-{i}")).model_version for _ in range(3)}
        assert again == {answers[i].model_version}
    # An exact version is what the caller asked for, canary or not.
    exact = await canaried.submit("conversation-0", model=MODEL.version)
    assert (exact.model_version, exact.route.reason) == (MODEL.version, common_pb2.ROUTE_REASON_REQUESTED)

    promoted = await canaried.admin.PromoteCanary(admin_pb2.PromoteCanaryRequest(alias="chat"),
                                                  metadata=canaried.as_admin)
    assert (promoted.state, promoted.share_bp) == ("promoted", 0)
    after = await canaried.submit("conversation-1")
    assert (after.model_version, after.route.reason) == (CANDIDATE.version, common_pb2.ROUTE_REASON_ALIAS)


async def test_a_slowed_candidate_trips_the_guardrail_and_the_split_goes_to_0_with_the_reason_recorded(
        canaried: Canaried):
    await canaried.start(5_000, min_samples=5, window_s=600)
    # Six conversations on each side of the 50% split (chosen by their sticky points).
    names = (f"c{i}" for i in range(1_000))
    candidate_side = [c for c in names if takes_candidate(split_point("chat", c), 5_000)][:6]
    baseline_side = [c for c in (f"b{i}" for i in range(1_000))
                     if not takes_candidate(split_point("chat", c), 5_000)][:6]
    await canaried.stack.start_worker()
    runs = [await canaried.submit(c) for c in candidate_side + baseline_side]
    assert sum(r.model_version == CANDIDATE.version for r in runs) == 6
    ended = [await canaried.stack.wait_for_status(run.run_id, TERMINAL, timeout_s=60) for run in runs]
    assert [(row.status, row.detail) for row in ended] == [("COMPLETED", None)] * len(runs)

    guard = CanaryGuard(canaried.stack.sessionmaker, interval_s=1.0)
    judgment = (await guard.check_once())["chat"]

    assert judgment.verdict is Verdict.BREACH
    assert (judgment.candidate.runs, judgment.baseline.runs) == (6, 6)
    # 8 tokens: TPOT is the replica's token delay, 80 ms against 20 ms (x4 > x1.5).
    assert judgment.candidate.tpot_p95_s > 1.5 * judgment.baseline.tpot_p95_s
    assert "p95 TPOT" in judgment.reason
    canary = await canaried.canary()
    assert (canary.state, canary.share_bp) == (CanaryState.ROLLED_BACK.value, 0)
    assert canary.reason == ROLLBACK_REASON.format(reason=judgment.reason)
    assert json.loads(canary.last_judgment_json)["verdict"] == "breach"
    audit = await canaried.admin.ListAudit(admin_pb2.ListAuditRequest(action="canary.rollback"),
                                           metadata=canaried.as_admin)
    assert [(e.actor, e.target) for e in audit.entries] == [("canary-guard", "chat")]
    # Rolled back: every new run goes to the baseline, the candidate's conversations too.
    after = [await canaried.submit(c) for c in candidate_side]
    assert {(a.model_version, a.route.reason) for a in after} == {
        (MODEL.version, common_pb2.ROUTE_REASON_ALIAS)}
    # A second guard pass finds nothing active to judge.
    assert await guard.check_once() == {}
    async with canaried.stack.sessionmaker() as session:
        rollbacks = text("SELECT count(*) FROM admin_audit WHERE action = 'canary.rollback'")
        assert await session.scalar(rollbacks) == 1
