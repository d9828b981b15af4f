"""The ONE place where domain errors become HTTP responses (the gRPC door's twin is
services/errors.py `grpc_errors`): status, headers and the OpenAI error object

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...,
               "max_output_tokens_that_fit": 1000, "retry_after_ms": 250, "min_deadline_ms": ...}}

Every domain error carries its gRPC status code; the HTTP status follows from that code, so a
refusal reads the same through either door. The machine-readable hints the gRPC door sends as
trailing metadata become fields of the error object (and `Retry-After` / `retry-after-ms`
headers, which the official `openai` client honours when it retries).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from sluice.services.errors import (
    INTERNAL_ERROR,
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY,
    MIN_DEADLINE_MS_KEY,
    RETRY_AFTER_MS_KEY,
    InvalidArgument,
    SluiceError,
    infrastructure_error,
)

log = logging.getLogger(__name__)

# --- message constants of refusals made at the edge (shared by code and tests) -------------------

BODY_NOT_JSON = "We could not parse the JSON body of your request: {detail}. Send a JSON object."
BODY_NOT_UTF8 = "The request body is not valid UTF-8 (byte {position}): send UTF-8 encoded JSON."
BODY_TOO_LARGE = "The request body has {size:,} bytes, more than the {limit:,} this endpoint accepts."
UNRECOGNIZED_ARGUMENT = "Unrecognized request argument supplied: {param}"
MISSING_ARGUMENT = "Missing required parameter: '{param}'."
MISSING_REQUEST_KEY = "Missing required parameter: 'requestKey' (or send an Idempotency-Key header)."
INVALID_ARGUMENT = "Invalid '{param}': {detail}."
UNSUPPORTED_ARGUMENT = "'{param}' is not supported by Sluice: {why}"
CONFLICTING_ARGUMENTS = "'{first}' and '{second}' disagree: send one of them (or the same value in both)."
BAD_CURSOR = "Invalid '{param}': expected a non-negative integer event sequence, got {value!r}."
NO_CHAT_TEMPLATE = (
    "model {model!r} has no chat template in the model registry: use /v1/completions with a plain"
    " prompt, or ask an operator to register its template"
)
UNKNOWN_ROLE = "Invalid '{param}': role {role!r} is not supported (use system, developer, user or assistant)."
RUN_ENDED = "the run ended {status}{detail}: {advice}"
RUN_ENDED_ADVICE = {
    "CANCELLED": "it was cancelled; submit again with a new Idempotency-Key for a new answer",
    "INTERRUPTED": "its replica or worker was lost; the tokens consumed so far are charged,"
                   " submit again with a new Idempotency-Key for a new answer",
    "FAILED": "no replica could start it; nothing was charged for the prompt, retry later",
    "EXPIRED": "its deadline passed before it finished; raise the deadline or lower the output cap",
}

# --- status table ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpStatus:
    status: int
    type: str                        # the OpenAI error object's `type`
    code: str                        # its `code`


STATUS_OF_CODE: Mapping[grpc.StatusCode, HttpStatus] = {
    grpc.StatusCode.UNAUTHENTICATED: HttpStatus(401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: HttpStatus(403, "permission_error", "model_not_permitted"),
    grpc.StatusCode.NOT_FOUND: HttpStatus(404, "invalid_request_error", "not_found"),
    grpc.StatusCode.INVALID_ARGUMENT: HttpStatus(400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.ALREADY_EXISTS: HttpStatus(409, "invalid_request_error", "idempotency_key_reused"),
    grpc.StatusCode.FAILED_PRECONDITION: HttpStatus(409, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpStatus(429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpStatus(504, "timeout_error", "deadline_cannot_be_met"),
    grpc.StatusCode.UNAVAILABLE: HttpStatus(503, "overloaded_error", "overloaded"),
    grpc.StatusCode.OUT_OF_RANGE: HttpStatus(410, "invalid_request_error", "cursor_past_retention"),
    grpc.StatusCode.INTERNAL: HttpStatus(500, "server_error", "internal_error"),
}
# A budget refusal names the cap that fits; OpenAI calls running out of quota `insufficient_quota`.
BUDGET_EXCEEDED = HttpStatus(429, "insufficient_quota", "budget_exceeded")
# Statuses of a run that ended without an answer, for requests that wait for one.
STATUS_OF_ENDING: Mapping[str, HttpStatus] = {
    "CANCELLED": HttpStatus(409, "invalid_request_error", "run_cancelled"),
    "INTERRUPTED": HttpStatus(502, "server_error", "run_interrupted"),
    "FAILED": HttpStatus(502, "server_error", "run_failed"),
    "EXPIRED": HttpStatus(504, "timeout_error", "run_expired"),
}

_HINT_FIELDS = {
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY: "max_output_tokens_that_fit",
    RETRY_AFTER_MS_KEY: "retry_after_ms",
    MIN_DEADLINE_MS_KEY: "min_deadline_ms",
}


class InvalidField(InvalidArgument):
    """A request refused at the edge, naming the field (the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class BodyTooLarge(InvalidField):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(BODY_TOO_LARGE.format(size=size, limit=limit), None)


class RunEnded(SluiceError):
    """A request that waits for an answer saw its run end without one."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(RUN_ENDED.format(status=status, detail=f" ({detail})" if detail else "",
                                          advice=RUN_ENDED_ADVICE.get(status, "submit again")))
        self.status = status


@dataclass(frozen=True, slots=True)
class ErrorReply:
    status: int
    headers: dict[str, str]
    body: dict[str, object]          # {"error": {...}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode()


def error_reply(error: SluiceError) -> ErrorReply:
    hints = {_HINT_FIELDS[key]: int(value) for key, value in error.metadata if key in _HINT_FIELDS}
    if isinstance(error, RunEnded):
        status = STATUS_OF_ENDING.get(error.status, STATUS_OF_CODE[grpc.StatusCode.INTERNAL])
    elif "max_output_tokens_that_fit" in hints:
        status = BUDGET_EXCEEDED
    else:
        status = STATUS_OF_CODE.get(error.code, STATUS_OF_CODE[grpc.StatusCode.INTERNAL])
    code = status.code
    if isinstance(error, BodyTooLarge):
        status, code = HttpStatus(413, status.type, "request_too_large"), "request_too_large"
    headers: dict[str, str] = {}
    if "retry_after_ms" in hints:
        wait_ms = hints["retry_after_ms"]
        headers["retry-after"] = str(max(1, math.ceil(wait_ms / 1000)))
        headers["retry-after-ms"] = str(wait_ms)
    body = {"message": error.message, "type": status.type, "param": getattr(error, "param", None),
            "code": code, **hints}
    return ErrorReply(status.status, headers, {"error": body})


def unexpected_reply(where: str, error: Exception) -> ErrorReply:
    """A failure that is not a domain error: the database underneath (503), else a bug (500)."""
    mapped = infrastructure_error(error)
    if mapped is not None:
        log.warning("%s: database unavailable: %s", where, type(error).__name__)
        return error_reply(mapped)
    log.error("unhandled error in %s", where, exc_info=error)
    internal = STATUS_OF_CODE[grpc.StatusCode.INTERNAL]
    return ErrorReply(internal.status, {}, {"error": {"message": INTERNAL_ERROR, "type": internal.type,
                                                      "param": None, "code": internal.code}})
