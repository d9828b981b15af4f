"""CPU of one routing worker process per delivered token and per run, read from /proc:
`python -m bench.bench_routing_cpu [--runs 64] [--concurrency 32] [--tokens 200] [--short-runs 64]`.

Starts its own stack on the shared PostgreSQL and Kafka: a fresh migrated database, two "simple"
engine replicas (20 ms per token: they stay far from saturating the box at these concurrencies),
Admission + Runs in this process, and ONE routing worker as a separate process
(`python -m sluice.services.routing`), so that its utime + stime in /proc/<pid>/stat is the routing
side alone, whatever else the shared cores are doing. Two batches:
- long runs (`--tokens` each): routing CPU per delivered token;
- short runs (2 tokens each): routing CPU per run.
Also counts runs that did not complete (INTERRUPTED etc.). Prints figures; never fails on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.services.admission import add_admission_servicer
from sluice.services.runs import add_runs_servicer
from sluice_client.sdk import SluiceClient

from bench.bench_run_path import measure
from sluice.eventlog.kafka import KafkaEventLog
from tests.support.db import create_database, drop_database, run_alembic, unique_name
from tests.support.ledger_factories import add_model, add_tenant
from tests.support.replica_proc import start_replica, stop_replica
from tests.support.routing_stack import MODEL, REPLICA_SETTINGS, TOKENIZER, launch_worker_process, test_config

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (this process alone, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True, slots=True)
class CpuFigure:
    label: str
    runs: int
    completed: int
    tokens: int
    events: int
    wall_s: float
    worker_cpu_s: float

    def render(self) -> str:
        per_token = self.worker_cpu_s / max(1, self.tokens) * 1e6
        per_run = self.worker_cpu_s / max(1, self.runs) * 1e3
        per_event = self.tokens / max(1, self.events)
        return (f"{self.label}: runs={self.runs} completed={self.completed}"
                f" not_completed={self.runs - self.completed}"
                f" tokens={self.tokens} events={self.events} ({per_event:.1f} tok/event)"
                f" wall={self.wall_s:.1f}s routing-worker cpu={self.worker_cpu_s:.2f}s"
                f" -> {per_token:.0f} us/token, {per_run:.1f} ms/run")


async def _batch(client: SluiceClient, pid: int, label: str, runs: int, concurrency: int,
                 tokens: int) -> CpuFigure:
    before = cpu_seconds(pid)
    figures = await measure(client, runs, concurrency, tokens)
    await asyncio.sleep(0.5)   # the worker's last publications and settlements
    used = cpu_seconds(pid) - before
    for outcome in sorted(set(figures.not_completed))[:5]:
        print(f"  not completed: {outcome}")
    return CpuFigure(label, runs, figures.completed, figures.tokens, figures.events, figures.wall_s, used)


async def _main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    name = unique_name("sluice_bench")
    dsn = await create_database(name)
    replicas = []
    worker = None
    try:
        await run_alembic(dsn, "upgrade", "head")
        engine = make_engine(dsn)
        sessions = make_sessionmaker(engine)
        async with sessions() as session, session.begin():
            await add_model(session, TOKENIZER, MODEL)
            tenant = await add_tenant(session, "bench", token_budget=10**12, cost_budget_micros=10**15)
        for replica_name in ("b0", "b1"):
            replicas.append(await asyncio.to_thread(start_replica, replica_name, logs, REPLICA_SETTINGS))
        config = test_config(dsn, replicas)
        config = config.updated(routing={"lease_seconds": 5})
        worker = await asyncio.to_thread(launch_worker_process, config, logs, "bench", args.profile)
        events = KafkaEventLog.from_config(config)
        await events.start()
        server = grpc.aio.server()
        admission = add_admission_servicer(server, sessions, config)
        runs_service = add_runs_servicer(server, sessions, config, events)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with SluiceClient(f"127.0.0.1:{port}", tenant.api_key) as client:
                await measure(client, 4, 2, 4)   # warm channels, consumers, tokenizers
                pid = worker.process.pid
                print(f"replicas: simple engine, {REPLICA_SETTINGS['token_delay_ms']} ms/token; "
                      f"routing worker pid {pid}; coalesce_ms={config.kafka.coalesce_ms}")
                long = await _batch(client, pid, f"long runs ({args.tokens} tokens, c={args.concurrency})",
                                    args.runs, args.concurrency, args.tokens)
                print(long.render(), flush=True)
                short = await _batch(client, pid, f"short runs (2 tokens, c={args.concurrency})",
                                     args.short_runs, args.concurrency, 2)
                print(short.render(), flush=True)
        finally:
            await server.stop(None)
            await admission.close()
            await runs_service.close()
            await events.close()
            await engine.dispose()
    finally:
        if worker is not None:
            worker.stop()
            if args.profile:
                _print_profile(args.profile)
        for replica in replicas:
            await asyncio.to_thread(stop_replica, replica)
        await drop_database(name)


def _print_profile(path: str) -> None:
    import pstats
    pstats.Stats(path).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_routing_cpu", description=__doc__)
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--short-runs", type=int, default=64)
    parser.add_argument("--profile", default=None, help="write the routing worker's cProfile stats here")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
