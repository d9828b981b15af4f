"""The run path's latency and throughput against a running Sluice:
`python -m bench.bench_run_path [--address HOST:PORT] [--api-key KEY] [-n 50] [-c 8] [--tokens 40]`.

For each run: Submit, then Stream from sequence 0, timing
- submit→first token: from the Submit call to the first DELTA event received over
  Stream (admission commit, claim poll, replica first step, Kafka append + ledger
  RUNNING, Stream's wait for the run's first event, the consumer's fetch);
- the events and tokens every stream delivered, over the wall time of the batch.
Prints figures; never fails on timing. The tests call `measure` on their own stack.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from sluice.ledger.seed import DEMO_API_KEY
from sluice_client.sdk import Addresses, SluiceClient

from sluice.v1 import common_pb2, runs_pb2

PROMPT = "Summarise how a sluice gate controls the flow of water, in plain words."


@dataclass(frozen=True, slots=True)
class RunPathFigures:
    runs: int
    completed: int
    wall_s: float
    first_token_ms: list[float]        # per run: Submit call → first DELTA event received
    submit_ms: list[float]             # per run: the Submit call alone (admission's share of the above)
    events: int                        # events delivered over Stream, all runs
    tokens: int                        # tokens in those events
    not_completed: list[str]           # "STATUS: detail" of each run that did not complete

    def percentile(self, p: float, values: list[float] | None = None) -> float:
        ordered = sorted(self.first_token_ms if values is None else values)
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    def render(self) -> str:
        mean = statistics.fmean(self.first_token_ms)
        return (f"runs={self.runs} completed={self.completed} wall={self.wall_s:.2f}s\n"
                f"submit→first token: p50={self.percentile(50):.1f} ms p95={self.percentile(95):.1f} ms"
                f" max={max(self.first_token_ms):.1f} ms mean={mean:.1f} ms\n"
                f"  of which Submit: p50={self.percentile(50, self.submit_ms):.1f} ms"
                f" p95={self.percentile(95, self.submit_ms):.1f} ms\n"
                f"delivered: {self.events} events ({self.events / self.wall_s:.0f} events/s),"
                f" {self.tokens} tokens ({self.tokens / self.wall_s:.0f} tokens/s)"
                + "".join(f"\nnot completed: {outcome}" for outcome in self.not_completed))


async def _one(client: SluiceClient, max_tokens: int) -> tuple[float, int, int, str, float]:
    started = time.perf_counter()
    run = await client.submit(PROMPT, max_output_tokens=max_tokens)
    submit_ms = (time.perf_counter() - started) * 1000
    first_ms = -1.0
    events = tokens = 0
    outcome = "no terminal event"
    async for event in client.stream(run.run_id):
        events += 1
        if event.type == runs_pb2.EVENT_TYPE_DELTA:
            if first_ms < 0:
                first_ms = (time.perf_counter() - started) * 1000
            tokens += len(event.token_ids)
        elif event.type == runs_pb2.EVENT_TYPE_TERMINAL and event.status != common_pb2.RUN_STATUS_COMPLETED:
            outcome = f"{common_pb2.RunStatus.Name(event.status)}: {event.detail}"
        elif event.type == runs_pb2.EVENT_TYPE_TERMINAL:
            outcome = ""
    return first_ms, events, tokens, outcome, submit_ms


async def measure(client: SluiceClient, runs: int, concurrency: int, max_tokens: int) -> RunPathFigures:
    gate = asyncio.Semaphore(concurrency)

    async def bounded() -> tuple[float, int, int, str, float]:
        async with gate:
            return await _one(client, max_tokens)

    started = time.perf_counter()
    results = await asyncio.gather(*[bounded() for _ in range(runs)])
    wall = time.perf_counter() - started
    return RunPathFigures(runs=runs, completed=sum(1 for r in results if not r[3]), wall_s=wall,
                          first_token_ms=[r[0] for r in results if r[0] >= 0],
                          submit_ms=[r[4] for r in results],
                          events=sum(r[1] for r in results), tokens=sum(r[2] for r in results),
                          not_completed=[r[3] for r in results if r[3]])


async def _main(args: argparse.Namespace) -> None:
    addresses = Addresses.single(args.address) if args.address else Addresses.from_env()
    async with SluiceClient(addresses, args.api_key) as client:
        await measure(client, 2, 1, 4)  # warm channels and consumers
        figures = await measure(client, args.runs, args.concurrency, args.tokens)
    print(figures.render())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_run_path", description=__doc__)
    parser.add_argument("--address", default=None)
    parser.add_argument("--api-key", default=DEMO_API_KEY)
    parser.add_argument("-n", "--runs", type=int, default=50)
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=40)
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
