"""The replica's metrics port: the Prometheus text page over HTTP/1.1 with keep-alive.

prometheus_client's start_http_server is a wsgiref server: HTTP/1.0, one answer per connection.
The routing process scrapes each replica four times a second while it drives runs, and a new TCP
connection per scrape cost it ~0.5 ms of CPU each (services/routing/scrape.py keeps one connection
per endpoint instead). Triton's own metrics port keeps connections alive too. Here each connection
has a thread that answers its GETs one after another, each with a Content-Length, until the client
closes it or leaves it idle for IDLE_TIMEOUT_S:

    GET <any path> ──▶ generate_latest(registry) ──▶ 200 with a Content-Length, in one write
                                                     (text/plain; version=0.0.4, as start_http_server)

Every path answers the page, as start_http_server's did (a scraper's /metrics, a person's /).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

IDLE_TIMEOUT_S = 60.0        # an idle kept connection is closed after this (a scraper that vanished)


class _Server(ThreadingHTTPServer):
    daemon_threads = True            # a connection's thread never holds the replica's exit
    block_on_close = False
    registry: CollectorRegistry


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"    # keep-alive unless the client asks to close
    timeout = IDLE_TIMEOUT_S
    disable_nagle_algorithm = True
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        page = generate_latest(self.server.registry)
        # One write: headers sent apart from the body would wait for the client's delayed ACK (Nagle)
        # on a connection that stays open.
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE_PLAIN_0_0_4.encode("ascii")
                         + b"\r\nContent-Length: " + str(len(page)).encode("ascii") + b"\r\n\r\n" + page)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        """Silent: a line per scrape would be four a second per routing process."""


def serve_metrics(registry: CollectorRegistry, port: int, address: str = "127.0.0.1") -> _Server:
    """Serve `registry` on address:port from a daemon thread; returns the server (shutdown() ends it)."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(_Server):
        address_family = family          # read when the socket is made (IPv6 addresses too)

    server = Server((address, port), _Handler)
    server.registry = registry
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
