"""Trust scopes (DESIGN.md "Trust scopes"): KV blocks and prefix-index entries are shared only
within a scope, by default the tenant, or a shared scope tenants opt into.

Pinned at each layer the scope crosses: the engine core's block hashes, the router's prefix index
and policy, the salt derived from a scope, and the whole stack (admission → routing → Triton
replica running the core engine → GetRun's cached_input_tokens).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
from sluice.ledger.models import Run
from sluice.services.trust_scope import cache_salt, scope_of
from sluice_client.sdk import SluiceClient

from sluice.engine.kv_cache import ROOT_HASH, block_hashes, salted_root
from sluice.engine.types import EngineRequest
from sluice.router import prefix_index
from sluice.router.policies import PrefixAware
from sluice.router.policy import ReplicaView, RouteRequest
from sluice.v1 import common_pb2, routing_pb2
from tests.engine_helpers import make_engine, prompt, run_to_completion
from tests.support.ledger_factories import TenantHandle, add_tenant
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica
from tests.support.routing_stack import MODEL, Stack, collect, replica_tables, routing_api

SALT_A, SALT_B = cache_salt("tenant:a"), cache_salt("tenant:b")


# --- engine core ------------------------------------------------------------------------------


def test_the_salt_changes_every_block_hash_and_no_salt_keeps_the_unsalted_chain():
    tokens = prompt(12)
    assert block_hashes(tokens, 4, salted_root(0)) == block_hashes(tokens, 4, ROOT_HASH)
    plain, salted = block_hashes(tokens, 4), block_hashes(tokens, 4, salted_root(SALT_A))
    assert len(plain) == len(salted) == 3
    assert not set(plain) & set(salted)


def _reused_blocks(engine, request_id: str, tokens: tuple[int, ...], salt: int) -> int:
    engine.add_request(EngineRequest(request_id, tokens, 2, cache_salt=salt))
    outputs = run_to_completion(engine)
    return next(output.kv_cache_reused_blocks for output in outputs if output.request_id == request_id)


def test_another_scope_reuses_nothing_of_a_cached_prompt_and_the_same_scope_reuses_it():
    engine = make_engine()                     # blocks of 4 tokens
    tokens = prompt(13)                        # 3 full blocks
    assert _reused_blocks(engine, "a1", tokens, SALT_A) == 0
    assert _reused_blocks(engine, "b1", tokens, SALT_B) == 0
    assert engine.cached_prefix_tokens(tokens, SALT_B) == 12
    assert _reused_blocks(engine, "a2", tokens, SALT_A) == 3
    assert _reused_blocks(engine, "unsalted", tokens, 0) == 0
    assert engine.cached_prefix_tokens(prompt(13, start=500), SALT_A) == 0


# --- router -------------------------------------------------------------------------------------


def test_prefix_index_chains_of_two_scopes_share_no_entry():
    tokens = prompt(64)
    assert prefix_index.block_hashes(tokens, 16) == prefix_index.block_hashes(tokens, 16, 0)
    chain_a, chain_b = (prefix_index.block_hashes(tokens, 16, salt) for salt in (SALT_A, SALT_B))
    assert not set(chain_a) & set(chain_b)


def test_prefix_aware_predicts_a_hit_only_within_the_scope_that_sent_the_prompt():
    policy = PrefixAware()
    views = [ReplicaView(name=name, pool="m", block_size=16, kv_capacity_blocks=1_000)
             for name in ("r0", "r1")]
    tokens = prompt(256)

    def route(request_id: str, salt: int, conversation: str | None = None) -> tuple[str, int]:
        request = RouteRequest(request_id=request_id, model_version="m", token_ids=tokens,
                               max_output_tokens=4, conversation_id=conversation, cache_salt=salt)
        decision = policy.choose(request, views, 0.0)
        assert decision is not None
        policy.on_routed(request, decision, 0.0)
        policy.on_finished(request, decision.replica, 0.0)
        return decision.replica, decision.predicted_cached_tokens

    first, predicted = route("a1", SALT_A, "conv")
    assert predicted == 0
    assert route("a2", SALT_A) == (first, 256 - 16)        # the whole prompt but its last block
    assert route("b1", SALT_B, "conv")[1] == 0              # same prompt, same conversation id


def test_a_scope_is_the_tenant_unless_it_opted_into_a_shared_one_and_its_salt_is_stable():
    tenant = uuid.UUID("00000000-0000-0000-0000-00000000000a")
    assert scope_of(tenant, None) == "tenant:00000000-0000-0000-0000-00000000000a"
    assert scope_of(tenant, "public") == "shared:public"
    assert cache_salt("shared:public") == cache_salt("shared:public") != cache_salt("shared:other")
    assert cache_salt("shared:public") == int.from_bytes(
        hashlib.blake2b(b"shared:public", digest_size=8).digest(), "big")


# --- the whole stack ---------------------------------------------------------------------------

CORE_SETTINGS = {"engine": "core", "output_length": "cap"}
PROMPT = " ".join(f"Lock {i} of the canal lifts {i % 5} barges an hour." for i in range(40))


@pytest.fixture(scope="module")
def core_replica(replica_logs: Path) -> Iterator[ReplicaProcess]:
    """One core-engine replica, so every run of every tenant lands on the same KV pool."""
    replica = start_replica("scope0", replica_logs, CORE_SETTINGS)
    try:
        yield replica
    finally:
        stop_replica(replica)


async def _run_once(stack: Stack, tenant: TenantHandle) -> Run:
    """PROMPT run to completion for `tenant`; its ledger row."""
    async with SluiceClient(stack.address, tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=4)
        events = await collect(sdk.stream(run.run_id))
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    row = await stack.run_row(run.run_id)
    assert events[-1].usage.cached_input_tokens == row.cached_input_tokens   # billed as reported
    return row


async def _cached_tokens(stack: Stack, tenant: TenantHandle) -> int:
    return (await _run_once(stack, tenant)).cached_input_tokens


async def _scoped_stack(stack: Stack, core_replica: ReplicaProcess) -> tuple[TenantHandle, TenantHandle]:
    """The stack on one core-engine replica under prefix_aware, with two members of a shared scope."""
    stack.config = stack.config.updated(replicas=replica_tables([core_replica]),
                                        routing={"policy": "prefix_aware"})
    async with stack.sessionmaker() as session, session.begin():
        shared_1 = await add_tenant(session, "public-1", shared_cache_scope="public-prompts")
        shared_2 = await add_tenant(session, "public-2", shared_cache_scope="public-prompts")
    return shared_1, shared_2


@pytest.mark.integration
async def test_through_the_stack_another_tenant_gets_no_cached_token_of_a_prompt_its_own_tenant_reuses(
        stack: Stack, core_replica: ReplicaProcess):
    shared_1, shared_2 = await _scoped_stack(stack, core_replica)
    await stack.start_worker()
    assert await _cached_tokens(stack, stack.tenant) == 0
    hit = await _cached_tokens(stack, stack.tenant)
    assert hit > 0 and hit % 32 == 0                        # whole 32-token blocks of the same prompt
    assert await _cached_tokens(stack, stack.other) == 0    # tenant B, tenant A's prompt: nothing
    assert await _cached_tokens(stack, shared_1) == 0       # the shared scope starts empty ...
    assert await _cached_tokens(stack, shared_2) == hit     # ... and is shared by its members


@pytest.mark.integration
async def test_explain_predicts_within_the_callers_scope_so_another_tenant_sees_nothing_cached(
        stack: Stack, core_replica: ReplicaProcess):
    shared_1, shared_2 = await _scoped_stack(stack, core_replica)
    worker = await stack.start_worker()
    tokens = (await _run_once(stack, stack.tenant)).prompt_token_ids   # tenant A's prompt, routed
    await _run_once(stack, shared_1)                                   # and a shared scope's
    request = routing_pb2.ExplainRequest(model_version=MODEL.version, token_ids=tokens)
    async with routing_api(worker) as routing:

        async def predicted(tenant: TenantHandle) -> int:
            answer = await routing.Explain(request, metadata=(("x-api-key", tenant.api_key),))
            return answer.predicted_cached_tokens

        for_a, for_b = await predicted(stack.tenant), await predicted(stack.other)
        for_shared_2 = await predicted(shared_2)
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await routing.Explain(request)
    scoped = RouteRequest(request_id="explain", model_version=MODEL.version, token_ids=tuple(tokens),
                          max_output_tokens=1, cache_salt=cache_salt(scope_of(stack.tenant.id, None)))
    expected = worker.explain(scoped, MODEL.version)
    assert expected is not None and for_a == expected.predicted_cached_tokens > 0
    assert for_b == 0                                   # tenant B, tenant A's prompt: nothing
    assert for_shared_2 == for_a                        # a member of the scope that sent it: the hit
    assert anonymous.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.integration
async def test_a_replica_whose_model_lacks_cache_salt_id_gets_unsalted_requests_when_its_entry_says_so(
        stack: Stack, replica_logs: Path):
    """tensorrtllm_backend's own model declares no cache_salt_id: the entry's `cache_salt_id = false`
    keeps the salt off its requests (else Triton refuses every one as an unexpected input)."""
    bare = start_replica("scope-bare", replica_logs, {**CORE_SETTINGS, "cache_salt_id": False})
    try:
        tables = replica_tables([bare])
        stack.config = stack.config.updated(replicas=[{**tables[0], "replica": {"cache_salt_id": False}}])
        await stack.start_worker()
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            run = await sdk.submit(PROMPT, max_output_tokens=4)
            events = await collect(sdk.stream(run.run_id))
        assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
        assert events[-1].usage.output_tokens == 4
    finally:
        stop_replica(bare)


def test_whether_a_replica_takes_the_salt_is_its_replica_section_with_the_entrys_own_keys_over_it():
    from sluice.services.routing.app import registry_from_config

    from sluice.config import Settings, load_settings

    entries = [{"name": "own", "grpc_address": "127.0.0.1:1"},
               {"name": "bare", "grpc_address": "127.0.0.1:2", "replica": {"cache_salt_id": False}}]
    config = load_settings().updated(replicas=entries)
    def salted(settings: Settings) -> dict[str, bool]:
        return {spec.name: spec.cache_salt_id for spec in registry_from_config(settings).specs()}

    assert salted(config) == {"own": True, "bare": False}
    assert salted(config.updated(replica={"cache_salt_id": False})) == {"own": False, "bare": False}
