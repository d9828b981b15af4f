"""GETs of replicas' Prometheus endpoints on kept-alive connections (issue 9).

The routing process scrapes every replica four times a second while it drives runs. Through aiohttp
a scrape cost ~1.2 ms of the process's CPU; one HTTP/1.0 GET on a fresh asyncio connection ~0.5 ms,
nearly all of it the TCP connection itself (connect, close, the transport made and torn down). Here
each endpoint keeps one HTTP/1.1 connection, and a scrape is one write and one read on it:

    fetch(url) ──▶ the url's idle connection (or a new one) ──▶ "GET /metrics HTTP/1.1"
        ──▶ status line + headers ──▶ body by Content-Length (or chunked; or to EOF, then closed)
        ──▶ connection kept for the next scrape unless the server said close; 200? body : ScrapeError

A kept connection the server closed while idle (its keep-alive timeout, a restart) fails before a
byte of the answer: the GET is sent once more on a new connection, so that a server's housekeeping
never counts as a failed scrape against the replica's circuit breaker. Any other failure (a timeout,
a broken answer) closes the connection: the next scrape starts afresh. An HTTP/1.0 server that
closes after each answer (prometheus_client's start_http_server) is read to EOF as before.
https URLs are verified with the default trust store.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_BYTES = 8 << 20          # a metrics page far past this is not a replica's
HEAD_LIMIT = 64 << 10        # status line and headers: a metrics server's are a few hundred bytes

ERR_CLOSED = "the connection closed before a whole answer"


class ScrapeError(ValueError):
    """The endpoint answered, but not with a page of metrics."""


class _Stale(Exception):
    """A kept connection ended before any byte of its answer (closed by the server while idle)."""


@dataclass(frozen=True, slots=True)
class _Endpoint:
    host: str
    port: int
    secure: bool
    request: bytes               # the whole GET, encoded once

    @classmethod
    def of(cls, url: str) -> _Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ScrapeError(f"not an http(s) URL: {url!r}")
        secure = parts.scheme == "https"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                   "Accept: text/plain\r\n\r\n").encode("ascii")
        return cls(parts.hostname, parts.port or (443 if secure else 80), secure, request)


@dataclass(frozen=True, slots=True)
class Answer:
    status: bytes                # "200", as sent
    body: bytes
    reusable: bool               # framed (its end known without EOF) and the server keeps the connection


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, endpoint: _Endpoint) -> _Connection:
        reader, writer = await asyncio.open_connection(
            endpoint.host, endpoint.port, ssl=ssl.create_default_context() if endpoint.secure else None,
            limit=HEAD_LIMIT)
        return cls(reader, writer)

    @property
    def idle_and_open(self) -> bool:
        """No EOF from the server yet: worth sending the next GET on."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    async def get(self, request: bytes, reused: bool) -> Answer:
        self.writer.write(request)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if reused and not exc.partial:
                raise _Stale from exc
            raise ScrapeError(ERR_CLOSED) from exc
        except ConnectionError:
            if reused:
                raise _Stale from None
            raise
        except asyncio.LimitOverrunError as exc:
            raise ScrapeError(f"headers past {HEAD_LIMIT} bytes") from exc
        return await read_answer(head, self.reader)

    def close(self) -> None:
        self.writer.close()


class MetricsScraper:
    """One kept-alive connection per endpoint; use on one event loop. Scrapes of one URL are expected
    one at a time (the worker's scrape loop); a concurrent one opens a connection of its own."""

    __slots__ = ("_endpoints", "_idle")

    def __init__(self) -> None:
        self._endpoints: dict[str, _Endpoint] = {}
        self._idle: dict[str, _Connection] = {}    # url -> its connection, between scrapes

    async def fetch(self, url: str, timeout_s: float) -> str:
        """The body of `url` (http or https); raises OSError, TimeoutError or ScrapeError."""
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint.of(url)
        async with asyncio.timeout(timeout_s):
            connection, answer = await self._get(url, endpoint)
        if answer.reusable:
            displaced = self._idle.pop(url, None)
            if displaced is not None:
                displaced.close()
            self._idle[url] = connection
        else:
            connection.close()
        return body_of(answer)

    async def _get(self, url: str, endpoint: _Endpoint) -> tuple[_Connection, Answer]:
        connection = self._idle.pop(url, None)
        if connection is not None:
            if connection.idle_and_open:
                try:
                    return connection, await connection.get(endpoint.request, reused=True)
                except _Stale:
                    pass
                except BaseException:
                    connection.close()
                    raise
            connection.close()
        connection = await _Connection.open(endpoint)
        try:
            return connection, await connection.get(endpoint.request, reused=False)
        except BaseException:
            connection.close()
            raise

    def keep_only(self, urls: Collection[str]) -> None:
        """Close the kept connections of every other url (their replicas left the registry)."""
        for url in [url for url in self._endpoints if url not in urls]:
            del self._endpoints[url]
            connection = self._idle.pop(url, None)
            if connection is not None:
                connection.close()

    def close(self) -> None:
        self.keep_only(())

    @property
    def kept(self) -> int:
        """Connections kept between scrapes."""
        return len(self._idle)


async def read_answer(head: bytes, reader: asyncio.StreamReader) -> Answer:
    """The answer whose status line and headers are `head` (through its blank line), its body read
    from `reader` as the headers frame it."""
    lines = head[:-4].split(b"\r\n")
    status_line = lines[0].split(None, 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise ScrapeError("not an HTTP response")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    connection = headers.get(b"connection", b"")
    keep = connection == b"keep-alive" if status_line[0] == b"HTTP/1.0" else connection != b"close"
    try:
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            body = await _chunked(reader)
        elif (length := headers.get(b"content-length")) is not None:
            if not length.isdigit() or int(length) > MAX_BYTES:
                raise ScrapeError(f"content-length {length.decode('ascii', 'replace')}")
            body = await reader.readexactly(int(length))
        else:
            body, keep = await _to_end(reader), False
    except asyncio.IncompleteReadError as exc:
        raise ScrapeError(ERR_CLOSED) from exc
    return Answer(status_line[1], body, keep)


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            length = int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise ScrapeError("a malformed chunk size") from None
        if length == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":   # trailers, up to the blank line
                pass
            return b"".join(chunks)
        size += length
        if size > MAX_BYTES:
            raise ScrapeError(f"more than {MAX_BYTES} bytes")
        chunks.append((await reader.readexactly(length + 2))[:-2])


async def _to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (an unframed answer's end), at most MAX_BYTES."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BYTES:
            raise ScrapeError(f"more than {MAX_BYTES} bytes")
    return b"".join(chunks)


def body_of(answer: Answer) -> str:
    """The body of an answer whose status is 200 (ScrapeError otherwise)."""
    if answer.status != b"200":
        raise ScrapeError(f"HTTP status {answer.status.decode('ascii', 'replace')}")
    return answer.body.decode("utf-8", "replace")
