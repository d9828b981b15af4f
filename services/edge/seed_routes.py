"""Seed 002's API under /v1: inference, runs (get, events replay + follow, cancel), usage."""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from sluice.services.admission_rules import Sampling, SubmitIntent, normalize_float
from sluice.services.auth import Metadata
from sluice.services.edge.bodies import InferenceBody, parse_body
from sluice.services.edge.errors import (
    CONFLICTING_ARGUMENTS,
    INVALID_ARGUMENT,
    MISSING_REQUEST_KEY,
    ErrorReply,
    InvalidField,
)
from sluice.services.edge.shapes import admitted_json, event_json, run_json
from sluice.services.edge.sse import LAST_EVENT_ID, frame, parse_cursor, resume_cursor, wants_sse
from sluice.services.edge.web import (
    IDEMPOTENCY_KEY_HEADER,
    RUN_ID_HEADER,
    EdgeServices,
    caller,
    edge_of,
    events_until_closed,
    framed_errors,
    http_errors,
    json_reply,
    read_body,
    sse_response,
)
from sluice.services.usage import Totals, UsageReport
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.traffic.fallback import Condition, Narrowing
from sluice.traffic.priority import Priority
from sluice.v1 import runs_pb2

CSV_MEDIA_TYPE = "text/csv"
DEFAULT_PAGE = 1_000
MAX_PAGE = 10_000
USAGE_CSV_COLUMNS = ("day", "model_version", "runs", "input_tokens", "cached_input_tokens",
                     "output_tokens", "cost_micros")


def request_key(in_body: str | None, header: str | None, body_field: str) -> str | None:
    if in_body is not None and header is not None and in_body != header:
        raise InvalidField(CONFLICTING_ARGUMENTS.format(first=body_field, second="Idempotency-Key"),
                           body_field)
    return in_body if in_body is not None else header


def deadline_ms(body: InferenceBody, now_s: float) -> int:
    """The relative deadline admission takes (0 = its default) from `deadline` or `deadlineMs`."""
    if body.deadline is not None and body.deadlineMs is not None:
        raise InvalidField(CONFLICTING_ARGUMENTS.format(first="deadline", second="deadlineMs"), "deadlineMs")
    if body.deadlineMs is not None:
        return body.deadlineMs
    if body.deadline is None:
        return 0
    if body.deadline.tzinfo is None:
        raise InvalidField(INVALID_ARGUMENT.format(param="deadline", detail="give a time zone (e.g. Z)"),
                           "deadline")
    left_ms = math.floor((body.deadline.timestamp() - now_s) * 1000)
    if left_ms <= 0:
        raise InvalidField(INVALID_ARGUMENT.format(param="deadline", detail="it is in the past"), "deadline")
    return left_ms


def error_event(reply: ErrorReply) -> bytes:
    return frame(reply.body, event="error")


async def run_event_frames(edge: EdgeServices, metadata: Metadata, run_id: str,
                           after: int) -> AsyncIterator[bytes]:
    async for event in edge.runs.stream(metadata, run_id, after):
        data = event_json(event)
        yield frame(data, event=data["type"], event_id=event.sequence)


def stream_run(edge: EdgeServices, metadata: Metadata, run_id: str, after: int,
               headers: dict[str, str]) -> Response:
    frames = run_event_frames(edge, metadata, run_id, after)
    return sse_response(framed_errors(frames, "runs.events", error_event), {RUN_ID_HEADER: run_id, **headers})


@http_errors
async def inference(request: Request) -> Response:
    edge = edge_of(request)
    body = parse_body(await read_body(request, edge.settings.max_body_bytes), InferenceBody)
    key = request_key(body.requestKey, request.headers.get(IDEMPOTENCY_KEY_HEADER), "requestKey")
    if key is None:
        raise InvalidField(MISSING_REQUEST_KEY, "requestKey")
    metadata = caller(request)
    intent = SubmitIntent(
        model=body.model, input=body.input.encode(), max_output_tokens=body.maxOutputTokens, request_key=key,
        deadline_ms=deadline_ms(body, time.time()),
        sampling=Sampling(temperature=normalize_float(body.sampling.temperature),
                          top_p=normalize_float(body.sampling.topP), seed=body.sampling.seed),
        conversation_id=body.conversationId, priority=Priority(body.priority),
        fallback=Narrowing(refuse=body.fallback.refuse,
                           models=frozenset(name for name in body.fallback.models if name),
                           conditions=frozenset(Condition(c) for c in body.fallback.conditions)))
    admitted = await edge.admission.submit(metadata, intent)
    run_id = str(admitted.run_id)
    location = {"location": f"/v1/runs/{run_id}"}
    if wants_sse(request.headers.get("accept")):
        # A retried POST (same requestKey) that sends Last-Event-ID resumes the same run's stream.
        after = resume_cursor(None, request.headers.get(LAST_EVENT_ID))
        return stream_run(edge, metadata, run_id, after, location)
    return json_reply(admitted_json(admitted), 202, {RUN_ID_HEADER: run_id, **location})


@http_errors
async def get_run(request: Request) -> Response:
    edge = edge_of(request)
    run = await edge.runs.get_run(caller(request), request.path_params["run_id"])
    return json_reply(run_json(run), headers={RUN_ID_HEADER: run.run_id})


@http_errors
async def run_events(request: Request) -> Response:
    edge = edge_of(request)
    metadata, run_id = caller(request), request.path_params["run_id"]
    after = resume_cursor(request.query_params.get("after"), request.headers.get(LAST_EVENT_ID))
    # Looked up first so that a run another tenant owns is a 404 status, not an error mid-stream.
    run = await edge.runs.get_run(metadata, run_id)
    if wants_sse(request.headers.get("accept")):
        return stream_run(edge, metadata, run.run_id, after, {})
    limit = min(parse_cursor(request.query_params.get("limit"), "limit") or DEFAULT_PAGE, MAX_PAGE)
    events = await retained_page(edge, metadata, run, after, limit)
    return json_reply({"runId": run.run_id, "after": after, "events": [event_json(e) for e in events],
                       "lastSequence": run.last_sequence, "status": run_json(run)["status"]},
                      headers={RUN_ID_HEADER: run.run_id})


async def retained_page(edge: EdgeServices, metadata: Metadata, run: runs_pb2.Run, after: int,
                        limit: int) -> list[runs_pb2.RunEvent]:
    """Events after `after` that were durable when the run was read (at most `limit`): a page
    that never waits for events still to come."""
    upto = min(run.last_sequence, after + limit)
    page: list[runs_pb2.RunEvent] = []
    if upto <= after:
        return page
    async with events_until_closed(edge, metadata, run.run_id, after) as events:
        async for event in events:
            page.append(event)
            if event.sequence >= upto:
                break
    return page


@http_errors
async def cancel_run(request: Request) -> Response:
    edge = edge_of(request)
    response = await edge.runs.cancel(caller(request), request.path_params["run_id"])
    run_id = response.run_id
    return json_reply({"runId": run_id, "status": run_json(runs_pb2.Run(status=response.status))["status"]},
                      202, {RUN_ID_HEADER: run_id})


@http_errors
async def usage(request: Request) -> Response:
    edge = edge_of(request)
    query = request.query_params
    report = await edge.usage.report(caller(request), query.get("from", ""), query.get("to", ""))
    if CSV_MEDIA_TYPE in request.headers.get("accept", "") or query.get("format") == "csv":
        return Response(usage_csv(report), media_type=CSV_MEDIA_TYPE)
    return json_reply(usage_report_json(report))


def _totals(totals: Totals) -> dict[str, int]:
    return {"runs": totals.runs, "inputTokens": totals.input_tokens,
            "cachedInputTokens": totals.cached_input_tokens, "outputTokens": totals.output_tokens,
            "costMicros": totals.cost_micros}


def usage_report_json(report: UsageReport) -> dict[str, Any]:
    return {"tenant": report.tenant, "from": report.from_date.isoformat(), "to": report.to_date.isoformat(),
            "rows": [{"day": row.day.isoformat(), "modelVersion": row.model_version, **_totals(row.settled)}
                     for row in report.rows],
            "settledTotal": _totals(report.settled_total),
            "inFlight": {"runs": report.in_flight.runs, "reservedTokens": report.in_flight.reserved_tokens,
                         "reservedCostMicros": report.in_flight.reserved_cost_micros},
            "budget": {"tokens": report.budget_tokens, "costMicros": report.budget_cost_micros}}


def usage_csv(report: UsageReport) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(USAGE_CSV_COLUMNS)
    for row in report.rows:
        s = row.settled
        writer.writerow([row.day.isoformat(), row.model_version, s.runs, s.input_tokens,
                         s.cached_input_tokens, s.output_tokens, s.cost_micros])
    return out.getvalue()


ROUTES = [
    Route("/v1/inference", inference, methods=["POST"]),
    Route("/v1/runs/{run_id}", get_run, methods=["GET"]),
    Route("/v1/runs/{run_id}", cancel_run, methods=["DELETE"]),
    Route("/v1/runs/{run_id}/events", run_events, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
]
