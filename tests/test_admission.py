"""Admission against the real PostgreSQL, through the gRPC stubs: budgets, the seed-002 example,
request checks, model resolution. Idempotency and concurrency are in test_admission_concurrency.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import Budget, RunStatus
from sluice.ledger.pricing import reservation_cost_micros
from sluice.ledger.repositories import BudgetRepository
from sluice.services import errors
from sluice.services.tokenization import model_input
from sqlalchemy import select, text

from sluice.models import load_tokenizer
from sluice.v1 import common_pb2
from tests.support.ledger_factories import (
    DEFAULT_MODEL,
    MICROS,
    ModelSpec,
    add_model,
    add_tenant,
    budget_row,
    count_runs,
    first_of_this_month,
    get_run,
    prompt_of,
)

if TYPE_CHECKING:
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


async def make_model(api: Services, spec: ModelSpec = DEFAULT_MODEL, tokenizer: str | None = None) -> None:
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, tokenizer or api.tokenizer, spec)


async def make_tenant(api: Services, name: str = "acme", **kwargs):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        return await add_tenant(session, name, **kwargs)


async def rpc_error(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


# --- seed 002 ---------------------------------------------------------------------------------


async def test_seed_002_a_9000_token_prompt_with_cap_2000_is_refused_with_the_cap_that_fits(api):
    await make_model(api)
    tenant = await make_tenant(api, token_budget=50_000, used_tokens=40_000)  # 10,000 left
    before = await budget_row(api.sessionmaker, tenant.id)

    error = await rpc_error(api.submit(tenant, prompt_of(9_000), 2_000))

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == errors.BUDGET_TOO_SMALL_FOR_CAP.format(
        tokens_left=10_000, cost_left_micros=1_000 * MICROS, prompt=9_000, cap=2_000, fit=1_000
    )
    assert "at most 1,000" in error.details()
    assert (errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "1000") in tuple(error.trailing_metadata())
    assert await budget_row(api.sessionmaker, tenant.id) == before
    assert await count_runs(api.sessionmaker) == 0


async def test_seed_002_the_same_prompt_with_cap_1000_is_accepted_and_fills_the_budget(api):
    await make_model(api)
    tenant = await make_tenant(api, token_budget=50_000, used_tokens=40_000)

    response = await api.submit(tenant, prompt_of(9_000), 1_000)

    assert response.status == common_pb2.RUN_STATUS_ACCEPTED
    assert (response.input_tokens, response.max_output_tokens) == (9_000, 1_000)
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (10_000, 40_000)
    assert budget.reserved_tokens + budget.used_tokens == budget.token_budget


async def test_the_cost_budget_also_bounds_the_cap_it_offers(api):
    await make_model(api)  # $0.50/M in, $1.50/M out
    # 1,000-token prompt reserves 500 micros; 1,400 micros left → 900 micros for output → 600 tokens.
    tenant = await make_tenant(api, cost_budget_micros=1_400)

    error = await rpc_error(api.submit(tenant, prompt_of(1_000), 2_000))

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "600") in tuple(error.trailing_metadata())
    accepted = await api.submit(tenant, prompt_of(1_000), 600)
    assert accepted.status == common_pb2.RUN_STATUS_ACCEPTED
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_cost_micros == 1_400


async def test_a_prompt_that_alone_exhausts_the_budget_is_told_no_cap_fits(api):
    await make_model(api)
    tenant = await make_tenant(api, token_budget=100)

    error = await rpc_error(api.submit(tenant, prompt_of(100), 1))

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == errors.BUDGET_TOO_SMALL_FOR_PROMPT.format(
        tokens_left=100, cost_left_micros=1_000 * MICROS, prompt=100
    )
    assert (errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "0") in tuple(error.trailing_metadata())


# --- what an accepted run records -------------------------------------------------------------


async def test_an_accepted_run_is_committed_with_its_tokens_reservation_and_deadline(api):
    await make_model(api)
    tenant = await make_tenant(api)

    response = await api.submit(tenant, "alpha bravo charlie", 50, request_key="k-1", deadline_ms=30_000,
                                     temperature=0.7)

    run = await get_run(api.sessionmaker, response.run_id)
    assert run.status == RunStatus.ACCEPTED
    assert (run.tenant_id, run.request_key, run.model_version) == (tenant.id, "k-1", "test-model-v1")
    assert run.prompt_token_ids == [2, 3, 4]
    async with api.sessionmaker() as session:    # stored packed: three big-endian int32s (migration 0014)
        stored = await session.scalar(text("SELECT prompt_token_ids FROM runs WHERE id = :id"),
                                      {"id": run.id})
    assert stored == b"\x00\x00\x00\x02" b"\x00\x00\x00\x03" b"\x00\x00\x00\x04"
    assert (run.input_tokens, run.max_output_tokens, run.reserved_tokens) == (3, 50, 53)
    assert run.reserved_cost_micros == reservation_cost_micros(ModelSpec(), 3, 50) == 77  # ceil(76.5)
    assert run.sampling == {"temperature": 0.7, "top_p": 0.0, "seed": 0}
    assert run.deadline_at - run.created_at == dt.timedelta(seconds=30)
    assert run.replica is None and run.last_sequence == 0 and run.terminal_published is False
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.reserved_cost_micros) == (53, 77)


async def test_deadline_zero_means_the_configured_default(api):
    await make_model(api)
    tenant = await make_tenant(api)

    response = await api.submit(tenant, "alpha", 5, deadline_ms=0)

    run = await get_run(api.sessionmaker, response.run_id)
    assert run.deadline_at - run.created_at == dt.timedelta(milliseconds=600_000)


async def test_a_model_is_found_by_alias_or_by_exact_version(api):
    await make_model(api)
    tenant = await make_tenant(api)

    by_alias = await api.submit(tenant, "alpha", 5, model="test")
    by_version = await api.submit(tenant, "alpha", 5, model="test-model-v1")

    assert by_alias.model_version == by_version.model_version == "test-model-v1"


async def test_the_bearer_authorization_header_is_accepted_too(api):
    await make_model(api)
    tenant = await make_tenant(api)

    response = await api.submit(tenant, "alpha", 5, metadata=(("authorization", f"Bearer {tenant.api_key}"),))

    assert response.status == common_pb2.RUN_STATUS_ACCEPTED


@pytest.mark.parametrize("text", ["Sluice admits work under budgets — héllo, wörld!",
                                  "A gate's 12 levels don't move;\n\n  they're 'held'. " * 150])
async def test_the_models_own_tokenizer_counts_the_prompt(api, text):
    await make_model(api, ModelSpec(version="tiny-chat-v1", alias="chat", context_limit=8192),
                     tokenizer="tiny-chat/tokenizer.json")
    tenant = await make_tenant(api)

    response = await api.submit(tenant, text, 16, model="chat")

    # The oracle: the tokenizer library's own encode of the chat-wrapped prompt (the service takes
    # a faster path for ASCII, services/token_pieces.py).
    expected = load_tokenizer("tiny-chat/tokenizer.json").encode(
        model_input("tiny-chat/tokenizer.json", text), add_special_tokens=False).ids
    assert response.input_tokens == len(expected)
    assert (await get_run(api.sessionmaker, response.run_id)).prompt_token_ids == expected


async def test_a_long_prompts_ids_are_stored_lz4_compressed(api):
    await make_model(api, ModelSpec(version="tiny-chat-v1", alias="chat", context_limit=8192),
                     tokenizer="tiny-chat/tokenizer.json")
    tenant = await make_tenant(api)
    prompt = " ".join(f"word{n} {n * 7919 % 10007}" for n in range(700))   # ~3,500 ids: 14 KB, toasted

    response = await api.submit(tenant, prompt, 16, model="chat")

    async with api.sessionmaker() as session:    # migration 0015: lz4, not pglz
        stored = (await session.execute(text(
            "SELECT pg_column_compression(prompt_token_ids), length(prompt_token_ids)"
            " FROM runs WHERE id = :id"), {"id": uuid.UUID(response.run_id)})).one()
    assert stored == ("lz4", 4 * response.input_tokens)


async def test_a_new_month_opens_with_the_previous_months_limits(api):
    await make_model(api)
    last_month = (first_of_this_month() - dt.timedelta(days=1)).replace(day=1)
    tenant = await make_tenant(api, token_budget=777, cost_budget_micros=888_888, period_start=last_month)

    await api.submit(tenant, "alpha", 5)

    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.token_budget, budget.cost_budget_micros, budget.reserved_tokens, budget.used_tokens) == (
        777, 888_888, 6, 0,
    )


async def test_a_submit_racing_another_to_open_the_new_month_reserves_in_the_period_the_other_opened(api):
    await make_model(api)
    last_month = (first_of_this_month() - dt.timedelta(days=1)).replace(day=1)
    tenant = await make_tenant(api, token_budget=777, cost_budget_micros=888_888, period_start=last_month)
    # Another admission instance opens this month's period and has not committed yet.
    async with api.sessionmaker() as other, other.begin():
        assert await BudgetRepository(other).open_current_period(tenant.id)
        submit = asyncio.create_task(api.submit(tenant, "alpha", 5))
        await asyncio.sleep(0.5)          # this submit now waits on the other's new budget row
        assert not submit.done()

    response = await asyncio.wait_for(submit, 10)

    assert response.status == common_pb2.RUN_STATUS_ACCEPTED
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.token_budget, budget.reserved_tokens) == (777, 6)     # this month's row


async def test_a_period_another_submit_opens_just_after_this_ones_first_try_still_takes_the_reservation(
        api, monkeypatch: pytest.MonkeyPatch):
    # The other admission commits this month's period between this submit's first try (no period
    # visible yet) and its look for the current period (now visible): the reservation fits it, so
    # the run is admitted there, not refused as over budget (seen under load: "777 tokens left ...
    # does not fit").
    await make_model(api)
    last_month = (first_of_this_month() - dt.timedelta(days=1)).replace(day=1)
    tenant = await make_tenant(api, token_budget=777, cost_budget_micros=888_888, period_start=last_month)
    async with api.sessionmaker() as other:
        await other.begin()
        assert await BudgetRepository(other).open_current_period(tenant.id)
        tries: list[bool] = []
        original = BudgetRepository.try_reserve

        async def racing(self: BudgetRepository, tenant_id: uuid.UUID, tokens: int, cost_micros: int) -> bool:
            reserved = await original(self, tenant_id, tokens, cost_micros)
            tries.append(reserved)
            if len(tries) == 1:
                await other.commit()          # the period opens right after the first try
            return reserved
        monkeypatch.setattr(BudgetRepository, "try_reserve", racing)
        response = await asyncio.wait_for(api.submit(tenant, "alpha", 5), 10)

    assert tries[0] is False                  # the race happened: the first try saw no period
    assert response.status == common_pb2.RUN_STATUS_ACCEPTED
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.token_budget, budget.reserved_tokens) == (777, 6)     # this month's row


async def test_a_tenant_without_any_budget_is_refused(api):
    await make_model(api)
    tenant = await make_tenant(api)
    async with api.sessionmaker() as session, session.begin():
        await session.execute(Budget.__table__.delete().where(Budget.tenant_id == tenant.id))

    error = await rpc_error(api.submit(tenant, "alpha", 5))

    assert (error.code(), error.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.NO_BUDGET)
    assert await count_runs(api.sessionmaker) == 0


# --- refusals that write nothing ----------------------------------------------------------------

LONG_KEY = "k" * 129


@pytest.mark.parametrize(
    ("case", "code", "message"),
    [
        ("unknown model", grpc.StatusCode.NOT_FOUND, errors.UNKNOWN_MODEL.format(model="no-such-model")),
        ("empty input", grpc.StatusCode.INVALID_ARGUMENT, errors.EMPTY_INPUT),
        ("zero cap", grpc.StatusCode.INVALID_ARGUMENT, errors.OUTPUT_CAP_NOT_POSITIVE.format(cap=0)),
        ("negative cap", grpc.StatusCode.INVALID_ARGUMENT, errors.OUTPUT_CAP_NOT_POSITIVE.format(cap=-5)),
        (
            "cap overflows context",
            grpc.StatusCode.INVALID_ARGUMENT,
            errors.CONTEXT_TOO_LONG.format(
                prompt=1_000, cap=100, model="test-model-v1", limit=1_024,
                advice=errors.CONTEXT_ADVICE_LOWER_CAP.format(fit=24),
            ),
        ),
        (
            "prompt overflows context",
            grpc.StatusCode.INVALID_ARGUMENT,
            errors.CONTEXT_TOO_LONG.format(
                prompt=1_024, cap=1, model="test-model-v1", limit=1_024,
                advice=errors.CONTEXT_ADVICE_SHORTEN_PROMPT.format(limit=1_024),
            ),
        ),
        ("missing key", grpc.StatusCode.UNAUTHENTICATED, errors.MISSING_API_KEY),
        ("wrong key", grpc.StatusCode.UNAUTHENTICATED, errors.UNKNOWN_API_KEY),
        ("empty request key", grpc.StatusCode.INVALID_ARGUMENT, errors.REQUEST_KEY_MISSING.format(limit=128)),
        (
            "over-long request key",
            grpc.StatusCode.INVALID_ARGUMENT,
            errors.REQUEST_KEY_TOO_LONG.format(length=129, limit=128),
        ),
        ("invalid utf-8", grpc.StatusCode.INVALID_ARGUMENT, errors.INPUT_NOT_UTF8.format(position=6)),
        (
            "negative deadline",
            grpc.StatusCode.INVALID_ARGUMENT,
            errors.DEADLINE_NEGATIVE.format(deadline_ms=-1),
        ),
        (
            "temperature out of range",
            grpc.StatusCode.INVALID_ARGUMENT,
            errors.SAMPLING_OUT_OF_RANGE.format(name="temperature", low=0.0, high=2.0, value=3.0),
        ),
        (
            "tier not allowed",
            grpc.StatusCode.PERMISSION_DENIED,
            errors.TIER_NOT_ALLOWED.format(model="premium", tier="premium", allowed="standard"),
        ),
    ],
)
async def test_bad_requests_are_refused_with_a_status_and_message_and_write_nothing(api, case, code,
                                                                                    message):
    await make_model(api, ModelSpec(context_limit=1_024))
    await make_model(api, ModelSpec(version="premium-v1", alias="premium", quality_tier="premium"))
    tenant = await make_tenant(api)
    before = await budget_row(api.sessionmaker, tenant.id)
    submit = {
        "unknown model": lambda: api.submit(tenant, "alpha", 5, model="no-such-model"),
        "empty input": lambda: api.submit(tenant, "", 5),
        "zero cap": lambda: api.submit(tenant, "alpha", 0),
        "negative cap": lambda: api.submit(tenant, "alpha", -5),
        "cap overflows context": lambda: api.submit(tenant, prompt_of(1_000), 100),
        "prompt overflows context": lambda: api.submit(tenant, prompt_of(1_024), 1),
        "missing key": lambda: api.submit(tenant, "alpha", 5, metadata=()),
        "wrong key": lambda: api.submit(tenant, "alpha", 5, metadata=(("x-api-key", "sk-nope"),)),
        "empty request key": lambda: api.submit(tenant, "alpha", 5, request_key=""),
        "over-long request key": lambda: api.submit(tenant, "alpha", 5, request_key=LONG_KEY),
        "invalid utf-8": lambda: api.submit(tenant, b"alpha \xff\xfe", 5),
        "negative deadline": lambda: api.submit(tenant, "alpha", 5, deadline_ms=-1),
        "temperature out of range": lambda: api.submit(tenant, "alpha", 5, temperature=3.0),
        "tier not allowed": lambda: api.submit(tenant, "alpha", 5, model="premium"),
    }[case]

    error = await rpc_error(submit())

    assert (error.code(), error.details()) == (code, message)
    assert await count_runs(api.sessionmaker) == 0
    assert await budget_row(api.sessionmaker, tenant.id) == before


async def test_a_revoked_key_is_unauthenticated(api):
    await make_model(api)
    tenant = await make_tenant(api)
    from sluice.ledger.models import ApiKey

    async with api.sessionmaker() as session, session.begin():
        key = await session.scalar(select(ApiKey).where(ApiKey.tenant_id == tenant.id))
        assert key is not None
        key.revoked_at = dt.datetime.now(dt.UTC)

    error = await rpc_error(api.submit(tenant, "alpha", 5))

    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, errors.UNKNOWN_API_KEY)


async def test_a_run_id_is_a_uuid_string(api):
    await make_model(api)
    tenant = await make_tenant(api)

    response = await api.submit(tenant, "alpha", 5)

    assert str(uuid.UUID(response.run_id)) == response.run_id
