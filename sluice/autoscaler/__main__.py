"""`python -m sluice.autoscaler --pool POOL`: one pool's autoscaler (sluice.autoscaler.app)."""

from __future__ import annotations

import argparse
import asyncio

from sluice.autoscaler.app import make_provider, pool_table, scaler_config, serve
from sluice.autoscaler.provider import ProviderError
from sluice.config.bootstrap import EXIT_BAD_CONFIG, start_process
from sluice.config.settings import ConfigError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.autoscaler", description=__doc__)
    parser.add_argument("--pool", required=True, help="the worker pool to scale ([autoscaler.pools.POOL])")
    args = parser.parse_args(argv)
    run(args.pool)


def run(pool: str) -> None:
    """Bootstrap and serve; a pool without a table stops the process like any bad config."""
    config = start_process("autoscaler")
    try:
        table = pool_table(config, pool)
        scaler_config(config, table)
        make_provider(config, table, pool)      # a kubernetes provider without its API server or token
    except (ConfigError, ValueError, ProviderError) as exc:
        print(f"sluice autoscaler: refusing to start: {exc}", flush=True)
        raise SystemExit(EXIT_BAD_CONFIG) from None
    asyncio.run(serve(config, pool))


if __name__ == "__main__":
    main()
