"""What binding a prompt's token ids costs the client (asyncpg), by how they are sent: as an int4[]
(a list: asyncpg's array encoder, what runs.prompt_token_ids took before migration 0014), as a text
literal cast by PostgreSQL, and as bytes (ledger/token_ids.pack, what the ledger stores now).

    python -m bench.bench_token_ids [--tokens 30,2000] [--statements 300]

Client CPU per statement (time.process_time: this process only; the round trip's own share is in
every line alike), each encoding measured twice, interleaved. Prints figures; never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import asyncpg
from sluice.ledger import token_ids
from sluice.ledger.pg import asyncpg_dsn

from sluice.config import load_settings


def literal(ids: list[int]) -> str:
    return "{" + str(ids)[1:-1] + "}"


async def bench(sizes: list[int], statements: int) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(load_settings().database.url))
    try:
        as_array = await connection.prepare("SELECT cardinality($1::int4[])")
        as_text = await connection.prepare("SELECT cardinality($1::text::int4[])")
        as_bytes = await connection.prepare("SELECT length($1::bytea) / 4")
        encodings = (("int4[] (a list)", as_array, lambda ids: ids), ("text literal", as_text, literal),
                     ("bytes (token_ids.pack)", as_bytes, token_ids.pack))
        for size in sizes:
            ids = [random.randrange(50_000) for _ in range(size)]
            for _, statement, encode in encodings:   # the same count back from each: a fair comparison
                assert await statement.fetchval(encode(ids)) == size
            spent: dict[str, list[float]] = {name: [] for name, _, _ in encodings}
            for _ in range(2):
                for name, statement, encode in encodings:
                    started = time.process_time()
                    for _ in range(statements):
                        await statement.fetchval(encode(ids))
                    spent[name].append((time.process_time() - started) / statements * 1e6)
            print(f"{size} ids, {statements} statements each: " + "; ".join(
                f"{name} {' / '.join(f'{us:.0f}' for us in figures)} us" for name, figures in spent.items()),
                flush=True)
    finally:
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="30,2000", help="comma-separated prompt lengths")
    parser.add_argument("--statements", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(bench([int(size) for size in args.tokens.split(",")], args.statements))


if __name__ == "__main__":
    main()
