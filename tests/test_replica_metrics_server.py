"""The replica's metrics port (sluice/replica/metrics_server.py): the Prometheus page over HTTP/1.1,
several GETs on one connection, each framed by its Content-Length; and the routing process's scraper
keeps one connection to it."""

from __future__ import annotations

import socket

from prometheus_client import generate_latest
from sluice.services.routing.scrape import MetricsScraper

from sluice.replica.metrics import START_TIME_METRIC, ReplicaMetrics
from sluice.replica.metrics_server import serve_metrics
from sluice.router.load import parse_metrics
from tests.support.replica_proc import free_ports


def read_answer(sock: socket.socket, buffered: bytes) -> tuple[bytes, bytes, bytes]:
    """(head, body, what was read past it) of one answer framed by its Content-Length."""
    data = buffered
    while b"\r\n\r\n" not in data:
        data += received(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(rest) < length:
        rest += received(sock)
    return head, rest[:length], rest[length:]


def received(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    assert data, "the server closed the connection"
    return data


def test_two_gets_on_one_connection_each_get_the_whole_page():
    metrics = ReplicaMetrics(start_time=1234.5)
    port = free_ports(1)[0]
    server = serve_metrics(metrics.registry, port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            leftover = b""
            for path in (b"/metrics", b"/"):
                sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                head, body, leftover = read_answer(sock, leftover)
                assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
                assert b"content-type: text/plain; version=0.0.4" in head.lower()
                assert body == generate_latest(metrics.registry)
            assert leftover == b""
    finally:
        server.shutdown()
        server.server_close()


async def test_the_routing_scraper_keeps_one_connection_to_a_replica_across_scrapes():
    metrics = ReplicaMetrics(start_time=1234.5)
    port = free_ports(1)[0]
    server = serve_metrics(metrics.registry, port)
    scraper = MetricsScraper()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        pages = [await scraper.fetch(url, timeout_s=2.0) for _ in range(3)]
        assert scraper.kept == 1
        assert all(parse_metrics(page).start_time == 1234.5 for page in pages)
        assert START_TIME_METRIC in pages[0]
    finally:
        scraper.close()
        server.shutdown()
        server.server_close()
