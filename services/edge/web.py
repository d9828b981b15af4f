"""Request and response plumbing shared by the routes: the caller's key, the body under its limit,
JSON replies, and the one wrapper that turns domain errors into HTTP error replies."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from sluice.services.admission import AdmissionService
from sluice.services.auth import API_KEY_HEADER, AUTHORIZATION_HEADER, Metadata
from sluice.services.edge.errors import BodyTooLarge, ErrorReply, error_reply, unexpected_reply
from sluice.services.edge.settings import HttpSettings
from sluice.services.edge.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from sluice.services.edge.templates import ModelCards
from sluice.services.errors import SluiceError
from sluice.services.runs import RunsService
from sluice.services.usage import UsageQueryService
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sluice.v1 import runs_pb2

RUN_ID_HEADER = "x-sluice-run-id"
IDEMPOTENCY_KEY_HEADER = "idempotency-key"
JSON_MEDIA_TYPE = "application/json"


@dataclass(frozen=True, slots=True)
class EdgeServices:
    """The gateway's own service objects (the gRPC servicers call the very same ones)."""

    admission: AdmissionService
    runs: RunsService
    usage: UsageQueryService
    sessions: async_sessionmaker[AsyncSession]
    cards: ModelCards
    settings: HttpSettings


def edge_of(request: Request) -> EdgeServices:
    edge: EdgeServices = request.app.state.edge
    return edge


def events_until_closed(edge: EdgeServices, metadata: Metadata, run_id: str,
                        after: int) -> contextlib.aclosing[AsyncGenerator[runs_pb2.RunEvent, None]]:
    """RunsService.stream for a reader that may stop early: leaving the block closes the stream
    (and its event-log reader) at once rather than whenever the generator is collected."""
    stream = cast(AsyncGenerator[runs_pb2.RunEvent, None], edge.runs.stream(metadata, run_id, after))
    return contextlib.aclosing(stream)


def caller(request: Request) -> list[tuple[str, str]]:
    """The credentials as services.auth reads them from gRPC metadata (same header names)."""
    headers = request.headers
    return [(name, headers[name]) for name in (AUTHORIZATION_HEADER, API_KEY_HEADER) if name in headers]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` (by Content-Length, or
    while reading a chunked one), so an oversized body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit:
        raise BodyTooLarge(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_reply(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return Response(body, status_code=status, headers=headers, media_type=JSON_MEDIA_TYPE)


def error_response(reply: ErrorReply) -> Response:
    return Response(reply.json_bytes(), status_code=reply.status, headers=reply.headers,
                    media_type=JSON_MEDIA_TYPE)


def sse_response(frames: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(frames, headers={**SSE_HEADERS, **headers}, media_type=SSE_MEDIA_TYPE)


Handler = Callable[[Request], Awaitable[Response]]


def http_errors(handler: Handler) -> Handler:
    """Map what a route raises before its response starts; errors raised while an SSE body is
    streaming are framed by `framed_errors` instead (the status line is gone by then)."""
    name = handler.__qualname__

    @functools.wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except SluiceError as error:
            return error_response(error_reply(error))
        except Exception as error:  # noqa: BLE001 - the edge answers every request
            return error_response(unexpected_reply(name, error))

    return wrapper


async def framed_errors(frames: AsyncIterator[bytes], where: str,
                        to_frame: Callable[[ErrorReply], bytes]) -> AsyncIterator[bytes]:
    """Pass SSE frames on; a domain error mid-stream becomes one last error frame."""
    try:
        async for chunk in frames:
            yield chunk
    except SluiceError as error:
        yield to_frame(error_reply(error))
    except Exception as error:  # noqa: BLE001
        yield to_frame(unexpected_reply(where, error))
