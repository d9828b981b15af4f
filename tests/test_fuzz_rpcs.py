"""Property: whatever a caller sends to any RPC, the answer is a documented status, a refusal
writes nothing to the ledger, no traceback reaches the log, and the server keeps answering.

Requests are drawn field by field from each message (Admission, Runs, UsageService, Routing):
strings with NUL and other control characters, over-long strings, integers across their whole
wire range (int32, int64, uint64), floats including NaN and infinities, random bytes as whole
bodies. `make test` runs a quick slice (SLUICE_FUZZ_EXAMPLES, default 40 per property);
`make fuzz` runs 400 per property.
"""

from __future__ import annotations

import asyncio
import os
import string
import uuid
from collections.abc import Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sluice.services import validation

from sluice.config import load_settings
from sluice.v1 import admission_pb2, routing_pb2, runs_pb2, usage_pb2
from tests.support.fuzz_target import DOCUMENTED, STREAMING, UNARY, FuzzTarget, serve_everything
from tests.support.ledger_factories import add_model, add_tenant

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck))

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 10**16, 2**63 - 1, -(2**63)])
TEXT = st.one_of(
    st.text(max_size=40),
    st.builds(lambda head, tail: f"{head}\0{tail}", st.text(max_size=8), st.text(max_size=8)),
    st.sampled_from(["", "\0", "key\0", "a\x00b", "\ud7ff", "\x7f\x1b[2J", "test", "chat", "x" * 129]),
    st.text(min_size=200, max_size=6_000),
)
METADATA_VALUE = st.text(alphabet=string.ascii_letters + string.digits + "-_ ", max_size=60)


@pytest.fixture
async def target(sessionmaker, database_dsn, word_tokenizer):
    config = load_settings().updated(database={"dsn": database_dsn}, replicas=[])
    async with sessionmaker() as session, session.begin():
        await add_model(session, word_tokenizer)
        tenant = await add_tenant(session, "acme")
    async with serve_everything(sessionmaker, config) as served:
        served_keys = {"acme": tenant.api_key}
        yield served, served_keys


def metadata_choices(api_key: str) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    return st.one_of(
        st.just((("x-api-key", api_key),)),
        st.just(()),
        METADATA_VALUE.map(lambda value: (("x-api-key", value),)),
        METADATA_VALUE.map(lambda value: (("authorization", f"Bearer {value}"),)),
    )


def check_call(served: FuzzTarget, method: str, body: bytes, metadata: tuple[tuple[str, str], ...]) -> None:
    before = served.counts()
    status = served.call(method, body, metadata)
    assert status in DOCUMENTED, f"{method} answered {status.name}"
    if status is not grpc.StatusCode.OK:
        assert served.counts() == before, f"{method} refused ({status.name}) but the ledger changed"


async def fuzz(served: FuzzTarget, api_key: str, prove: Callable[[], None]) -> None:
    await asyncio.to_thread(prove)
    print(f"fuzz: {served.calls} calls, every status documented")   # make fuzz shows it (-s)
    answer = await asyncio.to_thread(served.call, "/sluice.v1.UsageService/GetUsage", b"",
                                     (("x-api-key", api_key),))
    assert answer is grpc.StatusCode.OK, "the server stopped answering"
    assert not served.log.records, [record.getMessage() for record in served.log.records]


async def test_bodies_that_are_not_protobuf_get_invalid_argument_on_every_rpc(target):
    served, keys = target

    @FUZZ
    @given(method=st.sampled_from(sorted(UNARY | STREAMING)), body=st.binary(min_size=1, max_size=300),
           metadata=metadata_choices(keys["acme"]))
    def prove(method: str, body: bytes, metadata: tuple[tuple[str, str], ...]) -> None:
        check_call(served, method, body, metadata)

    await fuzz(served, keys["acme"], prove)


# One field at a time off a valid request (so the odd value reaches the checks behind
# authentication and the model lookup), and whole requests drawn at random.
SUBMIT_BAD_VALUES: dict[str, st.SearchStrategy[object]] = {
    "model": TEXT,
    "input": st.one_of(st.binary(max_size=200), TEXT.map(lambda text: text.encode("utf-8", "surrogatepass"))),
    "max_output_tokens": st.one_of(INT32, EDGE_INTS.filter(lambda value: -(2**31) <= value < 2**31)),
    "request_key": TEXT,
    "deadline_ms": st.one_of(INT64, EDGE_INTS),
    "conversation_id": TEXT,
    "temperature": FLOAT32,
    "top_p": FLOAT32,
    "seed": UINT64,
}
SAMPLING_FIELDS = ("temperature", "top_p", "seed")


def submit_request(fields: dict[str, object]) -> admission_pb2.SubmitRequest:
    sampling = {name: fields.pop(name) for name in SAMPLING_FIELDS if name in fields}
    base: dict[str, object] = {"model": "test", "input": b"alpha bravo", "max_output_tokens": 4,
                               "request_key": uuid.uuid4().hex}
    return admission_pb2.SubmitRequest(**{**base, **fields},  # type: ignore[arg-type]
                                       sampling=admission_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]


SUBMITS = st.one_of(
    st.sampled_from(sorted(SUBMIT_BAD_VALUES)).flatmap(
        lambda name: SUBMIT_BAD_VALUES[name].map(lambda value: submit_request({name: value}))),
    st.fixed_dictionaries({}, optional=SUBMIT_BAD_VALUES).map(submit_request),
)


async def test_submit_with_any_field_values(target):
    served, keys = target

    @FUZZ
    @given(request=SUBMITS, metadata=st.one_of(st.just((("x-api-key", keys["acme"]),)),
                                               metadata_choices(keys["acme"])))
    def prove(request: admission_pb2.SubmitRequest, metadata: tuple[tuple[str, str], ...]) -> None:
        check_call(served, "/sluice.v1.Admission/Submit", request.SerializeToString(), metadata)

    await fuzz(served, keys["acme"], prove)


async def test_runs_with_any_field_values(target):
    served, keys = target
    metadata = (("x-api-key", keys["acme"]),)
    body = admission_pb2.SubmitRequest(model="test", input=b"alpha bravo", max_output_tokens=4,
                                       request_key="fuzz").SerializeToString()
    accepted = await asyncio.to_thread(served.call, "/sluice.v1.Admission/Submit", body, metadata)
    assert accepted is grpc.StatusCode.OK
    run_ids = st.one_of(TEXT, st.uuids().map(str))
    calls = st.one_of(
        st.builds(lambda run_id: ("/sluice.v1.Runs/GetRun", runs_pb2.GetRunRequest(run_id=run_id)), run_ids),
        st.builds(lambda run_id: ("/sluice.v1.Runs/Cancel", runs_pb2.CancelRequest(run_id=run_id)), run_ids),
        st.builds(lambda run_id, after: ("/sluice.v1.Runs/Stream", runs_pb2.StreamRequest(run_id=run_id,
                                                                                          after=after)),
                  run_ids, st.one_of(INT64, EDGE_INTS)),
    )

    @FUZZ
    @given(call=calls, metadata=metadata_choices(keys["acme"]))
    def prove(call: tuple[str, object], metadata: tuple[tuple[str, str], ...]) -> None:
        method, request = call
        check_call(served, method, request.SerializeToString(), metadata)  # type: ignore[attr-defined]

    await fuzz(served, keys["acme"], prove)


async def test_usage_with_any_dates(target):
    served, keys = target
    dates = st.one_of(TEXT, st.dates().map(lambda day: day.isoformat()),
                      st.sampled_from(["0001-01-01", "9999-12-31", "2026-02-30", "2026-13-01"]))

    @FUZZ
    @given(start=dates, end=dates, metadata=metadata_choices(keys["acme"]))
    def prove(start: str, end: str, metadata: tuple[tuple[str, str], ...]) -> None:
        request = usage_pb2.GetUsageRequest(from_date=start, to_date=end)
        check_call(served, "/sluice.v1.UsageService/GetUsage", request.SerializeToString(), metadata)

    await fuzz(served, keys["acme"], prove)


async def test_routing_with_any_field_values(target):
    served, keys = target
    replicas = st.builds(routing_pb2.Replica, name=TEXT, pool=TEXT, grpc_address=TEXT, metrics_url=TEXT,
                         block_size=INT32, kv_capacity_blocks=INT64, long_context=st.booleans())
    calls = st.one_of(
        st.builds(lambda replica: ("/sluice.v1.Routing/UpsertReplica", replica), replicas),
        st.builds(lambda name: ("/sluice.v1.Routing/RemoveReplica",
                                routing_pb2.RemoveReplicaRequest(name=name)), TEXT),
        st.builds(lambda version, ids, conversation: (
            "/sluice.v1.Routing/Explain",
            routing_pb2.ExplainRequest(model_version=version, token_ids=ids, conversation_id=conversation)),
            st.one_of(st.just("test-model-v1"), TEXT), st.lists(INT32, max_size=300), TEXT),
        st.just(("/sluice.v1.Routing/ListReplicas", routing_pb2.ListReplicasRequest())),
    )

    @FUZZ
    @given(call=calls)
    def prove(call: tuple[str, object]) -> None:
        method, request = call
        # A tenant key: Explain predicts within the caller's trust scope (the registry calls take none).
        metadata = (("x-api-key", keys["acme"]),)
        check_call(served, method, request.SerializeToString(), metadata)  # type: ignore[attr-defined]

    await fuzz(served, keys["acme"], prove)


async def test_refusals_name_the_field_and_the_message_says_what_to_change(target):
    """The exact answers the issue's malformed calls now get (each was UNKNOWN or INTERNAL)."""
    served, keys = target
    metadata = (("x-api-key", keys["acme"]),)
    channel = grpc.aio.insecure_channel(served.address)

    async def refusal(method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(method)(body, metadata=metadata)
        return caught.value.code(), caught.value.details() or ""

    def submit(**fields: object) -> bytes:
        base: dict[str, object] = {"model": "test", "input": b"alpha", "max_output_tokens": 4,
                                   "request_key": uuid.uuid4().hex}
        return admission_pb2.SubmitRequest(**{**base, **fields}).SerializeToString()  # type: ignore[arg-type]

    submit_rpc = "/sluice.v1.Admission/Submit"
    code, details = await refusal(submit_rpc, b"\xff\xff\xff")
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("request body is not a valid sluice.v1.SubmitRequest (")
    for name in ("request_key", "model", "conversation_id"):
        assert await refusal(submit_rpc, submit(**{name: "ab\0c"})) == (
            grpc.StatusCode.INVALID_ARGUMENT, validation.FIELD_HAS_NUL.format(field=name, position=2))
    # The edge's bound is the longest deadline any priority class may have (batch: [traffic]).
    longest = max(validation.DEFAULT_MAX_DEADLINE_MS, load_settings().traffic.max_batch_deadline_ms)
    for deadline in (2**63 - 1, 10**16):
        assert await refusal(submit_rpc, submit(deadline_ms=deadline)) == (
            grpc.StatusCode.INVALID_ARGUMENT, validation.FIELD_ABOVE_RANGE.format(
                field="deadline_ms", high=longest, value=deadline))
    too_big = validation.DEFAULT_MAX_INPUT_BYTES + 1
    assert await refusal(submit_rpc, submit(input=b"a" * too_big)) == (
        grpc.StatusCode.INVALID_ARGUMENT, validation.FIELD_TOO_LONG.format(
            field="input", length=too_big, unit="bytes", limit=validation.DEFAULT_MAX_INPUT_BYTES))
    explain = routing_pb2.ExplainRequest(model_version="test\0").SerializeToString()
    assert await refusal("/sluice.v1.Routing/Explain", explain) == (
        grpc.StatusCode.INVALID_ARGUMENT, validation.FIELD_HAS_NUL.format(field="model_version", position=4))
    await channel.close()
    assert (await asyncio.to_thread(served.counts)).runs == 0
    assert not served.log.records
