"""The routing worker's CPU for two calls it makes on replicas (issue 9), each side by side in one run:
`python -m bench.bench_replica_calls [--scrapes 400] [--requests 20000] [--rounds 5]`.

  scrape    one GET of a replica's metrics page with MetricsScraper (services/routing/scrape.py),
            against prometheus_client's start_http_server (HTTP/1.0: a TCP connection per scrape, as
            every replica served before) and against the replica's own server (metrics_server.py:
            HTTP/1.1, one kept connection). The CPU of the event loop's thread per scrape
            (time.thread_time: the servers' threads in this process are not counted).
  request   a run's request bytes: build_request + SerializeToString against the template
            (services/replica_request.py), a 60-token prompt with a salt and an end id; CPU per request.

Medians of --rounds, the two sides alternated. Prints figures only; never fails on timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import uvloop
from prometheus_client import start_http_server
from sluice.services.replica_client import build_request
from sluice.services.replica_request import RequestTemplates
from sluice.services.routing.scrape import MetricsScraper

from sluice.replica.metrics import ReplicaMetrics
from sluice.replica.metrics_server import serve_metrics
from tests.support.replica_proc import free_ports


async def scrapes(count: int, rounds: int) -> None:
    metrics = ReplicaMetrics(start_time=time.time())
    closing_port, kept_port = free_ports(2)
    start_http_server(closing_port, addr="127.0.0.1", registry=metrics.registry)
    server = serve_metrics(metrics.registry, kept_port)
    scraper = MetricsScraper()
    sides: dict[str, Callable[[], Awaitable[str]]] = {
        "a connection per scrape (HTTP/1.0 server)":
            lambda: scraper.fetch(f"http://127.0.0.1:{closing_port}/metrics", 1.0),
        "one kept connection (the replica's server)":
            lambda: scraper.fetch(f"http://127.0.0.1:{kept_port}/metrics", 1.0)}
    spent: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, scrape in sides.items():
            started = time.thread_time()
            for _ in range(count):
                await scrape()
            spent[name].append((time.thread_time() - started) / count)
    for name, figures in spent.items():
        print(f"scrape, {name}: {statistics.median(figures) * 1e6:.0f} us of the event loop's thread"
              f" (median of {rounds} x {count}; {', '.join(f'{f * 1e6:.0f}' for f in figures)})", flush=True)
    scraper.close()
    server.shutdown()


def requests(count: int, rounds: int) -> None:
    templates = RequestTemplates()
    prompt, run_id = list(range(100, 160)), "run-0123456789abcdef"
    sides: dict[str, Callable[[], bytes]] = {
        "build_request + SerializeToString":
            lambda: build_request(run_id, prompt, 300, 2, cache_salt=12345).SerializeToString(),
        "template": lambda: templates.encode(run_id, prompt, 300, 2, cache_salt=12345)}
    spent: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, make in sides.items():
            started = time.process_time()
            for _ in range(count):
                make()
            spent[name].append((time.process_time() - started) / count)
    for name, figures in spent.items():
        print(f"a run's request, {name}: {statistics.median(figures) * 1e6:.1f} us CPU"
              f" (median of {rounds} x {count})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=400)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    uvloop.run(scrapes(args.scrapes, args.rounds))
    requests(args.requests, args.rounds)


if __name__ == "__main__":
    main()
