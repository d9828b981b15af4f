"""The RPC edge's first look at every request: decoded by Sluice, checked field by field.

gRPC's own registration decodes a request with `Message.FromString` and, when the body does not
parse, logs a traceback and answers UNKNOWN. Here every service is registered from its protobuf
descriptor with a deserializer that never raises: an undecodable body becomes an `Undecodable`
value, and the wrapped handler refuses it with INVALID_ARGUMENT before the servicer runs.

A decoded request is then checked against what the ledger and the documented ranges accept,
still before the servicer (so before anything is read or written):

    every string field     no NUL (PostgreSQL text refuses it), at most N characters
    every bytes field      at most N bytes ([admission].max_input_bytes for Submit's input)
    listed integer fields  within their documented range (deadline_ms <= [admission].max_deadline_ms)
    repeated fields        at most N items

Each refusal names the field (dotted path from the request, e.g. `sampling.seed`) and says what
to change, in the message and as the standard google.rpc `BadRequest` field violation beside it
(`grpc-status-details-bin`, services/errors.py), which any language's gRPC library decodes.
Rules that need the database or the model (authentication, context length, budgets) stay in the
services; this module holds only what any request of a given type must satisfy.

A client's mistake is logged at INFO, one line, never with a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from sluice.services.errors import FIELD_ABOVE_RANGE, FIELD_HAS_NUL, InvalidArgument, abort_with

from sluice.config import Settings
from sluice.config.settings import AdmissionSection

log = logging.getLogger(__name__)

# Message templates (shared by code and tests).
UNDECODABLE = "request body is not a valid {message} ({reason}): send a protobuf-encoded {message}"
FIELD_TOO_LONG = "{field} has {length:,} {unit}: send at most {limit:,}"
# ErrorInfo.reason of the refusals made here.
UNDECODABLE_REASON = "UNDECODABLE_REQUEST"
FIELD_REASON = "FIELD_OUT_OF_BOUNDS"

# Defaults for the [admission] keys this module reads (config/sluice.toml documents each).
# [admission].max_input_bytes and max_deadline_ms when a config leaves them out (sluice.toml says why).
DEFAULT_MAX_INPUT_BYTES: int = AdmissionSection.model_fields["max_input_bytes"].default
DEFAULT_MAX_DEADLINE_MS: int = AdmissionSection.model_fields["max_deadline_ms"].default

DEFAULT_MAX_CHARS = 4_096                    # any string field without a limit of its own
DEFAULT_MAX_BYTES = 65_536                   # any bytes field without a limit of its own
DEFAULT_MAX_ITEMS = 131_072                  # any repeated field: the longest context served
# Strings with a tighter natural bound. request_key is absent on purpose: admission's own rule
# (REQUEST_KEY_TOO_LONG, [admission].max_request_key_chars) names its configured limit.
FIELD_MAX_CHARS: Mapping[str, int] = {
    "sluice.v1.SubmitRequest.model": 256,
    "sluice.v1.SubmitRequest.conversation_id": 256,
    "sluice.v1.GetRunRequest.run_id": 64,
    "sluice.v1.StreamRequest.run_id": 64,
    "sluice.v1.CancelRequest.run_id": 64,
    "sluice.v1.GetUsageRequest.from_date": 32,
    "sluice.v1.GetUsageRequest.to_date": 32,
    "sluice.v1.Replica.name": 256,
    "sluice.v1.Replica.pool": 256,
    "sluice.v1.Replica.grpc_address": 256,
    "sluice.v1.Replica.metrics_url": 2_048,
    "sluice.v1.RemoveReplicaRequest.name": 256,
    "sluice.v1.ExplainRequest.model_version": 256,
    "sluice.v1.ExplainRequest.conversation_id": 256,
    "sluice.v1.RegisterModelRequest.chat_template": 65_536,   # real templates run to ~10 KB
}


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the deserializer hands the handler instead of a request it could not parse."""

    message: str                     # the expected message type, e.g. "sluice.v1.SubmitRequest"
    reason: str                      # the decoder's complaint (no request bytes in it)

    def problem(self) -> str:
        return UNDECODABLE.format(message=self.message, reason=self.reason)


@dataclass(frozen=True, slots=True)
class Violation:
    """Why a request is refused: the field at fault (its path in the request) and what to change."""

    field: str
    message: str


@dataclass(frozen=True, slots=True)
class FieldLimits:
    """The bounds every request is held to, by full field name (`sluice.v1.SubmitRequest.input`)."""

    max_chars: Mapping[str, int] = field(default_factory=lambda: dict(FIELD_MAX_CHARS))
    max_bytes: Mapping[str, int] = field(default_factory=dict)
    max_values: Mapping[str, int] = field(default_factory=dict)   # inclusive upper bounds
    default_max_chars: int = DEFAULT_MAX_CHARS
    default_max_bytes: int = DEFAULT_MAX_BYTES
    max_items: int = DEFAULT_MAX_ITEMS

    @classmethod
    def from_config(cls, config: Settings) -> FieldLimits:
        return cls(max_bytes={"sluice.v1.SubmitRequest.input": config.admission.max_input_bytes},
                   # Batch runs may carry longer deadlines; admission holds interactive ones to
                   # [admission].max_deadline_ms (admission_rules.check_storable).
                   max_values={"sluice.v1.SubmitRequest.deadline_ms": max(
                       config.admission.max_deadline_ms, config.traffic.max_batch_deadline_ms)})

    def problem(self, request: Message) -> str | None:
        """Why `request` is refused, naming the field; None if every field is within bounds."""
        violation = self.violation(request)
        return None if violation is None else violation.message

    def violation(self, request: Message) -> Violation | None:
        """The first field out of bounds and why; None if every field is within bounds."""
        return self._message_problem(request, "")

    def _message_problem(self, message: Message, prefix: str) -> Violation | None:
        for descriptor, value in message.ListFields():
            path = prefix + descriptor.name
            if descriptor.is_repeated:
                if len(value) > self.max_items:
                    return Violation(path, FIELD_TOO_LONG.format(field=path, length=len(value), unit="items",
                                                                 limit=self.max_items))
                items = value
            else:
                items = (value,)
            for item in items:
                problem = self._value_problem(descriptor, item, path)
                if problem is not None:
                    return problem
        return None

    def _value_problem(self, descriptor: FieldDescriptor, value: Any, path: str) -> Violation | None:
        kind = descriptor.type
        if kind == FieldDescriptor.TYPE_MESSAGE:
            return self._message_problem(value, path + ".")
        if kind == FieldDescriptor.TYPE_STRING:
            problem = self._text_problem(descriptor.full_name, value, path)
        elif kind == FieldDescriptor.TYPE_BYTES:
            limit = self.max_bytes.get(descriptor.full_name, self.default_max_bytes)
            problem = None if len(value) <= limit else FIELD_TOO_LONG.format(
                field=path, length=len(value), unit="bytes", limit=limit)
        else:
            high = self.max_values.get(descriptor.full_name)
            problem = None if high is None or value <= high else FIELD_ABOVE_RANGE.format(
                field=path, high=high, value=value)
        return None if problem is None else Violation(path, problem)

    def _text_problem(self, full_name: str, value: str, path: str) -> str | None:
        limit = self.max_chars.get(full_name, self.default_max_chars)
        if len(value) > limit:
            return FIELD_TOO_LONG.format(field=path, length=len(value), unit="characters", limit=limit)
        position = value.find("\0")
        if position >= 0:
            return FIELD_HAS_NUL.format(field=path, position=position)
        return None


def decoder(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer that never raises (gRPC would answer UNKNOWN and log a traceback)."""
    name = message_class.DESCRIPTOR.full_name

    def decode(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except Exception as error:    # DecodeError, and RecursionError for absurd nesting
            return Undecodable(name, type(error).__name__ if not str(error) else str(error)[:200])

    return decode


async def _refuse(context: grpc.aio.ServicerContext, method: str, problem: InvalidArgument) -> None:
    log.info("%s refused as malformed: %s", method, problem.message)
    await abort_with(context, problem)


def _problem(request: Message | Undecodable, limits: FieldLimits) -> InvalidArgument | None:
    """The refusal of a request: an undecodable body names no field, a field out of bounds does."""
    if isinstance(request, Undecodable):
        return InvalidArgument(request.problem(), reason=UNDECODABLE_REASON)
    violation = limits.violation(request)
    if violation is None:
        return None
    return InvalidArgument(violation.message, field=violation.field, reason=FIELD_REASON)


def _checked_unary(method: str, inner: Callable[..., Any], limits: FieldLimits) -> Callable[..., Any]:
    async def behavior(request: Message | Undecodable, context: grpc.aio.ServicerContext) -> Any:
        problem = _problem(request, limits)
        if problem is not None:
            await _refuse(context, method, problem)
        return await inner(request, context)

    return behavior


def _checked_stream(method: str, inner: Callable[..., AsyncIterator[Any]],
                    limits: FieldLimits) -> Callable[..., AsyncIterator[Any]]:
    async def behavior(request: Message | Undecodable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        problem = _problem(request, limits)
        if problem is not None:
            await _refuse(context, method, problem)
        async for item in inner(request, context):
            yield item

    return behavior


def _handler(servicer: object, method: Any, limits: FieldLimits) -> grpc.RpcMethodHandler:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    inner = getattr(servicer, method.name)
    name = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming:
        raise NotImplementedError(f"{name}: client-streaming methods are not checked here")
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _checked_stream(name, inner, limits), request_deserializer=decoder(request_class),
            response_serializer=response_class.SerializeToString)
    return grpc.unary_unary_rpc_method_handler(
        _checked_unary(name, inner, limits), request_deserializer=decoder(request_class),
        response_serializer=response_class.SerializeToString)


def add_checked_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object,
                        limits: FieldLimits) -> None:
    """Register `servicer` for `service` (e.g. admission_pb2.DESCRIPTOR.services_by_name["Admission"])
    in place of the generated `add_…Servicer_to_server`: same method table, Sluice's decoder and checks."""
    handlers = {method.name: _handler(servicer, method, limits) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
