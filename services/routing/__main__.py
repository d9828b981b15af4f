"""`python -m sluice.services.routing [--listen HOST:PORT] [--name LABEL]`: one routing worker process.

Start several: they share the ledger and claim runs with SKIP LOCKED, each run
exactly once. `--listen` also serves the Routing API ([routing].listen is the
configured address; only one process can bind it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from sluice.config import load_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.services.routing", description=__doc__)
    parser.add_argument("--listen", default=None, help="serve the Routing API here (default: not served)")
    parser.add_argument("--serve-api", action="store_true", help="serve the Routing API on [routing].listen")
    parser.add_argument("--name", default=None, help="label in this worker's lease owner id")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # it logs every consumer's assignment at INFO
    config = load_config()
    listen = args.listen or (str(config["routing"]["listen"]) if args.serve_api else None)
    from sluice.services.routing.app import run_routing_process

    asyncio.run(run_routing_process(config, listen, args.name))


if __name__ == "__main__":
    main()
