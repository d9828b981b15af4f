"""Server-sent events framing and the resume cursor. Pure.

Each run event goes out with `id: <sequence>`, so a browser's EventSource (or any client) that
reconnects sends `Last-Event-ID: <last sequence it got>` and receives exactly the events after it.
"""

from __future__ import annotations

import json

from sluice.services.edge.errors import BAD_CURSOR, InvalidField

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}   # no proxy buffering
DONE = b"data: [DONE]\n\n"
LAST_EVENT_ID = "last-event-id"


def frame(data: object, *, event: str | None = None, event_id: int | None = None) -> bytes:
    """One SSE message; `data` is sent as compact JSON (one line, so one `data:` field)."""
    head = ""
    if event_id is not None:
        head += f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def parse_cursor(value: str | None, param: str) -> int:
    if value is None or value == "":
        return 0
    if not value.isdecimal():
        raise InvalidField(BAD_CURSOR.format(param=param, value=value), param)
    return int(value)


def resume_cursor(after: str | None, last_event_id: str | None) -> int:
    """Where a stream resumes. A reconnecting EventSource repeats the original URL (with its old
    `after`) and adds Last-Event-ID, so the header, being newer, wins."""
    if last_event_id is not None and last_event_id.strip():
        return parse_cursor(last_event_id.strip(), "Last-Event-ID")
    return parse_cursor(after, "after")


def wants_sse(accept: str | None) -> bool:
    return accept is not None and SSE_MEDIA_TYPE in accept
