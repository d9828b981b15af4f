"""One GET of a replica's Prometheus endpoint, on a plain asyncio connection (issue 9).

The routing process scrapes every replica four times a second, busy or idle. Through aiohttp a
scrape cost ~1.2 ms of the process's CPU (its session, connector, request and response machinery),
on an HTTP/1.0 endpoint that closes the connection after each answer anyway (prometheus_client's,
the simple replica's); this costs ~0.5 ms, nearly all of it the TCP connection itself:

    connect ─▶ "GET /metrics HTTP/1.0" ─▶ read to EOF ─▶ status 200? body : ScrapeError

HTTP/1.0 needs no chunked decoding and no keep-alive bookkeeping, and every server speaks it
(Triton's metrics port included). https URLs are verified with the default trust store.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

MAX_BYTES = 8 << 20          # a metrics page far past this is not a replica's


class ScrapeError(ValueError):
    """The endpoint answered, but not with a page of metrics."""


async def fetch_metrics(url: str, timeout_s: float) -> str:
    """The body of `url` (http or https); raises OSError, TimeoutError or ScrapeError."""
    async with asyncio.timeout(timeout_s):
        return await _get(url)


async def _get(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url!r}")
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=ssl.create_default_context() if secure else None)
    try:
        writer.write(f"GET {target} HTTP/1.0\r\nHost: {parts.netloc}\r\n"
                     "Accept: text/plain\r\n\r\n".encode("ascii"))
        answer = await _read_to_end(reader)
    finally:
        writer.close()
    return body_of(answer)


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (an HTTP/1.0 answer's end), at most MAX_BYTES."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BYTES:
            raise ScrapeError(f"more than {MAX_BYTES} bytes")
    return b"".join(chunks)


def body_of(answer: bytes) -> str:
    """The body of a complete HTTP response whose status is 200 (ScrapeError otherwise)."""
    head, separator, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if not separator or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise ScrapeError("not an HTTP response")
    if status_line[1] != b"200":
        raise ScrapeError(f"HTTP status {status_line[1].decode('ascii', 'replace')}")
    return body.decode("utf-8", "replace")
