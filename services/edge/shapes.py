"""Run events and runs as JSON: seed 002's camelCase shapes and the OpenAI objects. Pure.

Identifiers: the run id is the one identity. OpenAI objects wear it with their usual prefix
(`chatcmpl-<run id>`, `cmpl-<run id>`, `resp_<run id hex>`), and every response also carries
`x-sluice-run-id`, so an answer started through the OpenAI door can be resumed, cancelled or
audited through seed 002's routes.

Responses streaming maps run events one to one onto Responses events and keeps the sequence
number: `sequence_number` = the run event's sequence, so `starting_after=N` is exactly the run
stream `after=N`.

    run event                 Responses event
    STATUS QUEUED / RUNNING   response.queued / response.in_progress
    DELTA                     response.output_text.delta
    TERMINAL COMPLETED        response.completed
    TERMINAL CANCELLED, INTERRUPTED, EXPIRED   response.incomplete
    TERMINAL FAILED           response.failed
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sluice.services.admission import Admitted
from sluice.services.routes import route_message

from sluice.eventlog.events import status_name
from sluice.v1 import common_pb2, runs_pb2

EVENT_TYPE_NAMES = {runs_pb2.EVENT_TYPE_DELTA: "delta", runs_pb2.EVENT_TYPE_STATUS: "status",
                    runs_pb2.EVENT_TYPE_TERMINAL: "terminal"}
RESPONSE_ID_PREFIX = "resp_"

# --- seed 002 -------------------------------------------------------------------------------------


def usage_json(usage: common_pb2.TokenUsage) -> dict[str, int]:
    return {"inputTokens": usage.input_tokens, "cachedInputTokens": usage.cached_input_tokens,
            "outputTokens": usage.output_tokens, "costMicros": usage.cost_micros}


def event_json(event: runs_pb2.RunEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"runId": event.run_id, "sequence": event.sequence,
                           "type": EVENT_TYPE_NAMES.get(event.type, "unknown"), "timeMs": event.time_ms}
    if event.type == runs_pb2.EVENT_TYPE_DELTA:
        out["text"] = event.text
        out["tokenIds"] = list(event.token_ids)
    else:
        out["status"] = status_name(event.status)
    if event.HasField("route"):              # the run's first STATUS event carries the decision
        out["route"] = route_json(event.route)
    if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
        out["usage"] = usage_json(event.usage)
        out["detail"] = event.detail
    return out


def run_urls(run_id: str) -> dict[str, str]:
    return {"run": f"/v1/runs/{run_id}", "events": f"/v1/runs/{run_id}/events",
            "cancel": f"/v1/runs/{run_id}"}


def route_json(route: common_pb2.RouteDecision) -> dict[str, Any] | None:
    """Where the run went and why (a fallback is never silent); None for a run admitted before
    decisions were recorded."""
    if route.reason == common_pb2.ROUTE_REASON_UNSPECIFIED:
        return None
    return {"modelVersion": route.model_version, "pool": route.pool, "tier": route.tier,
            "reason": common_pb2.RouteReason.Name(route.reason).removeprefix("ROUTE_REASON_").lower(),
            "requestedModel": route.requested_model, "fallbackFrom": route.fallback_from or None,
            "detail": route.detail}


def admitted_json(admitted: Admitted) -> dict[str, Any]:
    run_id = str(admitted.run_id)
    return {"runId": run_id, "status": admitted.status.value, "modelVersion": admitted.model_version,
            "inputTokens": admitted.input_tokens, "maxOutputTokens": admitted.max_output_tokens,
            "deduplicated": admitted.deduplicated, "priority": admitted.priority.value,
            "route": route_json(route_message(admitted.route)), "urls": run_urls(run_id)}


def _ms_or_none(ms: int) -> int | None:
    return ms or None


def run_json(run: runs_pb2.Run) -> dict[str, Any]:
    return {"runId": run.run_id, "requestKey": run.request_key, "modelVersion": run.model_version,
            "status": status_name(run.status), "replica": run.replica or None,
            "inputTokens": run.input_tokens, "cachedInputTokens": run.cached_input_tokens,
            "maxOutputTokens": run.max_output_tokens, "usage": usage_json(run.usage),
            "createdAtMs": _ms_or_none(run.created_at_ms), "startedAtMs": _ms_or_none(run.started_at_ms),
            "finishedAtMs": _ms_or_none(run.finished_at_ms), "deadlineAtMs": _ms_or_none(run.deadline_at_ms),
            "lastSequence": run.last_sequence, "detail": run.detail or None, "route": route_json(run.route),
            "urls": run_urls(run.run_id)}


# --- OpenAI: chat completions and completions -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """What an OpenAI object says about one run's answer."""

    object_id: str                   # chatcmpl-… / cmpl-…
    created: int                     # unix seconds
    model: str                       # the version the run is pinned to
    max_output_tokens: int


def finish_reason(usage: common_pb2.TokenUsage, cap: int, stopped: bool) -> str:
    """`length` when the output cap ended the answer, else `stop` (end of text or a stop string)."""
    return "length" if not stopped and usage.output_tokens >= cap else "stop"


def openai_usage(usage: common_pb2.TokenUsage) -> dict[str, Any]:
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens}}


def chat_chunk(answer: Answer, delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
    return {"id": answer.object_id, "object": "chat.completion.chunk", "created": answer.created,
            "model": answer.model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(answer: Answer, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": answer.object_id, "object": "text_completion", "created": answer.created,
            "model": answer.model, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(answer: Answer, usage: common_pb2.TokenUsage, chat: bool) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {"id": answer.object_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.created, "model": answer.model, "system_fingerprint": None,
            "choices": [], "usage": openai_usage(usage)}


def chat_completion(answer: Answer, text: str, finish: str, usage: common_pb2.TokenUsage) -> dict[str, Any]:
    return {"id": answer.object_id, "object": "chat.completion", "created": answer.created,
            "model": answer.model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": finish}],
            "usage": openai_usage(usage)}


def text_completion(answer: Answer, text: str, finish: str, usage: common_pb2.TokenUsage) -> dict[str, Any]:
    return {"id": answer.object_id, "object": "text_completion", "created": answer.created,
            "model": answer.model, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": openai_usage(usage)}


# --- OpenAI: responses --------------------------------------------------------------------------

RESPONSE_STATUS = {"ACCEPTED": "queued", "QUEUED": "queued", "RUNNING": "in_progress",
                   "COMPLETED": "completed", "CANCELLED": "cancelled", "INTERRUPTED": "incomplete",
                   "EXPIRED": "incomplete", "FAILED": "failed"}
TERMINAL_EVENT = {"COMPLETED": "response.completed", "FAILED": "response.failed"}   # others: incomplete


def response_id(run_id: str) -> str:
    return RESPONSE_ID_PREFIX + uuid.UUID(run_id).hex


def run_id_of_response(object_id: str) -> str:
    """The run id inside `resp_<hex>`; anything else is passed on as it is (and is then not found)."""
    if object_id.startswith(RESPONSE_ID_PREFIX):
        try:
            return str(uuid.UUID(hex=object_id.removeprefix(RESPONSE_ID_PREFIX)))
        except ValueError:
            pass
    return object_id


@dataclass(frozen=True, slots=True)
class ResponseState:
    """A Responses object's view of one run at one moment."""

    run_id: str
    created_at: int                  # unix seconds
    model: str
    status: str                      # ledger status text
    max_output_tokens: int
    background: bool | None          # None: not known (a retrieve; the ledger does not keep it)
    text: str | None                 # the answer so far; None: not assembled (omitted from output)
    usage: common_pb2.TokenUsage | None
    detail: str = ""


def response_object(state: ResponseState) -> dict[str, Any]:
    status = RESPONSE_STATUS.get(state.status, "in_progress")
    output: list[dict[str, Any]] = []
    if state.text is not None:
        output.append({"type": "message", "id": _message_id(state.run_id), "role": "assistant",
                       "status": "completed" if status == "completed" else "in_progress",
                       "content": [{"type": "output_text", "text": state.text, "annotations": []}]})
    usage = None
    if state.usage is not None:
        usage = {"input_tokens": state.usage.input_tokens,
                 "input_tokens_details": {"cached_tokens": state.usage.cached_input_tokens},
                 "output_tokens": state.usage.output_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": state.usage.input_tokens + state.usage.output_tokens}
    error = None
    if status == "failed":
        error = {"code": "server_error", "message": state.detail or "the run failed"}
    incomplete = {"reason": state.status.lower()} if status == "incomplete" else None
    return {"id": response_id(state.run_id), "object": "response", "created_at": state.created_at,
            "status": status, "background": state.background, "model": state.model, "output": output,
            "usage": usage, "error": error, "incomplete_details": incomplete,
            "max_output_tokens": state.max_output_tokens, "instructions": None, "metadata": {},
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "temperature": None,
            "top_p": None, "text": {"format": {"type": "text"}}}


def _message_id(run_id: str) -> str:
    return "msg_" + uuid.UUID(run_id).hex


def response_event(event: runs_pb2.RunEvent, state: ResponseState) -> tuple[str, dict[str, Any]]:
    """The Responses event (type, JSON) for one run event; `state` is the response after it."""
    if event.type == runs_pb2.EVENT_TYPE_DELTA:
        kind = "response.output_text.delta"
        return kind, {"type": kind, "sequence_number": event.sequence, "item_id": _message_id(state.run_id),
                      "output_index": 0, "content_index": 0, "delta": event.text, "logprobs": []}
    if event.type == runs_pb2.EVENT_TYPE_TERMINAL:
        kind = TERMINAL_EVENT.get(state.status, "response.incomplete")
    else:
        kind = "response.queued" if state.status in ("ACCEPTED", "QUEUED") else "response.in_progress"
    return kind, {"type": kind, "sequence_number": event.sequence, "response": response_object(state)}
