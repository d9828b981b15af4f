"""`python -m sluice.services.routing [--listen HOST:PORT] [--name LABEL]`: one routing worker process.

Start several: they share the ledger and claim runs with SKIP LOCKED, each run
exactly once. `--listen` also serves the Routing API ([routing].listen is the
configured address; only one process can bind it). The same process as
`python -m sluice.services.main --role routing` (one bootstrap for every role).
"""

from __future__ import annotations

import argparse

from sluice.services import eventloop
from sluice.services.main import serve

from sluice.config.bootstrap import start_process


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.services.routing", description=__doc__)
    parser.add_argument("--listen", default=None, help="serve the Routing API here (default: not served)")
    parser.add_argument("--serve-api", action="store_true", help="serve the Routing API on [routing].listen")
    parser.add_argument("--name", default=None, help="label in this worker's lease owner id")
    args = parser.parse_args(argv)
    config = start_process("routing")
    listen = args.listen or (config.routing.listen if args.serve_api else None)
    # The same loop as `main --role routing` ([gateway].event_loop, uvloop by default): the routing
    # process's time goes to many small socket reads and writes too (replica streams, Kafka, PostgreSQL).
    eventloop.run(serve(config, {"routing"}, [], listen, args.name), config.gateway.event_loop)


if __name__ == "__main__":
    main()
