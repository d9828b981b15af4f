"""The routing process's metrics scrape (services/routing/scrape.py): one HTTP/1.0 GET per scrape on a
plain asyncio connection. Against stand-in endpoints (a TCP listener answering what a metrics server
would); tests/test_routing_live.py scrapes real replicas through the worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from sluice.services.routing.scrape import ScrapeError, body_of, fetch_metrics

from tests.support.replica_proc import free_ports

PAGE = "# TYPE nv_inference_count counter\nnv_inference_count{model=\"m\"} 7\n"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serving(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    finally:
        server.close()
        await server.wait_closed()


def test_a_200_answer_gives_its_body():
    assert body_of(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + PAGE.encode()) == PAGE


def test_another_status_is_a_scrape_error_naming_it():
    with pytest.raises(ScrapeError, match="HTTP status 503"):
        body_of(b"HTTP/1.1 503 Service Unavailable\r\n\r\nbusy")


@pytest.mark.parametrize("answer", [b"", b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.0 200 OK\r\nContent-Le"])
def test_what_is_not_a_whole_http_answer_is_a_scrape_error(answer: bytes):
    with pytest.raises(ScrapeError):
        body_of(answer)


async def test_one_http_1_0_get_of_the_path_reads_the_page_to_the_end():
    requests: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + PAGE.encode())
        await writer.drain()
        writer.close()

    async for url in serving(answer):
        assert await fetch_metrics(url, timeout_s=2.0) == PAGE
    assert len(requests) == 1 and requests[0].startswith(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1:")


async def test_an_answer_sent_in_pieces_is_read_until_the_server_closes():
    async def in_pieces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for piece in (b"HTTP/1.0 200 OK\r\n", b"\r\n" + PAGE[:20].encode(), PAGE[20:].encode()):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()

    async for url in serving(in_pieces):
        assert await fetch_metrics(url, timeout_s=2.0) == PAGE


async def test_an_endpoint_that_never_answers_times_out():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1)

    async for url in serving(silent):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await fetch_metrics(url, timeout_s=0.2)
        assert time.monotonic() - started < 1.0


async def test_a_closed_port_is_an_os_error():
    with pytest.raises(OSError):
        await fetch_metrics(f"http://127.0.0.1:{free_ports(1)[0]}/metrics", timeout_s=2.0)
