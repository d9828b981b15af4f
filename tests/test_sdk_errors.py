"""The SDK raises admission's refusals as SluiceError with the hints of their trailing metadata, and
`sluice chat` prints them as one line of what to change (real admission served in-process on the real
PostgreSQL; the hint rendering alone needs no server)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import Run, RunStatus
from sluice.services import errors, validation
from sluice.services.admission import add_admission_servicer
from sluice_client import cli, sdk
from sluice_client.sdk import SluiceClient, SluiceError
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import load_settings
from tests.support.ledger_factories import DEFAULT_MODEL, MICROS, add_model, add_tenant, count_runs, prompt_of

MODEL = DEFAULT_MODEL.alias or DEFAULT_MODEL.version


def hints_of(error: SluiceError) -> tuple[int | None, int | None, int | None]:
    """(retry_after_ms, max_output_tokens_that_fit, min_deadline_ms)"""
    return error.retry_after_ms, error.max_output_tokens_that_fit, error.min_deadline_ms


def refusal(code: grpc.StatusCode, *hints: tuple[str, str]) -> SluiceError:
    return SluiceError(code, "refused", trailing_metadata=grpc.aio.Metadata(*hints))


# --- the error and its hint line (no server) ------------------------------------------------------


def test_the_sdk_reads_the_hints_under_the_keys_the_server_writes():
    assert (sdk.RETRY_AFTER_MS_KEY, sdk.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, sdk.MIN_DEADLINE_MS_KEY) == (
        errors.RETRY_AFTER_MS_KEY, errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY, errors.MIN_DEADLINE_MS_KEY)


def test_a_sluice_error_is_still_an_aio_rpc_error_with_its_code_and_message():
    error = refusal(grpc.StatusCode.UNAVAILABLE, ("retry-after-ms", "300"))
    assert isinstance(error, grpc.aio.AioRpcError)
    assert (error.code(), error.details(), error.message) == (
        grpc.StatusCode.UNAVAILABLE, "refused", "refused")
    assert hints_of(error) == (300, None, None)


def test_a_malformed_hint_is_no_hint():
    assert refusal(grpc.StatusCode.UNAVAILABLE, ("retry-after-ms", "soon")).retry_after_ms is None


@pytest.mark.parametrize(("hints", "line"), [
    ((("retry-after-ms", "300"),), "hint: retry after 300 ms"),
    ((("x-max-output-tokens-that-fit", "1000"),), "hint: lower --max-tokens to 1000"),
    ((("x-max-output-tokens-that-fit", "0"),), "hint: shorten the prompt (no output fits)"),
    ((("x-min-deadline-ms", "701"), ("x-max-output-tokens-that-fit", "14")),
     "hint: raise --deadline-ms to at least 701 or lower --max-tokens to 14"),
    ((("x-min-deadline-ms", "701"),), "hint: raise --deadline-ms to at least 701"),
    ((), None),
])
def test_the_cli_turns_the_hints_into_one_line_of_what_to_change(hints, line):
    assert cli.hint(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, *hints)) == line


# --- against the real admission ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def admission(sessionmaker: async_sessionmaker[AsyncSession], word_tokenizer: str,
                    **admission_keys: Any) -> AsyncIterator[str]:
    """Admission on a free loopback port with the test model; yields its address."""
    config = load_settings().updated(admission=admission_keys)
    async with sessionmaker() as session, session.begin():
        await add_model(session, word_tokenizer)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessionmaker, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await admission.close()


async def tenant_key(sessionmaker: async_sessionmaker[AsyncSession], **kwargs: Any) -> str:
    async with sessionmaker() as session, session.begin():
        return (await add_tenant(session, f"acme-{uuid.uuid4().hex[:6]}", **kwargs)).api_key


async def refused(call: Any) -> SluiceError:
    with pytest.raises(SluiceError) as caught:
        await call
    return caught.value


async def sluice(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv), io.StringIO())


@pytest.mark.integration
async def test_a_budget_refusal_carries_the_output_cap_that_fits(sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker, token_budget=50_000, used_tokens=40_000)  # 10,000 left
    async with admission(sessionmaker, word_tokenizer) as address, SluiceClient(address, key) as client:
        error = await refused(client.submit(prompt_of(9_000), model=MODEL, max_output_tokens=2_000))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == errors.BUDGET_TOO_SMALL_FOR_CAP.format(
        tokens_left=10_000, cost_left_micros=1_000 * MICROS, prompt=9_000, cap=2_000, fit=1_000)
    assert hints_of(error) == (None, 1_000, None)


@pytest.mark.integration
async def test_an_infeasible_deadline_carries_the_least_deadline_and_the_cap_that_would_do(
        sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    async with admission(sessionmaker, word_tokenizer, expected_ms_per_output_token=7.0,
                         expected_ms_per_prompt_token=0.03) as address, SluiceClient(address, key) as client:
        # Floor: prefill of 10 tokens (0.3 → 1 ms) + 100 tokens x 7 ms = 701 ms; 100 ms fits 14 tokens.
        error = await refused(client.submit(prompt_of(10), model=MODEL, max_output_tokens=100,
                                            deadline_ms=100))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert hints_of(error) == (None, 14, 701)


@pytest.mark.integration
async def test_a_shed_submit_carries_the_time_the_backlog_needs_to_drain(sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    async with admission(sessionmaker, word_tokenizer, max_backlog_per_pool=1,
                         pool_drain_runs_per_s=2.0) as address, SluiceClient(address, key) as client:
        await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)   # the backlog: 1 waiting run
        error = await refused(client.submit(prompt_of(10), model=MODEL, max_output_tokens=4))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert hints_of(error) == (500, None, None)


@pytest.mark.integration
async def test_sluice_chat_refused_by_the_budget_prints_the_message_then_the_hint(
        sessionmaker, word_tokenizer, capsys):
    key = await tenant_key(sessionmaker, token_budget=50_000, used_tokens=40_000)
    async with admission(sessionmaker, word_tokenizer) as address:
        code = await sluice("chat", prompt_of(9_000), "--model", MODEL, "--max-tokens", "2000",
                            "--api-key", key, "--address", address)
    assert code == cli.EXIT_RPC_ERROR
    assert capsys.readouterr().err.splitlines() == [
        "sluice: RESOURCE_EXHAUSTED: " + errors.BUDGET_TOO_SMALL_FOR_CAP.format(
            tokens_left=10_000, cost_left_micros=1_000 * MICROS, prompt=9_000, cap=2_000, fit=1_000),
        "hint: lower --max-tokens to 1000"]


@pytest.mark.integration
async def test_sluice_chat_with_an_infeasible_deadline_hints_both_ways_out(
        sessionmaker, word_tokenizer, capsys):
    key = await tenant_key(sessionmaker)
    async with admission(sessionmaker, word_tokenizer, expected_ms_per_output_token=7.0,
                         expected_ms_per_prompt_token=0.03) as address:
        code = await sluice("chat", prompt_of(10), "--model", MODEL, "--max-tokens", "100",
                            "--deadline-ms", "100", "--api-key", key, "--address", address)
    assert code == cli.EXIT_RPC_ERROR
    assert capsys.readouterr().err.splitlines()[1:] == [
        "hint: raise --deadline-ms to at least 701 or lower --max-tokens to 14"]


def chat_args(key: str, address: str, *extra: str) -> Any:
    return cli._parser().parse_args(["chat", prompt_of(10), "--model", MODEL, "--max-tokens", "4",
                                     "--api-key", key, "--address", address, *extra])


class Stderr(io.StringIO):
    """Captured text; `said` is set once `words` were written."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words
        self.said = asyncio.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.words in self.getvalue():
            self.said.set()
        return written


def shed_lines(retry_after_ms: int) -> list[str]:
    version = DEFAULT_MODEL.version
    message = errors.POOL_BACKLOG_FULL.format(model=version, backlog=1, pool=version, limit=1,
                                              retry_after_ms=retry_after_ms)
    return [f"sluice: UNAVAILABLE: {message}", f"hint: retry after {retry_after_ms} ms",
            f"sluice: retrying once in {retry_after_ms} ms"]


@pytest.mark.integration
async def test_chat_retry_waits_out_the_retry_after_and_is_admitted_once_the_backlog_drained(
        sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    err = Stderr("retrying once")
    async with admission(sessionmaker, word_tokenizer, max_backlog_per_pool=1,
                         pool_drain_runs_per_s=2.0) as address, SluiceClient(address, key) as client:
        waiting = await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
        retried = asyncio.create_task(cli.submit_chat(client, chat_args(key, address, "--retry"), err))
        await asyncio.wait_for(err.said.wait(), 30)   # generous: the first refusal on a box at load 15+
        async with sessionmaker() as session, session.begin():   # a routing worker claims the backlog
            await session.execute(update(Run).where(Run.id == uuid.UUID(waiting.run_id))
                                  .values(status=RunStatus.QUEUED))
        run = await retried
    assert run.run_id != waiting.run_id
    assert err.getvalue().splitlines() == shed_lines(500)
    assert await count_runs(sessionmaker) == 2


@pytest.mark.integration
async def test_chat_retry_gives_up_after_one_retry(sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    err = io.StringIO()
    async with admission(sessionmaker, word_tokenizer, max_backlog_per_pool=1,
                         pool_drain_runs_per_s=20.0) as address, SluiceClient(address, key) as client:
        await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
        error = await refused(cli.submit_chat(client, chat_args(key, address, "--retry"), err))
    assert (error.code(), error.retry_after_ms) == (grpc.StatusCode.UNAVAILABLE, 50)
    assert err.getvalue().splitlines() == shed_lines(50)
    assert await count_runs(sessionmaker) == 1


@pytest.mark.integration
async def test_chat_without_retry_is_refused_at_once(sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    err = io.StringIO()
    async with admission(sessionmaker, word_tokenizer, max_backlog_per_pool=1,
                         pool_drain_runs_per_s=2.0) as address, SluiceClient(address, key) as client:
        await client.submit(prompt_of(10), model=MODEL, max_output_tokens=4)
        error = await refused(cli.submit_chat(client, chat_args(key, address), err))
    assert error.retry_after_ms == 500 and err.getvalue() == ""


# --- the same refusals as google.rpc.Status details (any language's client reads these) ------------


def details_of(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    """The google.rpc.Status beside the trailing metadata, decoded with grpcio-status."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no grpc-status-details-bin"
    assert (status.code, status.message) == (error.code().value[0], error.details())
    found: dict[str, Any] = {}
    for packed in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo,
                     error_details_pb2.QuotaFailure, error_details_pb2.BadRequest):
            if packed.Is(kind.DESCRIPTOR):
                detail = kind()
                packed.Unpack(detail)
                found[kind.__name__] = detail
    return found


@pytest.mark.integration
async def test_a_budget_refusal_decodes_as_quota_failure_and_error_info_with_the_cap_that_fits(
        sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker, token_budget=50_000, used_tokens=40_000)  # 10,000 left
    async with admission(sessionmaker, word_tokenizer) as address, SluiceClient(address, key) as client:
        error = await refused(client.submit(prompt_of(9_000), model=MODEL, max_output_tokens=2_000))
    details = details_of(error)
    assert details["ErrorInfo"].reason == "BUDGET_EXCEEDED" and details["ErrorInfo"].domain == "sluice"
    assert dict(details["ErrorInfo"].metadata) == {"max_output_tokens_that_fit": "1000"}
    [violation] = details["QuotaFailure"].violations
    assert (violation.subject, violation.description) == ("budget_exceeded", error.details())
    assert "RetryInfo" not in details


@pytest.mark.integration
async def test_a_rate_limited_submit_decodes_as_resource_exhausted_with_retry_info(
        sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker, tokens_per_minute=100)
    async with admission(sessionmaker, word_tokenizer) as address, SluiceClient(address, key) as client:
        await client.submit(prompt_of(10), model=MODEL, max_output_tokens=50)      # 60 of 100 this minute
        error = await refused(client.submit(prompt_of(10), model=MODEL, max_output_tokens=50))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = details_of(error)
    assert details["ErrorInfo"].reason == "TOKENS_PER_MINUTE"
    delay = details["RetryInfo"].retry_delay
    assert delay.ToMilliseconds() == error.retry_after_ms > 0
    assert details["QuotaFailure"].violations[0].subject == "tokens_per_minute"


@pytest.mark.integration
async def test_a_bad_field_decodes_as_bad_request_naming_it(sessionmaker, word_tokenizer):
    key = await tenant_key(sessionmaker)
    async with admission(sessionmaker, word_tokenizer) as address, SluiceClient(address, key) as client:
        error = await refused(client.submit(prompt_of(10), model=MODEL, max_output_tokens=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = details_of(error)["BadRequest"].field_violations
    assert (violation.field, violation.description) == ("max_output_tokens", error.details())


@pytest.mark.integration
async def test_a_field_the_rpc_edge_refuses_decodes_as_bad_request_naming_it(sessionmaker, word_tokenizer):
    """services/validation.py's refusals, before admission runs: the field's dotted path."""
    key = await tenant_key(sessionmaker)
    async with admission(sessionmaker, word_tokenizer) as address, SluiceClient(address, key) as client:
        error = await refused(client.submit(prompt_of(10), model="m" * 300, max_output_tokens=4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == validation.FIELD_TOO_LONG.format(field="model", length=300, unit="characters",
                                                               limit=256)
    details = details_of(error)
    [violation] = details["BadRequest"].field_violations
    assert (violation.field, violation.description) == ("model", error.details())
    assert details["ErrorInfo"].reason == validation.FIELD_REASON


@pytest.mark.integration
async def test_an_undecodable_body_decodes_as_error_info_without_a_field(sessionmaker, word_tokenizer):
    async with admission(sessionmaker, word_tokenizer) as address, \
            grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.unary_unary("/sluice.v1.Admission/Submit")(b"\xff\xff\xff")
    details = details_of(raised.value)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details["ErrorInfo"].reason == validation.UNDECODABLE_REASON
    assert "BadRequest" not in details
