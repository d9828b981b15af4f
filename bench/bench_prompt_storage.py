"""PostgreSQL backend CPU of storing and reading a run's prompt ids by column compression.

`python -m bench.bench_prompt_storage [--rows 1000] [--tokens 2000] [--rounds 3]` (PostgreSQL
running: `make infra-up`; SLUICE_DATABASE_URL or the dev database)

Packs --rows prompts of ~--tokens tiny-chat tokens (random slices of the model's corpus, as
ledger/token_ids.py stores them: ~7.7 KB at 2,000, above the 2 KB TOAST threshold), then for each
of pglz (PostgreSQL's default), lz4 (migration 0015) and no compression (STORAGE EXTERNAL), in
rounds, inserts them into a scratch table shaped like `runs` (fillfactor 70) and reads each back
by key with prepared statements. Prints the backend's CPU per row (its /proc ticks, so ~10 us
resolution at 1,000 rows) for the insert and the read, and the table's bytes per row. The scratch
table is dropped at the end; never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import uuid

import asyncpg
from sluice.ledger.pg import asyncpg_dsn
from sluice.ledger.token_ids import pack
from sluice.services.tokenization import encode

from bench.bench_platform import corpus_chars_for, corpus_of
from bench.platform_stack import process_cpu_seconds

DEV_DSN = "postgresql+asyncpg://sluice:sluice@127.0.0.1:54329/sluice"
COLUMN = {"pglz": "SET COMPRESSION pglz", "lz4": "SET COMPRESSION lz4", "none": "SET STORAGE EXTERNAL"}


def backend_cpu_s(pid: int) -> float:
    seconds = process_cpu_seconds(pid)
    assert seconds is not None, f"the PostgreSQL backend {pid} is gone"
    return seconds


async def one_round(conn: asyncpg.Connection, pid: int, mode: str,
                    payloads: list[bytes]) -> tuple[float, float, int]:
    await conn.execute("DROP TABLE IF EXISTS bench_prompt_storage")
    await conn.execute("CREATE TABLE bench_prompt_storage (id uuid PRIMARY KEY, status text, ids bytea)"
                       " WITH (fillfactor = 70)")
    await conn.execute(f"ALTER TABLE bench_prompt_storage ALTER COLUMN ids {COLUMN[mode]}")
    insert = await conn.prepare("INSERT INTO bench_prompt_storage VALUES ($1, 'ACCEPTED', $2)")
    read = await conn.prepare("SELECT ids FROM bench_prompt_storage WHERE id = $1")
    keys = [uuid.uuid4() for _ in payloads]
    start = backend_cpu_s(pid)
    for key, payload in zip(keys, payloads, strict=True):
        await insert.fetch(key, payload)
    inserted = backend_cpu_s(pid)
    for key, payload in zip(keys, payloads, strict=True):
        assert await read.fetchval(key) == payload
    read_back = backend_cpu_s(pid)
    size = await conn.fetchval("SELECT pg_total_relation_size('bench_prompt_storage')")
    rows = len(payloads)
    return (inserted - start) / rows * 1e6, (read_back - inserted) / rows * 1e6, size // rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    corpus = corpus_of("corpus")
    chars = corpus_chars_for(corpus, args.tokens)
    rng = random.Random(1)
    starts = [rng.randrange(len(corpus) - chars) for _ in range(args.rows)]
    payloads = [pack(encode("tiny-chat/tokenizer.json", corpus[s:s + chars])) for s in starts]
    conn = await asyncpg.connect(asyncpg_dsn(os.environ.get("SLUICE_DATABASE_URL", DEV_DSN)))
    figures: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in COLUMN}
    try:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        for _ in range(args.rounds):
            for mode in COLUMN:
                figures[mode].append(await one_round(conn, pid, mode, payloads))
    finally:
        await conn.execute("DROP TABLE IF EXISTS bench_prompt_storage")
        await conn.close()
    size = statistics.median(map(len, payloads))
    print(f"bench-prompt-storage: {args.rows} rows of ~{args.tokens} tokens ({size:.0f} bytes of ids),"
          f" {args.rounds} rounds, PostgreSQL backend CPU per row (median of rounds)")
    for mode, rounds in figures.items():
        print(f"  {mode:5s} insert {statistics.median(r[0] for r in rounds):4.0f} us, read"
              f" {statistics.median(r[1] for r in rounds):4.0f} us, {rounds[0][2]} bytes per row stored")


if __name__ == "__main__":
    asyncio.run(main())
