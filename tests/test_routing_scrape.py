"""The routing process's metrics scrape (services/routing/scrape.py): HTTP/1.1 GETs on one kept-alive
connection per endpoint, plain asyncio. Against stand-in endpoints (a TCP listener answering what a
metrics server would, counting the connections it accepts); tests/test_replica_metrics_server.py has
the replica's own server, tests/test_routing_live.py scrapes real replicas through the worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from sluice.services.routing.scrape import ERR_CLOSED, MetricsScraper, ScrapeError, read_answer

from tests.support.replica_proc import free_ports

PAGE = "# TYPE nv_inference_count counter\nnv_inference_count{model=\"m\"} 7\n"
KEPT = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(PAGE)}\r\n\r\n{PAGE}".encode()

Reader, Writer = asyncio.StreamReader, asyncio.StreamWriter


@dataclass
class Endpoint:
    url: str
    connections: int = 0                              # accepted so far
    requests: list[bytes] = field(default_factory=list)


async def serving(handler: Callable[[Endpoint, Reader, Writer], Awaitable[None]]) -> AsyncIterator[Endpoint]:
    endpoint = Endpoint("")

    async def accepted(reader: Reader, writer: Writer) -> None:
        endpoint.connections += 1
        try:
            await handler(endpoint, reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    endpoint.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    try:
        yield endpoint
    finally:
        server.close()
        await server.wait_closed()


async def next_request(endpoint: Endpoint, reader: asyncio.StreamReader) -> bool:
    """Read one request into endpoint.requests; False at EOF."""
    try:
        endpoint.requests.append(await reader.readuntil(b"\r\n\r\n"))
    except asyncio.IncompleteReadError:
        return False
    return True


async def keep_alive(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
    while await next_request(endpoint, reader):
        writer.write(KEPT)


async def answer_of(raw: bytes) -> tuple[bytes, bytes, bool]:
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    head, _, _ = raw.partition(b"\r\n\r\n")
    await reader.readexactly(len(head) + 4)
    answer = await read_answer(head + b"\r\n\r\n", reader)
    return answer.status, answer.body, answer.reusable


async def test_three_scrapes_of_a_keep_alive_endpoint_share_one_connection():
    async for endpoint in serving(keep_alive):
        scraper = MetricsScraper()
        assert [await scraper.fetch(endpoint.url, timeout_s=2.0) for _ in range(3)] == [PAGE] * 3
        assert endpoint.connections == 1 and scraper.kept == 1
        host = endpoint.url.split("/")[2]
        request = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n".encode()
        assert endpoint.requests == [request] * 3
        scraper.close()
        assert scraper.kept == 0


async def test_an_http_1_0_endpoint_that_closes_is_read_to_its_end_and_connected_anew():
    async def one_answer(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)
        for piece in (b"HTTP/1.0 200 OK\r\n", b"\r\n" + PAGE[:20].encode(), PAGE[20:].encode()):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)

    async for endpoint in serving(one_answer):
        scraper = MetricsScraper()
        assert await scraper.fetch(endpoint.url, timeout_s=2.0) == PAGE
        assert await scraper.fetch(endpoint.url, timeout_s=2.0) == PAGE
        assert endpoint.connections == 2 and scraper.kept == 0


async def test_a_server_that_says_close_is_not_kept():
    async def closing(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)
        writer.write(KEPT.replace(b"Content-Type", b"Connection: close\r\nContent-Type"))
        await asyncio.sleep(0.5)                 # and would keep it open, unused

    async for endpoint in serving(closing):
        scraper = MetricsScraper()
        assert await scraper.fetch(endpoint.url, timeout_s=2.0) == PAGE
        assert scraper.kept == 0


async def test_a_kept_connection_the_server_closed_meanwhile_is_replaced_without_a_failed_scrape():
    # The server answers one GET per connection but keeps it open until the next GET arrives, which it
    # reads and drops unanswered: the client cannot know before it sends.
    async def one_then_drop(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)
        writer.write(KEPT)
        await next_request(endpoint, reader)

    async for endpoint in serving(one_then_drop):
        scraper = MetricsScraper()
        assert [await scraper.fetch(endpoint.url, timeout_s=2.0) for _ in range(3)] == [PAGE] * 3
        assert endpoint.connections == 3 and len(endpoint.requests) == 5


async def test_a_kept_connection_closed_while_idle_costs_no_failed_scrape():
    async def one_answer(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)
        writer.write(KEPT)                       # then closes (serving's finally)

    async for endpoint in serving(one_answer):
        scraper = MetricsScraper()
        assert await scraper.fetch(endpoint.url, timeout_s=2.0) == PAGE
        await asyncio.sleep(0.05)                # the close reaches the client
        assert await scraper.fetch(endpoint.url, timeout_s=2.0) == PAGE
        assert endpoint.connections == 2 and len(endpoint.requests) == 2


async def test_a_new_connection_closed_before_an_answer_is_a_scrape_error():
    async def drop(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)

    async for endpoint in serving(drop):
        with pytest.raises(ScrapeError, match=ERR_CLOSED):
            await MetricsScraper().fetch(endpoint.url, timeout_s=2.0)
        assert endpoint.connections == 1


async def test_a_chunked_answer_is_joined():
    body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (PAGE[:10].encode(), PAGE[10:].encode()))
    status, page, reusable = await answer_of(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")
    assert (status, page.decode(), reusable) == (b"200", PAGE, True)


async def test_an_unframed_http_1_1_answer_ends_at_eof_and_is_not_reusable():
    assert await answer_of(b"HTTP/1.1 200 OK\r\n\r\n" + PAGE.encode()) == (b"200", PAGE.encode(), False)


async def test_another_status_is_a_scrape_error_naming_it_and_the_connection_stays():
    async def busy(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        while await next_request(endpoint, reader):
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")

    async for endpoint in serving(busy):
        scraper = MetricsScraper()
        for _ in range(2):
            with pytest.raises(ScrapeError, match="HTTP status 503"):
                await scraper.fetch(endpoint.url, timeout_s=2.0)
        assert endpoint.connections == 1


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nshort"])
async def test_what_is_not_a_whole_http_answer_is_a_scrape_error(answer: bytes):
    with pytest.raises(ScrapeError):
        await answer_of(answer)


async def test_an_endpoint_that_never_answers_times_out_and_its_connection_is_dropped():
    async def silent(endpoint: Endpoint, reader: Reader, writer: Writer) -> None:
        await next_request(endpoint, reader)
        await asyncio.sleep(1)

    async for endpoint in serving(silent):
        scraper = MetricsScraper()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await scraper.fetch(endpoint.url, timeout_s=0.2)
        assert time.monotonic() - started < 1.0 and scraper.kept == 0


async def test_a_closed_port_is_an_os_error():
    with pytest.raises(OSError):
        await MetricsScraper().fetch(f"http://127.0.0.1:{free_ports(1)[0]}/metrics", timeout_s=2.0)


async def test_keep_only_closes_the_connections_of_endpoints_no_longer_scraped():
    async for first in serving(keep_alive):
        async for second in serving(keep_alive):
            scraper = MetricsScraper()
            for endpoint in (first, second):
                await scraper.fetch(endpoint.url, timeout_s=2.0)
            scraper.keep_only({second.url})
            assert scraper.kept == 1
            await scraper.fetch(first.url, timeout_s=2.0)
            await scraper.fetch(second.url, timeout_s=2.0)
            assert (first.connections, second.connections) == (2, 1)
            scraper.close()
