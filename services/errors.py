"""Domain errors and the ONE place where they become gRPC status codes.

Services raise these (caller misuse, or a refusal the caller can act on); `grpc_errors` wraps each
RPC method and turns them into `context.abort(code, message)` with optional trailing metadata, and
beside it the standard `google.rpc.Status` in `grpc-status-details-bin` (what grpcio-status and
every language's gRPC library decode): `ErrorInfo` (reason, domain `sluice`, the hints as
metadata), `RetryInfo` for a retry-after, `QuotaFailure` for RESOURCE_EXHAUSTED and `BadRequest`
naming the field of an INVALID_ARGUMENT.
A lost or refused database connection (or an exhausted pool) becomes UNAVAILABLE with a retry
delay. Anything else that escapes a handler is logged with its traceback and reported as INTERNAL
with a generic message: callers never see a raw traceback.

Messages say what to change. Message templates are constants here so tests assert the exact text
the code produces (format them with the same arguments).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar, ParamSpec, TypeVar

import asyncpg
import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from sluice.ledger.transient import transient
from sqlalchemy import exc as sa_exc

log = logging.getLogger(__name__)

# --- message constants (shared by code and tests) ------------------------------------------------

# Authentication (UNAUTHENTICATED)
MISSING_API_KEY = "missing API key: send it as 'x-api-key' metadata or 'authorization: Bearer <key>'"
UNKNOWN_API_KEY = "unknown or revoked API key"
# Key scope and tenant state (PERMISSION_DENIED)
KEY_SCOPE_NOT_ALLOWED = "this API key has scope {scope!r}; {what} needs a key of scope {needed}"
TENANT_SUSPENDED = (
    "tenant {tenant!r} is suspended and may not submit runs (runs already accepted finish):"
    " ask an operator to resume it"
)

# Model (NOT_FOUND / PERMISSION_DENIED)
UNKNOWN_MODEL = "unknown model {model!r}: use a model alias or an exact model version"
TIER_NOT_ALLOWED = (
    "model {model!r} is in quality tier {tier!r}, which this tenant may not use (allowed: {allowed})"
)

# Request shape (INVALID_ARGUMENT)
EMPTY_INPUT = "input is empty: send at least one character of UTF-8 text"
INPUT_NOT_UTF8 = "input is not valid UTF-8 (byte {position}): send UTF-8 encoded text"
OUTPUT_CAP_NOT_POSITIVE = "max_output_tokens must be greater than 0 (got {cap})"
# Shared by the RPC edge's field checks (services/validation.py) and admission (every door).
FIELD_HAS_NUL = "{field} contains a NUL character at position {position}, which Sluice cannot store:" \
    " remove it"
FIELD_ABOVE_RANGE = "{field} must be at most {high:,} (got {value:,})"
REQUEST_KEY_MISSING = "request_key is empty: send an idempotency key of 1 to {limit} characters"
REQUEST_KEY_TOO_LONG = "request_key has {length} characters: use at most {limit}"
DEADLINE_NEGATIVE = "deadline_ms must be 0 (the default) or positive (got {deadline_ms})"
SAMPLING_OUT_OF_RANGE = "sampling.{name} must be within [{low}, {high}] (got {value})"
CONTEXT_TOO_LONG = (
    "prompt ({prompt:,} tokens) + max_output_tokens ({cap:,}) exceeds the context limit of model"
    " {model!r} ({limit:,} tokens): {advice}"
)
CONTEXT_ADVICE_LOWER_CAP = "lower max_output_tokens to at most {fit:,}"
CONTEXT_ADVICE_SHORTEN_PROMPT = "shorten the prompt to fewer than {limit:,} tokens"
BAD_DATE = "{field} {value!r} is not an ISO date (YYYY-MM-DD)"
DATE_RANGE_REVERSED = "from_date {start} is after to_date {end}"

# Idempotency (ALREADY_EXISTS)
REQUEST_KEY_REUSED = (
    "request_key {key!r} was already used for a different request (model, input, output cap or"
    " sampling differ): use a new request_key for a new request"
)

# Budget (RESOURCE_EXHAUSTED)
BUDGET_TOO_SMALL_FOR_CAP = (
    "budget exceeded: {tokens_left:,} tokens and {cost_left_micros:,} micro-USD left this period;"
    " this prompt ({prompt:,} tokens) with max_output_tokens {cap:,} does not fit:"
    " resubmit with max_output_tokens at most {fit:,}"
)
BUDGET_TOO_SMALL_FOR_PROMPT = (
    "budget exceeded: {tokens_left:,} tokens and {cost_left_micros:,} micro-USD left this period;"
    " this prompt ({prompt:,} tokens) leaves no room for any output: shorten the prompt or raise the budget"
)
NO_BUDGET = "no budget is configured for this tenant in the current period: ask an operator to set one"

# Limits shared by all admission instances (RESOURCE_EXHAUSTED)
CONCURRENCY_LIMIT = (
    "concurrent run limit reached: {active} runs of this tenant are in flight and the limit is {limit}:"
    " retry when one of them finishes"
)
TOKENS_PER_MINUTE_LIMIT = (
    "tokens-per-minute limit reached: {admitted:,} of {limit:,} tokens admitted in the last 60 s and"
    " this request needs {needed:,} (prompt + max_output_tokens): retry after {retry_after_ms} ms"
)
TOKENS_PER_MINUTE_NEVER_FITS = (
    "this request needs {needed:,} tokens (prompt + max_output_tokens), more than this tenant's"
    " tokens-per-minute limit of {limit:,}: {advice}"
)

# Deadline feasibility (DEADLINE_EXCEEDED): the least time the run could take exceeds its deadline.
DEADLINE_CANNOT_BE_MET = (
    "deadline_ms {deadline_ms:,} cannot be met: the runs queued ahead (~{queue_ms:,} ms), prefill of the"
    " {prompt:,}-token prompt (~{prefill_ms:,} ms) and max_output_tokens {cap:,} (~{decode_ms:,} ms)"
    " need at least {floor_ms:,} ms: {advice}"
)
DEADLINE_ADVICE_RAISE_OR_LOWER_CAP = (
    "raise deadline_ms to at least {floor_ms:,} or lower max_output_tokens to at most {fit:,}"
)
DEADLINE_ADVICE_RAISE = "raise deadline_ms to at least {floor_ms:,}"

# Load shedding (UNAVAILABLE): the model's worker pool already has as much waiting as it may.
POOL_BACKLOG_FULL = (
    "model {model!r} is overloaded: {backlog:,} runs are already waiting for worker pool {pool!r}"
    " (at most {limit:,} may wait): retry after {retry_after_ms} ms"
)

# Priority classes, GPU-memory budgets, the degradation ladder (issue 14; services/traffic_admission.py)
BATCH_NOT_ALLOWED = (
    "priority batch is not permitted for this tenant: submit it as interactive, or ask an administrator"
    " to allow batch for the tenant"
)
BATCH_SHED = (
    "model {model!r} is shedding batch work: {backlog:,} interactive runs are waiting for worker pool"
    " {pool!r} (batch is shed from {threshold:,}): retry after {retry_after_ms} ms"
)
BATCH_BACKLOG_FULL = (
    "model {model!r} already has {backlog:,} batch runs waiting for worker pool {pool!r} (at most"
    " {limit:,} may wait): retry after {retry_after_ms} ms"
)
KV_BUDGET_NEVER_FITS = (
    "this run would hold {needed:,} KV tokens (prompt {prompt:,} + max_output_tokens {cap:,}) but the"
    " tenant's GPU-memory budget is {budget:,} KV tokens at once: {advice}"
)
DETAIL_EXPIRED_WAITING_KV_BUDGET = (
    "deadline passed while the run waited for its tenant's GPU-memory budget ({held:,} of {budget:,} KV"
    " tokens held by its running runs; it needs {needed:,})"
)
DETAIL_EXPIRED_WAITING_HEADROOM = "deadline passed while the batch run waited for pool headroom"

# Trailing-metadata keys that carry machine-readable hints with the error.
MAX_OUTPUT_TOKENS_THAT_FIT_KEY = "x-max-output-tokens-that-fit"
MIN_DEADLINE_MS_KEY = "x-min-deadline-ms"
RETRY_AFTER_MS_KEY = "retry-after-ms"

INTERNAL_ERROR = "internal error; nothing was acknowledged, retrying with the same request_key is safe"
DATABASE_UNAVAILABLE = "the run ledger is unreachable or overloaded; retry after the suggested delay"
DATABASE_RETRY_AFTER_MS = 1_000


# --- error classes ------------------------------------------------------------------------------


class SluiceError(Exception):
    """A refusal the caller can act on. Subclasses fix the gRPC status."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, metadata: Sequence[tuple[str, str]] = (),
                 field: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: tuple[tuple[str, str], ...] = tuple(metadata)
        self.field = field                          # the request field at fault (BadRequest)
        self.reason = reason or self.code.name      # ErrorInfo.reason, UPPER_SNAKE_CASE


class Unauthenticated(SluiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SluiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(SluiceError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(SluiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(SluiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AlreadyExists(SluiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(SluiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(SluiceError):
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, retry_after_ms: int | None = None,
                 metadata: Sequence[tuple[str, str]] = (), reason: str | None = None) -> None:
        hints = tuple(metadata)
        if retry_after_ms is not None:
            hints += ((RETRY_AFTER_MS_KEY, str(retry_after_ms)),)
        super().__init__(message, metadata=hints, reason=reason)
        self.retry_after_ms = retry_after_ms


class OutOfRange(SluiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class FailedPrecondition(SluiceError):
    """The run is not in a state that allows the operation (e.g. cancelling a finished run)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


# --- the RPC edge ---------------------------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")


ERROR_DOMAIN = "sluice"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def _packed(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(error: SluiceError) -> status_pb2.Status:
    """The google.rpc.Status of a refusal: the same code and message, and the hints as typed details."""
    hints = dict(error.metadata)
    details = [error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN,
        metadata={key.removeprefix("x-").replace("-", "_"): value for key, value in hints.items()})]
    retry_after = hints.get(RETRY_AFTER_MS_KEY, "")
    if retry_after.isdigit():
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        details.append(error_details_pb2.QuotaFailure(violations=[
            error_details_pb2.QuotaFailure.Violation(subject=error.reason.lower(),
                                                     description=error.message)]))
    if error.field is not None:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)]))
    return status_pb2.Status(code=error.code.value[0], message=error.message,
                             details=[_packed(detail) for detail in details])


async def abort_with(context: grpc.aio.ServicerContext, error: SluiceError) -> None:
    """Abort the RPC with the error's status, message, trailing-metadata hints and the
    google.rpc.Status beside them (raises AbortError)."""
    trailing = (*error.metadata, (STATUS_DETAILS_KEY, rich_status(error).SerializeToString()))
    await context.abort(error.code, error.message, trailing_metadata=trailing)


def infrastructure_error(error: Exception) -> SluiceError | None:
    """The domain error for a failure of the database underneath, or None if it is not one.

    A refused or dropped connection, or an exhausted connection pool, is transient: the caller
    gets UNAVAILABLE with a retry delay (safe, since Submit is idempotent by request_key) rather
    than INTERNAL. Constraint violations and SQL errors stay INTERNAL: they are bugs.
    """
    # The hot paths (Submit, Stream's lookups) run on raw asyncpg: its connection errors count too.
    unavailable = (
        isinstance(error, (OSError, sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                           asyncpg.exceptions.TooManyConnectionsError))
        or (isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated)
        or transient(error)
    )
    if not unavailable:
        return None
    return Unavailable(DATABASE_UNAVAILABLE, retry_after_ms=DATABASE_RETRY_AFTER_MS,
                       reason="LEDGER_UNAVAILABLE")


async def _abort_unexpected(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    mapped = infrastructure_error(error)
    if mapped is not None:
        log.warning("%s: database unavailable: %s", method, type(error).__name__)
        await abort_with(context, mapped)
    log.exception("unhandled error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)


def grpc_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Decorate a grpc.aio servicer method (unary or server-streaming) to map domain errors.

    The servicer context must be the method's last positional argument, as grpc.aio calls it:
    `method(self, request, context)`.
    """
    name = method.__qualname__

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            context = args[-1]
            try:
                async for item in method(*args, **kwargs):
                    yield item
            except SluiceError as error:
                await abort_with(context, error)
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as error:
                await _abort_unexpected(context, name, error)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        context = args[-1]
        try:
            return await method(*args, **kwargs)  # type: ignore[misc]
        except SluiceError as error:
            await abort_with(context, error)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort_unexpected(context, name, error)

    return unary_wrapper  # type: ignore[return-value]


__all__ = [
    "AlreadyExists",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "SluiceError",
    "Unauthenticated",
    "Unavailable",
    "abort_with",
    "grpc_errors",
    "infrastructure_error",
]
