"""The HTTP edge end to end on the real stack (PostgreSQL, Kafka, Triton replicas) over real HTTP:
the official `openai` client, seed 002's REST + SSE routes, resume by Last-Event-ID, cancel,
tenant isolation, idempotency, and the seed's budget example. One run, one ledger row, one
reservation, one event log, whichever door a request came through."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sluice.ledger.models import RunStatus, UsageEntry
from sluice.services import tokenization
from sluice.services.errors import BUDGET_TOO_SMALL_FOR_CAP
from sqlalchemy import select

from tests.support.edge_stack import Edge, SseEvent, bearer, iter_sse, sse_events
from tests.support.ledger_factories import MICROS, ModelSpec, add_model, add_tenant, budget_row, count_runs
from tests.support.routing_stack import TOKENIZER

pytestmark = pytest.mark.integration

SSE = {"accept": "text/event-stream"}
# Deltas produced within [kafka].coalesce_ms share an event, and on a loaded box tokens arrive in
# bursts: a cap well above 35 tokens still leaves more than 35 events to drop and resume after.
CAP_PAST_35 = 150


def inference_body(cap: int, key: str | None = None, prompt: str = "Tell me about sluice gates.") -> dict:
    body: dict = {"model": "chat", "input": prompt, "maxOutputTokens": cap}
    if key is not None:
        body["requestKey"] = key
    return body


async def full_replay(edge: Edge, api_key: str, run_id: str) -> list[SseEvent]:
    async with edge.http.get(f"{edge.url}/v1/runs/{run_id}/events", headers=bearer(api_key, **SSE)) as reply:
        assert reply.status == 200
        return await asyncio.wait_for(sse_events(reply), 30)


def delta_text(events: list[SseEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "delta")


# --- the official openai client -----------------------------------------------------------------


async def test_the_openai_client_streams_a_chat_completion_and_reads_its_usage(edge: Edge):
    await edge.stack.start_worker()
    client = edge.openai(edge.stack.tenant.api_key)
    stream = await client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Why do rivers meander?"}], max_tokens=24,
        stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    run_id = chunks[0].id.removeprefix("chatcmpl-")
    # The prompt admission saw is tiny-chat's template around the one user message.
    rendered = "<|user|>Why do rivers meander?\n<|assistant|>"
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == len(tokenization.encode(TOKENIZER, rendered))
    assert usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24
    assert finishes == ["length"]                  # the replica streams exactly the cap
    assert text == delta_text(await full_replay(edge, edge.stack.tenant.api_key, run_id))
    assert (await edge.stack.wait_for_published(run_id)).status == RunStatus.COMPLETED


async def test_the_openai_client_reads_a_whole_chat_completion(edge: Edge):
    await edge.stack.start_worker()
    client = edge.openai(edge.stack.tenant.api_key)
    completion = await client.chat.completions.create(
        model="chat", max_completion_tokens=10, seed=7,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    run_id = completion.id.removeprefix("chatcmpl-")
    assert completion.usage is not None and completion.usage.completion_tokens == 10
    assert completion.choices[0].message.content == delta_text(
        await full_replay(edge, edge.stack.tenant.api_key, run_id))


async def test_responses_retrieve_streaming_after_35_yields_exactly_the_events_after_35(edge: Edge):
    await edge.stack.start_worker()
    client = edge.openai(edge.stack.tenant.api_key)
    created = await client.responses.create(model="chat", input="Tell me about sluice gates.",
                                            background=True, max_output_tokens=CAP_PAST_35)
    assert created.status == "queued" and created.id.startswith("resp_")

    stream = await client.responses.retrieve(created.id, stream=True, starting_after=35)
    events = [event async for event in stream]

    run_id = str(uuid.UUID(hex=created.id.removeprefix("resp_")))
    replay = await full_replay(edge, edge.stack.tenant.api_key, run_id)
    last = replay[-1].id
    assert [e.sequence_number for e in events] == list(range(36, last + 1))
    assert all(e.type == "response.output_text.delta" for e in events[:-1])
    after_35 = [e.data["text"] for e in replay if e.id > 35 and e.event == "delta"]
    assert [e.delta for e in events[:-1]] == after_35
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output_text == delta_text(replay)      # the whole answer, not just after 35
    assert final.response.usage.output_tokens == CAP_PAST_35
    retrieved = await client.responses.retrieve(created.id)
    assert (retrieved.status, retrieved.output_text) == ("completed", delta_text(replay))


# --- seed 002's worked budget example -----------------------------------------------------------


async def test_seed_002_10000_left_a_9000_token_prompt_and_cap_2000_get_429_offering_1000(
        edge: Edge, word_tokenizer: str):
    stack = edge.stack
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, word_tokenizer, ModelSpec())          # "test": exact word counts
        tenant = await add_tenant(session, "initech", token_budget=50_000, used_tokens=40_000)  # 10,000 left
    before = await budget_row(stack.sessionmaker, tenant.id)
    prompt = " ".join(["alpha"] * 9_000)

    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(tenant.api_key),
                              json={"model": "test", "input": prompt, "maxOutputTokens": 2_000,
                                    "requestKey": "seed-002"}) as reply:
        status, error = reply.status, (await reply.json())["error"]

    assert status == 429
    assert error == {
        "message": BUDGET_TOO_SMALL_FOR_CAP.format(tokens_left=10_000, cost_left_micros=1_000 * MICROS,
                                                   prompt=9_000, cap=2_000, fit=1_000),
        "type": "insufficient_quota", "param": None, "code": "budget_exceeded",
        "max_output_tokens_that_fit": 1_000}
    # The OpenAI door refuses the same request the same way.
    import openai
    with pytest.raises(openai.RateLimitError) as caught:
        await edge.openai(tenant.api_key).completions.create(model="test", prompt=prompt, max_tokens=2_000)
    assert caught.value.body["max_output_tokens_that_fit"] == 1_000
    assert await budget_row(stack.sessionmaker, tenant.id) == before          # nothing reserved
    assert await count_runs(stack.sessionmaker, tenant.id) == 0               # nothing written


# --- SSE: resume, disconnect, cancel ------------------------------------------------------------


async def test_an_sse_client_dropped_after_event_35_resumes_with_last_event_id_and_gets_exactly_36_to_n(
        edge: Edge):
    await edge.stack.start_worker()
    api_key = edge.stack.tenant.api_key
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(api_key, **SSE),
                              json=inference_body(CAP_PAST_35, "resume-35")) as reply:
        assert reply.status == 200
        run_id = reply.headers["x-sluice-run-id"]
        seen = await asyncio.wait_for(sse_events(reply, limit=35), 30)
    # The connection is gone. A browser's EventSource reconnects to the same URL with Last-Event-ID.
    headers = bearer(api_key, **SSE, **{"last-event-id": "35"})
    async with edge.http.get(f"{edge.url}/v1/runs/{run_id}/events?after=0", headers=headers) as reply:
        resumed = await asyncio.wait_for(sse_events(reply), 30)
    replay = await full_replay(edge, api_key, run_id)

    assert [e.id for e in seen] == list(range(1, 36))
    assert [e.id for e in resumed] == list(range(36, replay[-1].id + 1))
    assert [e.data for e in seen + resumed] == [e.data for e in replay]
    assert resumed[-1].event == "terminal" and resumed[-1].data["status"] == "COMPLETED"
    # Dropping the stream did not cancel the run: it completed and was settled in full.
    run = await edge.stack.wait_for_published(run_id)
    assert (run.status, run.output_tokens) == (RunStatus.COMPLETED, CAP_PAST_35)


async def test_delete_mid_stream_ends_the_run_cancelled_with_the_consumed_tokens_charged(edge: Edge):
    stack = edge.stack
    await stack.start_worker()
    api_key = stack.tenant.api_key
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(api_key, **SSE),
                              json=inference_body(400, "cancel-me")) as reply:
        run_id = reply.headers["x-sluice-run-id"]
        events: list[SseEvent] = []
        async for event in iter_sse(reply):
            events.append(event)
            if len(events) == 10:
                url = f"{edge.url}/v1/runs/{run_id}"
                async with edge.http.delete(url, headers=bearer(api_key)) as cancel:
                    assert cancel.status == 202
                    assert (await cancel.json())["runId"] == run_id

    terminal = events[-1]
    streamed = sum(len(e.data["tokenIds"]) for e in events if e.event == "delta")
    assert terminal.event == "terminal" and terminal.data["status"] == "CANCELLED"
    assert 9 <= streamed < 400
    assert terminal.data["usage"]["outputTokens"] == streamed
    await stack.wait_for_published(run_id)
    async with stack.sessionmaker() as session:
        entry = await session.scalar(select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))
    assert entry is not None and entry.output_tokens == streamed
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert budget.reserved_tokens == 0 and budget.used_tokens == entry.input_tokens + streamed


# --- tenant isolation ---------------------------------------------------------------------------


async def test_another_tenant_gets_404_on_every_route_of_a_run_and_changes_nothing(edge: Edge):
    stack = edge.stack
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(stack.tenant.api_key),
                              json=inference_body(5, "mine")) as reply:
        run_id = (await reply.json())["runId"]
    response_id = "resp_" + uuid.UUID(run_id).hex
    routes = [("GET", f"/v1/runs/{run_id}", {}), ("GET", f"/v1/runs/{run_id}/events", {}),
              ("GET", f"/v1/runs/{run_id}/events", SSE), ("DELETE", f"/v1/runs/{run_id}", {}),
              ("GET", f"/v1/responses/{response_id}", {}),
              ("GET", f"/v1/responses/{response_id}?stream=true&starting_after=0", {}),
              ("POST", f"/v1/responses/{response_id}/cancel", {})]
    for method, path, extra in routes:
        async with edge.http.request(method, f"{edge.url}{path}",
                                     headers=bearer(stack.other.api_key, **extra)) as reply:
            body = await reply.json()
            assert (method, path, reply.status, body["error"]["code"]) == (method, path, 404, "not_found")
    async with edge.http.get(f"{edge.url}/v1/runs/{run_id}", headers=bearer(stack.tenant.api_key)) as reply:
        assert (await reply.json())["status"] == "ACCEPTED"                 # not cancelled by the other
    assert await count_runs(stack.sessionmaker) == 1


# --- bad input ----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
TEN_MB = b"a" * (10 * 1024 * 1024)
BAD_INPUT = [
    # (route, raw body, status, param, code)
    (CHAT, b'{"model": "chat", "messages": [', 400, None, "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": "hello"}', 400, "messages", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
     400, "max_tokens", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "colour": "red"}',
     400, "colour", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "tools": []}',
     400, "tools", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": []}', 400, "messages", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
     400, "max_tokens", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "tool", "content": "hi"}]}',
     400, "messages[0].role", "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "caf\xe9"}]}',
     400, None, "invalid_value"),
    (CHAT, b'{"model": "chat", "messages": [{"role": "user", "content": "' + TEN_MB + b'"}]}',
     413, None, "request_too_large"),
    (CHAT, b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, None, "not_found"),
    ("/v1/completions", b'{"model": "chat", "prompt": "hi", "max_tokens": 0}',
     400, "max_tokens", "invalid_value"),
    ("/v1/inference", b'{"model": "chat", "input": "hi", "maxOutputTokens": -3, "requestKey": "k"}',
     400, "maxOutputTokens", "invalid_value"),
    ("/v1/inference", b'{"model": "chat", "input": "", "maxOutputTokens": 3, "requestKey": "k"}',
     400, None, "invalid_value"),
    ("/v1/inference", b'{"model": "chat", "input": "hi", "maxOutputTokens": 3}',
     400, "requestKey", "invalid_value"),
    ("/v1/responses", b'{"model": "chat", "input": [], "background": true}', 400, "input", "invalid_value"),
    # A NUL (PostgreSQL text holds none) is refused naming the field, as the gRPC door does (not a 500)
    ("/v1/inference", b'{"model": "chat", "input": "hi", "maxOutputTokens": 3, "requestKey": "k\\u0000"}',
     400, "requestKey", "invalid_value"),
    (CHAT, b'{"model": "ch\\u0000at", "messages": [{"role": "user", "content": "hi"}]}',
     400, "model", "invalid_value"),
]


async def test_bad_input_gets_its_status_and_an_openai_shaped_error_and_writes_nothing(edge: Edge):
    stack = edge.stack
    for route, raw, status, param, code in BAD_INPUT:
        async with edge.http.post(f"{edge.url}{route}", data=raw,
                                  headers=bearer(stack.tenant.api_key, **{"content-type": "application/json"})
                                  ) as reply:
            error = (await reply.json())["error"]
            case = raw[:70]
            assert (case, reply.status, error["param"], error["code"]) == (case, status, param, code)
            assert error["type"] in ("invalid_request_error", "authentication_error") and error["message"]
    async with edge.http.post(f"{edge.url}{CHAT}", json={"model": "chat", "messages": HELLO}) as reply:
        assert (reply.status, (await reply.json())["error"]["code"]) == (401, "invalid_api_key")

    async def chunked_10_mb():                 # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b"a" * (1024 * 1024)

    async with edge.http.post(f"{edge.url}{CHAT}", data=chunked_10_mb(),
                              headers=bearer(stack.tenant.api_key)) as reply:
        assert (reply.status, (await reply.json())["error"]["code"]) == (413, "request_too_large")
    assert await count_runs(stack.sessionmaker) == 0
    assert (await budget_row(stack.sessionmaker, stack.tenant.id)).reserved_tokens == 0


# --- idempotency --------------------------------------------------------------------------------


async def test_20_concurrent_identical_posts_with_one_idempotency_key_make_one_run(edge: Edge):
    stack = edge.stack
    headers = bearer(stack.tenant.api_key, **{"idempotency-key": "twenty-as-one"})
    body = inference_body(7)

    async def post() -> tuple[int, dict]:
        async with edge.http.post(f"{edge.url}/v1/inference", headers=headers, json=body) as reply:
            return reply.status, await reply.json()

    replies = await asyncio.gather(*(post() for _ in range(20)))

    assert {status for status, _ in replies} == {202}
    assert len({reply["runId"] for _, reply in replies}) == 1
    assert sorted(reply["deduplicated"] for _, reply in replies) == [False] + [True] * 19
    assert await count_runs(stack.sessionmaker) == 1
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert budget.reserved_tokens == replies[0][1]["inputTokens"] + 7      # one reservation
    async with edge.http.post(f"{edge.url}/v1/inference", headers=headers, json=inference_body(8)) as reply:
        assert (reply.status, (await reply.json())["error"]["code"]) == (409, "idempotency_key_reused")


async def test_a_completions_request_with_the_key_of_an_inference_post_is_the_same_run(edge: Edge):
    stack = edge.stack
    await stack.start_worker()
    headers = bearer(stack.tenant.api_key, **SSE)
    async with edge.http.post(f"{edge.url}/v1/inference", headers=headers,
                              json=inference_body(12, "one-run", prompt="Sluice gates")) as reply:
        run_id = reply.headers["x-sluice-run-id"]
        first = delta_text(await asyncio.wait_for(sse_events(reply), 30))

    stream = await edge.openai(stack.tenant.api_key).completions.create(
        model="chat", prompt="Sluice gates", max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_headers={"Idempotency-Key": "one-run"})
    chunks = [chunk async for chunk in stream]

    assert {chunk.id for chunk in chunks} == {f"cmpl-{run_id}"}
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == first
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert await count_runs(stack.sessionmaker) == 1


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


async def test_chat_messages_are_billed_as_the_registry_template_renders_them_never_wrapped_twice(
        edge: Edge):
    """SmolLM2's tokenizer ships chat.json, which admission wraps a plain input in; a chat request
    is rendered at the door with the registry's template and must reach the model as it is."""
    stack = edge.stack
    tokenizer = "smollm2-135m-instruct/tokenizer.json"
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, tokenizer, ModelSpec(version="smol-v1", alias="smol", chat_template=CHATML))
    client = edge.openai(stack.tenant.api_key)
    created = await client.responses.create(model="smol", instructions="Be brief.", input="Why sluices?",
                                            background=True, max_output_tokens=8)
    run = await stack.run_row(str(uuid.UUID(hex=created.id.removeprefix("resp_"))))
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhy sluices?<|im_end|>\n" \
               "<|im_start|>assistant\n"
    exact = tokenization.load_tokenizer(tokenizer).encode(rendered, add_special_tokens=False).ids
    assert run.input_tokens == len(exact) and list(run.prompt_token_ids) == list(exact)


async def test_models_and_usage_read_the_same_ledger_as_the_grpc_door(edge: Edge):
    stack = edge.stack
    await stack.start_worker()
    api_key = stack.tenant.api_key
    models = [m.id for m in (await edge.openai(api_key).models.list()).data]
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(api_key, **SSE),
                              json=inference_body(9, "usage-1")) as reply:
        run_id = reply.headers["x-sluice-run-id"]
        await asyncio.wait_for(sse_events(reply), 30)
    run = await stack.wait_for_published(run_id)

    async with edge.http.get(f"{edge.url}/v1/usage", headers=bearer(api_key)) as reply:
        report = await reply.json()
    async with edge.http.get(f"{edge.url}/v1/usage", headers=bearer(api_key, accept="text/csv")) as reply:
        csv_lines = (await reply.text()).splitlines()

    assert models == ["tiny-chat-v1", "chat"]
    assert report["settledTotal"]["runs"] == 1
    assert (report["settledTotal"]["inputTokens"], report["settledTotal"]["outputTokens"]) \
        == (run.input_tokens, 9)
    assert report["inFlight"] == {"runs": 0, "reservedTokens": 0, "reservedCostMicros": 0}
    day = report["rows"][0]["day"]
    assert csv_lines == ["day,model_version,runs,input_tokens,cached_input_tokens,output_tokens,cost_micros",
                         f"{day},tiny-chat-v1,1,{run.input_tokens},0,9,{report['settledTotal']['costMicros']}"]


async def test_a_stop_string_ends_the_answer_before_it_and_the_run_is_cancelled_and_charged(edge: Edge):
    stack = edge.stack
    await stack.start_worker()
    client = edge.openai(stack.tenant.api_key)
    messages = [{"role": "user", "content": "Tell me about sluice gates."}]
    full = await client.chat.completions.create(model="chat", messages=messages, max_tokens=300, seed=3)
    text = full.choices[0].message.content or ""
    stop = text[40:46]                   # deterministic engine: the same request gives the same text
    cut = text.index(stop)

    stopped = await client.chat.completions.create(model="chat", messages=messages, max_tokens=300, seed=3,
                                                   stop=stop)

    run_id = stopped.id.removeprefix("chatcmpl-")
    assert stopped.choices[0].message.content == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    run = await stack.wait_for_published(run_id)
    assert run.status == RunStatus.CANCELLED and stopped.usage is not None
    assert 0 < run.output_tokens == stopped.usage.completion_tokens < 300


async def test_a_background_response_is_cancelled_through_the_openai_door(edge: Edge):
    stack = edge.stack
    await stack.start_worker()
    client = edge.openai(stack.tenant.api_key)
    created = await client.responses.create(model="chat", input="Tell me about sluice gates.",
                                            background=True, max_output_tokens=400)
    run_id = str(uuid.UUID(hex=created.id.removeprefix("resp_")))
    await stack.wait_for_status(run_id, {"RUNNING"})

    await client.responses.cancel(created.id)

    await stack.wait_for_published(run_id)
    final = await client.responses.retrieve(created.id)
    assert final.status == "cancelled"
    assert final.usage is not None and 0 < final.usage.output_tokens < 400
