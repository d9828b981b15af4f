"""Platform cost and latency on the real stack (`make bench-platform`, issue 9):
`python -m bench.bench_platform [--quick] [--token-delay-ms 100] [--gateways 2] [--routing-workers 1]`.

Starts everything itself on a throwaway database and a private Kafka topic (PostgreSQL and Kafka
must be running: `make infra-up`): two Triton replicas running the "simple" engine at
--token-delay-ms per step (default 100 ms: one token per live request per step, so 256 streams
ask the replicas for ~2,560 tokens/s; at 0.7-1.2 ms of CPU per token they deliver ~1,500-2,300 of
them and most of the box is theirs), --gateways gateway processes (`sluice.services.main --role
gateway`, each on its own port) and --routing-workers routing worker processes
(`sluice.services.routing`, [routing].max_runs_per_worker raised so they hold every stream).
Clients spread over the gateways and 50 tenants.

--wire-replicas (`make bench-platform-seed`: --token-delay-ms 8.5) serves the same simple engine from
bench/wire_replica.py instead: byte for byte the responses a Triton replica sends
(tests/test_wire_replica.py) for ~25-40 us of CPU per token instead of 0.7-1.2 ms, so that the
streams can run at seed 002's ~117 tokens/s each (30,000 tokens/s over 256 streams; ~23 tokens per
200 ms DELTA window) on the box that also runs the platform, where Triton replicas allow ~10 per
stream (~2 tokens per event). The platform is the same either way; what changes is how many tokens
each of its per-event, per-run and per-second costs is divided by.

Phases, in order, with the CPU-seconds each component spent read from /proc (platform = gateway
+ routing worker + the PostgreSQL backends of the bench database + the Kafka JVM; replicas and
this client are reported apart, never in the platform figure):

  ttft       TTFT added over calling a Triton replica directly, measured side by side: each
             round calls the replica (services.replica_client.stream_generate, same prompt
             length, 4 tokens) and the platform (Submit → first DELTA over Stream), one at a
             time, then 16 of each concurrently. The platform is called through the direct
             call's own client (bench/lean_client.py: replica_conn's HTTP/2) and, in the same
             rounds, through grpc.aio (the SDK's transport); the headline is the former, the same
             client on both sides. For each, from a round's start to its last first token: how
             busy the box's CPUs were, how long runnable tasks waited for one
             (/proc/pressure/cpu) and the box's CPU per run (is the burst short of CPU?). Then
             16 concurrent with their starts spread instead of at once: 16 callers each making
             its next call of ~1 s of tokens as its last ends, started 1/16 of a call apart
             (direct, lean client, grpc.aio, direct again): 16 users streaming at once, where the
             burst is 16 users pressing enter in the same millisecond
  run-cost   platform CPU per run of 2 output tokens (concurrency 16)
  stream-64  platform CPU per delivered token, 64 concurrent 300-token streams
  stream-256 the same at 256
  interrupt  runs ending INTERRUPTED among 1,000 runs at 256 concurrent streams of 100 tokens
             (--interrupt-runs/--interrupt-tokens; --burn N loads the box with N CPU burners at
             nice 0 meanwhile): the count of every outcome, the reason of each run that did not
             complete, and the routing workers' lease log lines (renewals failed, leases lost, reaped)
  submit     Submit latency at 500 Submits/s offered open-loop (fixed arrival times, latency
             from the scheduled time) over 50 tenants round-robin across the gateways, routing
             workers stopped and the backlog claimed every 50 ms by a stand-in (as bench_submit);
             gateway CPU per Submit

Prints every figure with its conditions and the box's load average; never fails on timing.
--quick shrinks every phase. --py-spy SECONDS samples one gateway process and the routing worker
with py-spy (installed apart: `pip install py-spy`) during stream-64 (--py-spy-phase runs or idle:
during the run-cost phase or with the stack idle instead; submit: the gateway alone during the
submit phase) and prints each one's top five functions by own time. --cost-runs N sets the
run-cost phase's size (longer phases: steadier figures, room for a profile). The line "idle
stack" is each component's CPU per second with nothing to do. --prompt-tokens N gives every run (and
the direct call beside it) a prompt of about N tokens: seed 002's runs carry ~2,000, which the
Submit pays for in tokenization and in the run row (`make bench-platform-seed` uses 2,000).

Before anything is measured, --warm-broker RUNS (default 64) stream-length runs at 64 concurrent
warm the broker: a JVM compiles its produce and fetch paths during its first heavy load, and the
phase that came first after an idle broker used to pay for that (with the default tiered C2 JIT
the first 64-stream phase spent 60-150 ms CPU/s in the compiler threads). The figures are the
steady state's; --warm-broker 0 shows the cold one. Broker analysis (use a private broker, see
infra/kafka.sh): --stream-passes N repeats each stream phase, --broker-threads prints the broker's
CPU by thread per phase, --request-log counts its requests per event by api.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import asyncpg
import grpc.aio
from sluice.ledger.seed import TINY_CHAT
from sluice.services import replica_client
from sluice.services.notify import asyncpg_dsn
from sluice.services.tokenization import encode

from bench.bench_submit import _claim_backlog
from bench.lean_client import CallFailed, LeanClient
from bench.platform_stack import (
    CLOCK_TICKS,
    COMPONENTS,
    CpuMeter,
    CpuSample,
    PlatformStack,
    StackSettings,
    create_database,
    create_topic,
    delete_topic,
    drop_database,
    tenant_key,
)
from sluice.config import load_settings
from sluice.models import MODELS_DIR
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2, runs_pb2, runs_pb2_grpc

T = TypeVar("T")
PROMPT = "Summarise how a sluice gate controls the flow of water, in plain words, for a new operator."
# What --prompt-tokens repeats to reach its length (seed 002's runs carry ~2,000 prompt tokens).
FILLER = ("A sluice gate is a sliding barrier in a channel; raising it lets more water through and lowering"
          " it holds the flow back, so an operator watches the levels upstream and downstream. ")
TENANTS = 50
STREAM_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Plan:
    """How big each phase is (full or --quick)."""

    ttft_serial: int               # one-at-a-time pairs (direct, platform)
    ttft_rounds: int               # rounds of 16 direct then 16 platform at once
    ttft_steady: int               # calls per caller at 16 staggered callers (next call as one ends)
    cost_runs: int                 # 2-token runs
    stream_tokens: int             # output tokens per stream in stream-64/256
    stream_runs_64: int
    stream_runs_256: int
    interrupt_runs: int
    interrupt_tokens: int
    submit_seconds: float


FULL = Plan(ttft_serial=40, ttft_rounds=10, ttft_steady=10, cost_runs=200, stream_tokens=300,
            stream_runs_64=64, stream_runs_256=256, interrupt_runs=1000, interrupt_tokens=100,
            submit_seconds=10.0)
QUICK = Plan(ttft_serial=12, ttft_rounds=2, ttft_steady=3, cost_runs=48, stream_tokens=100,
             stream_runs_64=64, stream_runs_256=256, interrupt_runs=256, interrupt_tokens=40,
             submit_seconds=3.0)


def pct(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


# --- client -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RunOutcome:
    ttft_s: float          # Submit call → first DELTA received (nan if none)
    tokens: int
    events: int
    status: str            # terminal status name, or "ERROR <code>" when the call failed
    detail: str
    run_id: str = ""
    submitted_at: float = 0.0   # wall clock (time.time()) when Submit was called
    first_at: float = 0.0       # wall clock when the first DELTA arrived (0: none)
    # Each later DELTA: ms from its publish (the event's time_ms, the routing worker's wall clock at
    # the window's close) to its arrival here: the event log's and the gateway's share of a token's wait.
    delivery_ms: tuple[float, ...] = ()
    answered_at: float = 0.0    # wall clock when Submit's answer arrived (0: none)
    first_published_ms: int = 0  # the first DELTA's time_ms: the routing worker's clock as it published


class Client:
    """Raw stubs on one channel per gateway; tenant i's calls carry tenant i's key. `run(lean=True)`
    calls through bench/lean_client.py instead of grpc.aio (the TTFT phase: the direct call's client)."""

    def __init__(self, addresses: Sequence[str], prompt: str = PROMPT, corpus: str = "") -> None:
        self.prompt = prompt
        # --prompt-source corpus: each Submit a slice of `corpus` of as many tokens as `prompt`, at a random
        # offset: texts that never repeat whose words do, as real prompts (the tokenizer remembers
        # pieces: one prompt sent again and again would be its best case).
        self._corpus = corpus
        self._offsets = random.Random(17)
        tokens = len(encode(TINY_CHAT.tokenizer, prompt))
        self._corpus_chars = corpus_chars_for(corpus, tokens) if corpus else 0
        self.channels = [grpc.aio.insecure_channel(address) for address in addresses]
        self.admission = [admission_pb2_grpc.AdmissionStub(c) for c in self.channels]
        self.runs = [runs_pb2_grpc.RunsStub(c) for c in self.channels]
        self.lean = LeanClient(addresses)
        self._next = 0

    async def close(self) -> None:
        self.lean.close()
        for channel in self.channels:
            await channel.close()

    def pick(self) -> tuple[int, int]:
        """(gateway, tenant) for the next call: both round-robin."""
        self._next += 1
        return self._next % len(self.channels), self._next % TENANTS

    def next_prompt(self) -> str:
        if not self._corpus:
            return self.prompt
        start = self._offsets.randrange(len(self._corpus) - self._corpus_chars)
        return self._corpus[start:start + self._corpus_chars]

    def _request(self, tokens: int) -> admission_pb2.SubmitRequest:
        return admission_pb2.SubmitRequest(model="chat", input=self.next_prompt().encode(),
                                           max_output_tokens=tokens, request_key=uuid.uuid4().hex)

    async def submit(self, gateway: int, tenant: int, tokens: int, lean: bool = False) -> str:
        if lean:
            return str((await self.lean.submit(gateway, tenant_key(tenant), self._request(tokens))).run_id)
        metadata = (("x-api-key", tenant_key(tenant)),)
        response = await self.admission[gateway].Submit(self._request(tokens), metadata=metadata)
        return str(response.run_id)

    async def _submitted(self, gateway: int, tenant: int, tokens: int, lean: bool) -> tuple[
            str, AsyncIterator[runs_pb2.RunEvent]]:
        """Submit, then open the run's Stream: (run id, its events)."""
        key = tenant_key(tenant)
        run_id = await self.submit(gateway, tenant, tokens, lean)
        if lean:
            return run_id, self.lean.stream(gateway, key, runs_pb2.StreamRequest(run_id=run_id, after=0))
        return run_id, self.runs[gateway].Stream(runs_pb2.StreamRequest(run_id=run_id, after=0),
                                                 metadata=(("x-api-key", key),))

    async def run(self, tokens: int, on_first: Callable[[], None] | None = None,
                  lean: bool = False) -> RunOutcome:
        """One run read to its terminal event; `on_first` is called as its first DELTA arrives."""
        gateway, tenant = self.pick()
        submitted_at, first_at, run_id = time.time(), 0.0, ""
        answered_at, first_published_ms = 0.0, 0
        started = time.perf_counter()
        first = float("nan")
        received = events = 0
        delivery: list[float] = []
        status, detail = "NO TERMINAL", ""
        try:
            run_id, stream = await self._submitted(gateway, tenant, tokens, lean)
            answered_at = time.time()
            async for event in stream:
                events += 1
                if event.type == runs_pb2.EVENT_TYPE_DELTA:
                    if received == 0:
                        first = time.perf_counter() - started
                        first_at = time.time()
                        first_published_ms = event.time_ms
                        if on_first is not None:
                            on_first()
                    else:
                        delivery.append(time.time() * 1000 - event.time_ms)
                    received += len(event.token_ids)
                elif event.type == runs_pb2.EVENT_TYPE_TERMINAL:
                    status = common_pb2.RunStatus.Name(event.status).removeprefix("RUN_STATUS_")
                    detail = event.detail
        except grpc.aio.AioRpcError as error:
            status, detail = f"ERROR {error.code().name}", error.details() or ""
        except CallFailed as error:
            status, detail = f"ERROR {error.code}", error.details
        return RunOutcome(first, received, events, status, detail, run_id, submitted_at, first_at,
                          tuple(delivery), answered_at, first_published_ms)


def corpus_of(source: str) -> str:
    """The text --prompt-source corpus slices prompts from: the model's corpus, its words one space
    apart ("" for --prompt-source repeat). ~10% of 2,000-token slices hold a non-ASCII character."""
    if source != "corpus":
        return ""
    return " ".join((MODELS_DIR / "corpus.txt").read_text().split())


def corpus_chars_for(corpus: str, tokens: int) -> int:
    """How many characters of `corpus` make about `tokens` tokens (the chat template included), from
    the first 20 slices of 10,000 characters."""
    samples = [corpus[i * 10_000:(i + 1) * 10_000] for i in range(20)]
    per_char = sum(len(encode(TINY_CHAT.tokenizer, sample)) for sample in samples) / 200_000
    return min(round(tokens / per_char), len(corpus) // 2)


def prompt_of(tokens: int) -> str:
    """PROMPT, then FILLER repeated and cut at a word until the model's input (chat template included)
    is about `tokens` long; PROMPT alone when that is already longer."""
    text = PROMPT
    if len(encode(TINY_CHAT.tokenizer, text)) >= tokens:
        return text
    while len(encode(TINY_CHAT.tokenizer, text)) < tokens:
        text += FILLER
    words = text.split(" ")
    low, high = 1, len(words)
    while low < high:          # the fewest words that reach `tokens`
        middle = (low + high) // 2
        if len(encode(TINY_CHAT.tokenizer, " ".join(words[:middle]))) >= tokens:
            high = middle
        else:
            low = middle + 1
    return " ".join(words[:low])


async def bounded(count: int, concurrency: int, make: Callable[[], Awaitable[T]]) -> list[T]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> T:
        async with gate:
            return await make()

    return list(await asyncio.gather(*(one() for _ in range(count))))


# --- phases -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Spent:
    wall_s: float
    cpu: dict[str, float]          # component -> CPU-seconds over the phase
    backends: dict[int, float] = field(default_factory=dict)   # PostgreSQL backend pid -> CPU-seconds

    @property
    def platform(self) -> float:
        return sum(self.cpu[name] for name in COMPONENTS)

    def split(self, per: float, unit: str, scale: float) -> str:
        parts = " ".join(f"{name} {self.cpu[name] / per * scale:.1f}" for name in COMPONENTS)
        replicas, client = (self.cpu[name] / per * scale for name in ("replicas", "client"))
        apart = f"replicas {replicas:.1f}, client {client:.1f}"
        return f"{self.platform / per * scale:.1f} {unit} ({parts}; {apart}, not counted)"


async def measured(meter: CpuMeter, work: Awaitable[T]) -> tuple[T, Spent]:
    before: CpuSample = await meter.sample()
    started = time.perf_counter()
    result = await work
    wall = time.perf_counter() - started
    after = await meter.sample()
    return result, Spent(wall, after.minus(before), after.backends_minus(before))


def pg_roles_line(meter: CpuMeter, spent: Spent, per: float, unit: str, scale: float) -> str:
    """PostgreSQL's share split by what each backend was found running (--pg-backends)."""
    roles: dict[str, tuple[float, int]] = {}
    for pid, cpu in spent.backends.items():
        role = meter.backend_role(pid)
        total, count = roles.get(role, (0.0, 0))
        roles[role] = (total + cpu, count + 1)
    ranked = sorted(roles.items(), key=lambda item: -item[1][0])
    return "  postgres by backend role (statement most often sampled, backends): " + "; ".join(
        f"{role!r} x{count} {total / per * scale:.2f} {unit}" for role, (total, count) in ranked if total > 0)


def outcome_counts(outcomes: Sequence[RunOutcome]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    return ", ".join(f"{status} {count}" for status, count in sorted(counts.items()))


def ending_reasons(outcomes: Sequence[RunOutcome]) -> list[str]:
    """Every run that did not complete, counted by its status and reason (the terminal's detail)."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.status != "COMPLETED":
            key = f"{outcome.status}: {outcome.detail or '(no detail)'}"
            counts[key] = counts.get(key, 0) + 1
    return [f"{count} x {reason}" for reason, count in sorted(counts.items(), key=lambda item: -item[1])]


LEASE_LOG_MARKS = ("lease lost", "lease renewal failed", "lease renewal of", "reaper:")


def lease_log_lines(log_dir: Path) -> list[str]:
    """How the routing workers' leases fared (their logs): lines per kind, and the first of each."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for path in sorted(log_dir.glob("routing-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            for mark in LEASE_LOG_MARKS:
                if mark in line:
                    counts[mark] = counts.get(mark, 0) + 1
                    first.setdefault(mark, line.strip()[:200])
    return [f"routing log: {counts[mark]} x '{mark}', first: {first[mark]}" for mark in LEASE_LOG_MARKS
            if mark in counts] or ["routing log: no lease renewal failed, lost or reaped"]


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """`count` busy-looping processes at nice 0 (the box loaded as by other work), stopped after."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# Where a run's first token spends its time, from the ledger's timestamps (database clock, same box).
_LEDGER_TIMES = """
SELECT id::text, extract(epoch FROM created_at) AS created, extract(epoch FROM queued_at) AS queued,
       extract(epoch FROM started_at) AS started
FROM runs WHERE id::text = ANY($1::text[])
"""


async def ttft_split(dsn: str, outcomes: Sequence[RunOutcome]) -> str:
    """Median of each leg: Submit → run row committed → claimed (QUEUED) → first DELTA at the client
    (the replica call and its first token, the STATUS and DELTA appended together, the gateway's
    delivery; compare with the direct call's TTFT). RUNNING is recorded in the ledger once the STATUS
    is durable, off the first token's path: its lag behind the first DELTA is shown apart."""
    connection = await asyncpg.connect(asyncpg_dsn(dsn))
    try:
        rows = {row["id"]: row for row in await connection.fetch(_LEDGER_TIMES, [o.run_id for o in outcomes])}
    finally:
        await connection.close()
    legs: dict[str, list[float]] = {name: [] for name in ("submit", "claim", "first DELTA at the client",
                                                          "(RUNNING recorded after it")}
    for outcome in outcomes:
        row = rows.get(outcome.run_id)
        if row is None or row["started"] is None or row["queued"] is None or not outcome.first_at:
            continue
        created, queued, started = float(row["created"]), float(row["queued"]), float(row["started"])
        legs["submit"].append(created - outcome.submitted_at)
        legs["claim"].append(queued - created)
        legs["first DELTA at the client"].append(outcome.first_at - queued)
        legs["(RUNNING recorded after it"].append(started - outcome.first_at)
    return ", ".join(f"{leg} {pct(values, 50) * 1e3:.1f}" for leg, values in legs.items()) + " ms) (p50)"


async def ttft_stages(dsn: str, outcomes: Sequence[RunOutcome]) -> tuple[str, str]:
    """The first token's path stage by stage, p50/p95 in ms, from the client's, the ledger's and the
    routing worker's clocks (one box): Submit's answer; the run row's INSERT from the Submit call;
    claimed (queued_at) from that INSERT; the first DELTA published by the routing worker from its
    claim (the replica's first token, step boundary included); the RUNNING statement from that
    publish (the STATUS event's acknowledgment and any write in flight before it); the client's
    first DELTA from the RUNNING statement (commit, NOTIFY, the Stream's hold) and from the publish.
    Second, the same legs' medians over the slowest tenth of the runs (TTFT at or above its p90):
    which leg the tail's time is in."""
    connection = await asyncpg.connect(asyncpg_dsn(dsn))
    try:
        rows = {row["id"]: row for row in await connection.fetch(_LEDGER_TIMES, [o.run_id for o in outcomes])}
    finally:
        await connection.close()
    names = ("answered", "row", "claimed", "published", "RUNNING stmt", "RUNNING→client", "published→client")
    runs: list[tuple[float, tuple[float, ...]]] = []
    for outcome in outcomes:
        row = rows.get(outcome.run_id)
        if row is None or row["started"] is None or row["queued"] is None or not outcome.first_at \
                or not outcome.first_published_ms:
            continue
        created, queued, started = float(row["created"]), float(row["queued"]), float(row["started"])
        published = outcome.first_published_ms / 1e3
        legs = (outcome.answered_at - outcome.submitted_at, created - outcome.submitted_at, queued - created,
                published - queued, started - published, outcome.first_at - started,
                outcome.first_at - published)
        runs.append((outcome.ttft_s, legs))
    if not runs:
        return "no run with every stage recorded", ""
    slow_from = pct([ttft for ttft, _ in runs], 90)
    slowest = [legs for ttft, legs in runs if ttft >= slow_from]
    columns = [[legs[i] for _, legs in runs] for i in range(len(names))]
    every = ", ".join(f"{name} {pct(column, 50) * 1e3:.1f}/{pct(column, 95) * 1e3:.1f}"
                      for name, column in zip(names, columns, strict=True))
    tail = ", ".join(f"{name} {pct([legs[i] for legs in slowest], 50) * 1e3:.1f}"
                     for i, name in enumerate(names))
    return (every + " ms (p50/p95)",
            f"{tail} ms (medians of the {len(slowest)} runs with TTFT >= p90 {slow_from * 1e3:.1f} ms)")


def added(times: list[float], direct_s: list[float]) -> str:
    """The platform's TTFT p50/p95 and what it adds over the direct calls' (ms)."""
    d50, d95 = pct(direct_s, 50) * 1e3, pct(direct_s, 95) * 1e3
    p50, p95 = pct(times, 50) * 1e3, pct(times, 95) * 1e3
    return (f"platform p50 {p50:.1f} / p95 {p95:.1f} ms;"
            f" added p50 +{p50 - d50:.1f} / p95 +{p95 - d95:.1f} ms")


# The staggered level's runs last about this long: long enough that 16 callers keep 16 streams in
# flight with their starts spread, short enough that each caller makes several.
STEADY_RUN_S = 1.0
STEADY_WIDTH = 16


async def staggered(call: Callable[[int], Awaitable[float]], width: int, per_caller: int,
                    stagger_s: float) -> list[float]:
    """`width` callers, each making `per_caller` calls back to back (its next as its last ends), the
    i-th starting after i * stagger_s: `width` calls in flight with their starts spread over a call's
    length, as `width` users streaming at once, not a burst. Each call's TTFT."""
    async def caller(index: int) -> list[float]:
        await asyncio.sleep(index * stagger_s)
        return [await call(index * per_caller + k) for k in range(per_caller)]
    return [ttft for ttfts in await asyncio.gather(*(caller(i) for i in range(width))) for ttft in ttfts]


async def phase_ttft(client: Client, replicas: Sequence[str], plan: Plan, dsn: str,
                     meter: CpuMeter | None = None, token_delay_s: float = 0.0) -> list[str]:
    prompt_ids = encode(TINY_CHAT.tokenizer, client.prompt)

    async def direct(index: int, tokens: int = 4) -> float:
        # Read to the end, as the platform's client reads its run to the terminal event: a call left
        # generating would keep the replica stepping, and the next call (the platform's) would wait
        # for the step in progress to end: up to one token time added to the platform alone.
        # No seed, as the platform's runs carry none: the replica then seeds from a hash of the
        # prompt (sluice.replica.generator.prompt_seed, a Python loop over the ids: ~1.5 ms for 2,000
        # of them here), which a seeded direct call skipped while every platform call paid it.
        started = time.perf_counter()
        first: float | None = None
        async for _chunk in replica_client.stream_generate(replicas[index % len(replicas)],
                                                           f"direct-{uuid.uuid4().hex}", prompt_ids, tokens):
            if first is None:
                first = time.perf_counter() - started
        return float("nan") if first is None else first

    outcomes: dict[bool, list[RunOutcome]] = {True: [], False: []}

    async def platform(pressure: Pressure, lean: bool) -> float:
        outcome = await client.run(4, pressure.first, lean=lean)
        outcomes[lean].append(outcome)
        return outcome.ttft_s

    lines = []
    levels = (("one at a time", 1, plan.ttft_serial), ("16 concurrent", 16, plan.ttft_rounds))
    for label, width, rounds in levels:
        direct_s: list[float] = []
        platform_s: dict[bool, list[float]] = {True: [], False: []}
        direct_pressure = Pressure()
        platform_pressure = {True: Pressure(meter=meter), False: Pressure()}
        for round_index in range(rounds):
            direct_s += await direct_pressure.over(asyncio.gather(
                *(direct(round_index * width + i) for i in range(width))))
            # Both clients every round, in alternating order (the box's drift falls on both alike), each
            # after direct calls (what a platform round leaves running, its runs' settlement, does not
            # fall on the other).
            for lean in (True, False) if round_index % 2 == 0 else (False, True):
                if lean != (round_index % 2 == 0):
                    direct_s += await direct_pressure.over(asyncio.gather(
                        *(direct(round_index * width + i) for i in range(width))))
                pressure = platform_pressure[lean]
                platform_s[lean] += await pressure.over(
                    asyncio.gather(*(platform(pressure, lean) for _ in range(width))), firsts=width)
        d50, d95 = pct(direct_s, 50) * 1e3, pct(direct_s, 95) * 1e3
        lines.append(f"TTFT {label} ({len(platform_s[True])} runs per client, {len(direct_s)} direct calls):"
                     f" direct p50 {d50:.1f} / p95 {d95:.1f} ms;"
                     f" {added(platform_s[True], direct_s)} (the direct call's client, bench/lean_client.py)")
        lines.append(f"  through grpc.aio (the SDK's transport) in the same rounds:"
                     f" {added(platform_s[False], direct_s)}")
        lines.append(f"  where the platform's time goes: {await ttft_split(dsn, outcomes[True])}")
        stages, tail = await ttft_stages(dsn, outcomes[True])
        lines.append(f"  stages: {stages}")
        lines.append(f"  the slowest tenth: {tail}")
        # Whether the rounds were short of CPU: from a platform round's start to its last first token,
        # how busy the box's CPUs were, how long runnable tasks waited for one, and the box's CPU
        # (every process: platform, replicas, this client) spent per run until then.
        for lean, name in ((True, "lean client"), (False, "grpc.aio")):
            pressure = platform_pressure[lean]
            per_run_ms = pressure.busy_s / max(1, len(platform_s[lean])) * 1e3
            runs = max(1, len(platform_s[lean]))
            split = ", ".join(f"{component} {spent / runs * 1e3:.1f}" for component, spent in
                              sorted(pressure.by_component.items(), key=lambda item: -item[1]))
            lines.append(f"  CPU until a round's last first token ({name}): box busy {pressure.busy()}, some"
                         f" task waiting for a CPU {pressure.waited()} of the time, {per_run_ms:.1f} ms of"
                         f" box CPU per run" + (f" ({split}; /proc ticks)" if split else ""))
        lines.append(f"  (direct rounds, start to end: box busy {direct_pressure.busy()},"
                     f" some task waiting {direct_pressure.waited()})")
        outcomes[True].clear()
        outcomes[False].clear()
    if plan.ttft_steady > 0 and token_delay_s > 0:
        lines += await steady_ttft(client, direct, plan.ttft_steady, token_delay_s)
    return lines


async def steady_ttft(client: Client, direct: Callable[[int, int], Awaitable[float]], per_caller: int,
                      token_delay_s: float) -> list[str]:
    """TTFT added at STEADY_WIDTH streams in flight whose starts are spread (staggered), beside the
    bursts above: direct calls, the platform through the lean client, through grpc.aio, direct calls
    again (the box's drift falls on both sides), each run STEADY_RUN_S long."""
    tokens = max(4, round(STEADY_RUN_S / token_delay_s))
    stagger_s = tokens * token_delay_s / STEADY_WIDTH

    async def direct_call(index: int) -> float:
        return await direct(index, tokens)

    def platform_call(lean: bool) -> Callable[[int], Awaitable[float]]:
        async def call(_: int) -> float:
            return (await client.run(tokens, lean=lean)).ttft_s
        return call

    platform_s: dict[bool, list[float]] = {}
    pressure = {True: Pressure(), False: Pressure()}
    direct_s = await staggered(direct_call, STEADY_WIDTH, per_caller, stagger_s)
    for lean in (True, False):
        platform_s[lean] = await pressure[lean].over(staggered(platform_call(lean), STEADY_WIDTH, per_caller,
                                                               stagger_s))
    direct_s += await staggered(direct_call, STEADY_WIDTH, per_caller, stagger_s)
    d50, d95 = pct(direct_s, 50) * 1e3, pct(direct_s, 95) * 1e3
    lines = [f"TTFT {STEADY_WIDTH} concurrent, staggered ({STEADY_WIDTH} callers each starting its next run"
             f" of {tokens} tokens as its last ends, their starts {stagger_s * 1e3:.0f} ms apart;"
             f" {len(platform_s[True])} runs per client, {len(direct_s)} direct calls):"
             f" direct p50 {d50:.1f} / p95 {d95:.1f} ms"]
    for lean, name in ((True, "the lean client"), (False, "grpc.aio")):
        lines.append(f"  {name}: {added(platform_s[lean], direct_s)} (box busy {pressure[lean].busy()},"
                     f" some task waiting for a CPU {pressure[lean].waited()} of the time)")
    return lines


async def phase_runs(meter: CpuMeter, client: Client, runs: int, concurrency: int,
                     tokens: int) -> tuple[list[RunOutcome], Spent]:
    return await measured(meter, bounded(runs, concurrency, lambda: client.run(tokens)))


async def phase_submit(meter: CpuMeter, client: Client, dsn: str, rate: float,
                       seconds: float, lean: bool = True) -> tuple[list[str], Spent]:
    """Open loop: Submit i is sent at start + i / rate whether or not earlier ones returned. `lean`:
    sent by bench/lean_client.py, else by grpc.aio (which spent ~0.8 ms of the box's 2 CPUs per
    Submit, ~40% of one at 500/s, beside the gateways it loads)."""
    count = int(rate * seconds)
    latencies: list[float] = []
    errors: list[str] = []
    stop_claiming = asyncio.Event()
    claimer = asyncio.create_task(_claim_backlog(dsn, 0.05, stop_claiming))

    async def one(index: int, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        gateway, tenant = index % len(client.channels), index % TENANTS
        try:
            await client.submit(gateway, tenant, 16, lean)
            latencies.append(time.perf_counter() - due)
        except grpc.aio.AioRpcError as error:
            errors.append(f"{error.code().name}: {(error.details() or '')[:60]}")
        except CallFailed as error:
            errors.append(f"{error.code}: {error.details[:60]}")

    async def offered() -> None:
        start = time.perf_counter() + 0.2
        await asyncio.gather(*(one(i, start + i / rate) for i in range(count)))

    try:
        _, spent = await measured(meter, offered())
    finally:
        stop_claiming.set()
        await claimer
    lines = [f"Submit at {rate:.0f}/s offered open-loop for {seconds:.0f} s ({count} submits,"
             f" {TENANTS} tenants, {len(client.channels)} gateway processes,"
             f" {'bench/lean_client.py' if lean else 'grpc.aio'} sending):"
             f" p50 {pct(latencies, 50) * 1e3:.2f} ms,"
             f" p95 {pct(latencies, 95) * 1e3:.2f} ms, p99 {pct(latencies, 99) * 1e3:.2f} ms;"
             f" achieved {len(latencies) / spent.wall_s:.0f}/s; errors {len(errors)}"
             + (f" ({'; '.join(sorted(set(errors))[:3])})" if errors else ""),
             f"  gateway CPU per Submit {spent.cpu['gateway'] / max(count, 1) * 1e3:.2f} ms"
             f" (postgres {spent.cpu['postgres'] / max(count, 1) * 1e3:.2f} ms, client"
             f" {spent.cpu['client'] / max(count, 1) * 1e3:.2f} ms)"]
    return lines, spent


# --- the whole bench ----------------------------------------------------------------------------

async def kafka_background(meter: CpuMeter, seconds: float = 5.0) -> float:
    """The broker's CPU-seconds per second with our stack idle: other users plus idle polling."""
    _, spent = await measured(meter, asyncio.sleep(seconds))
    return spent.cpu["kafka"] / spent.wall_s


def stream_lines(label: str, outcomes: list[RunOutcome], spent: Spent, background: float,
                 idle: Spent) -> list[str]:
    tokens = sum(o.tokens for o in outcomes)
    events = sum(o.events for o in outcomes)
    delivery = [ms for o in outcomes for ms in o.delivery_ms]
    kafka_net = max(0.0, spent.cpu["kafka"] - background * spent.wall_s)
    # What the stack would have burnt doing nothing for as long (pollers, timers, scrapes: paid per
    # second), taken off: the rest is what the phase's runs, events and tokens cost.
    net = {name: spent.cpu[name] - idle.cpu[name] / idle.wall_s * spent.wall_s for name in COMPONENTS}
    net_parts = " ".join(f"{name} {net[name] / max(tokens, 1) * 1e6:.1f}" for name in COMPONENTS)
    return [f"{label}: {len(outcomes)} runs, {tokens} tokens in {events} events"
            f" ({tokens / max(events, 1):.2f} tokens/event), {spent.wall_s:.1f} s wall,"
            f" {tokens / spent.wall_s:.0f} tokens/s; outcomes: {outcome_counts(outcomes)}",
            f"  platform CPU per token {spent.split(max(tokens, 1), 'us', 1e6)}",
            f"  a DELTA's publish -> client (after the first): p50 {pct(delivery, 50):.1f} / p95"
            f" {pct(delivery, 95):.1f} / max {max(delivery, default=float('nan')):.1f} ms",
            f"  (Kafka net of its background: {kafka_net / max(tokens, 1) * 1e6:.1f} us/token)",
            f"  net of the idle stack's rate over the phase: {sum(net.values()) / max(tokens, 1) * 1e6:.1f}"
            f" us/token ({net_parts})"]


def cpu_waited_us() -> int | None:
    """Microseconds during which some runnable task on the box waited for a CPU (pressure stall
    information, /proc/pressure/cpu "some" total; None where the kernel does not keep it)."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as pressure:
            some = pressure.readline().split()
    except OSError:
        return None
    return int(some[-1].removeprefix("total=")) if some and some[0] == "some" else None


def box_not_running_s() -> float:
    """CPU-seconds the box's CPUs have not run its tasks since boot (/proc/stat): idle + iowait, and
    steal (the hypervisor ran someone else). The kernel keeps idle time exactly (a tickless CPU's
    sleep is timed); busy time is sampled by the tick and over-counts short bursts between sleeps, so
    busy is reckoned as wall x CPUs - this. Printed in clock ticks (10 ms): fine enough summed over
    several rounds."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = stat.readline().split()
    return (int(fields[4]) + int(fields[5]) + int(fields[8])) / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Pressure:
    """Over some rounds: the share of their wall time when runnable tasks waited for a CPU (the box
    had more work than cores; 0: every task ran as soon as it could), and the box's CPU spent. A
    round counts from its start to its last first token (`firsts` of them), or to its end."""
    waited_us: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0
    known: bool = True
    meter: CpuMeter | None = None      # given: each component's CPU over the rounds too (`by_component`)
    by_component: dict[str, float] = field(default_factory=dict)
    _round: tuple[int | None, float, float, int] | None = None  # (waited, idle, start, firsts awaited)
    _components: CpuSample | None = None
    _client_s: float = 0.0            # this process's CPU at the round's start (after sampling the rest)

    async def over(self, work: Awaitable[T], firsts: int = 0) -> T:
        self._components = self.meter.sample_now() if self.meter is not None else None
        self._client_s = time.process_time()
        self._round = (cpu_waited_us(), box_not_running_s(), time.perf_counter(), firsts)
        result = await work
        self._close()
        return result

    def first(self) -> None:
        """A first token arrived: the round's window ends with the last one."""
        if self._round is not None:
            waited, busy, started, left = self._round
            self._round = (waited, busy, started, left - 1)
            if left - 1 <= 0:
                self._close()

    def _close(self) -> None:
        if self._round is None:
            return
        (waited_before, idle_before, started, _), self._round = self._round, None
        client_s = time.process_time() - self._client_s        # before sampling the others costs it more
        waited_after = cpu_waited_us()
        wall_s = time.perf_counter() - started
        self.busy_s += wall_s * (os.cpu_count() or 1) - (box_not_running_s() - idle_before)
        self.wall_s += wall_s
        if self.meter is not None and self._components is not None:
            spent = self.meter.sample_now().minus(self._components)
            spent["client"] = client_s
            for name, seconds in spent.items():
                self.by_component[name] = self.by_component.get(name, 0.0) + seconds
        if waited_before is None or waited_after is None:
            self.known = False
        else:
            self.waited_us += waited_after - waited_before

    def waited(self) -> str:
        if not self.known or self.wall_s <= 0:
            return "unknown (no /proc/pressure/cpu)"
        return f"{min(1.0, self.waited_us / 1e6 / self.wall_s) * 100:.0f}%"

    def busy(self) -> str:
        cpus = os.cpu_count() or 1
        return f"{min(1.0, self.busy_s / self.wall_s / cpus) * 100:.0f}%" if self.wall_s > 0 else "-"


def cpu_ticks() -> tuple[int, int]:
    """(all ticks, steal ticks) of the box's CPUs since boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    return sum(fields), fields[7]


_ticks_at_last_load = cpu_ticks()


def load() -> str:
    """The load average, and the share of CPU time the hypervisor gave to others (steal) since the
    previous such line: a phase run while the VM was starved reads slower in every figure."""
    global _ticks_at_last_load
    one, five, _ = os.getloadavg()
    (total, steal), (total_before, steal_before) = cpu_ticks(), _ticks_at_last_load
    _ticks_at_last_load = (total, steal)
    stolen = (steal - steal_before) / max(1, total - total_before) * 100
    return f"load average {one:.1f} (1 min) {five:.1f} (5 min) on {os.cpu_count()} CPUs; steal {stolen:.0f}%"


Profile = tuple[str, Path, "subprocess.Popen[bytes]"]


def start_profiles(stack: PlatformStack, seconds: int, out_dir: Path, workers: bool = True,
                   native: bool = False, rate: int = 100) -> list[Profile]:
    """py-spy record on gateway 0 and (with `workers`) routing worker 0 (their main Python process),
    raw collapsed stacks (with `native`, C and Cython frames too: what the event loop's own time is)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    started = []
    services = [("gateway", stack.gateways[0])] + ([("routing worker", stack.workers[0])] if workers else [])
    for label, service in services:
        output = out_dir / f"{label.replace(' ', '-')}.txt"
        command = [py_spy, "record", "--pid", str(service.process.pid), "--duration", str(seconds),
                   "--format", "raw", "--output", str(output), "--rate", str(rate),
                   *(["--native"] if native else ["--nonblocking"])]
        started.append((label, output, subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL)))
    return started


def top_functions(collapsed: Path, count: int = 5) -> list[str]:
    """The functions with the most samples at the top of the stack (own time), from py-spy's raw output."""
    own: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        frame = stack.rsplit(";", 1)[-1]
        own[frame] = own.get(frame, 0) + int(samples)
        total += int(samples)
    ranked = sorted(own.items(), key=lambda item: -item[1])[:count]
    return [f"{samples / max(total, 1):6.1%}  {frame}" for frame, samples in ranked]


async def print_profiles(profiles: list[Profile], during: str) -> None:
    for label, output, process in profiles:
        await asyncio.to_thread(process.wait)
        if output.exists():
            print(f"  py-spy top 5 by own time, {label} ({during}):")
            for line in top_functions(output):
                print(f"    {line}")


def idle_line(spent: Spent) -> str:
    """Each component's CPU with nothing to do (pollers, timers, scrapes): paid per second, not per run."""
    parts = ", ".join(f"{name} {spent.cpu[name] / spent.wall_s * 1e3:.1f}" for name in COMPONENTS)
    return f"{parts} ms CPU/s"


PHASES = ("ttft", "runs", "stream64", "stream256", "interrupt", "submit")
# Kafka's request logger at debug (infra/kafka.sh with KAFKA_REQUEST_LOG=debug) writes one
# "Completed request:" line per request, naming its api as requestApiKeyName (the broker's own
# requests, such as its heartbeat to the controller, are counted too).
COMPLETED_REQUEST = re.compile(rb'Completed request:.*?"requestApiKeyName":"(\w+)"')


class BrokerThreads:
    """The broker JVM's CPU over a phase by thread (names with their digits folded: request handlers,
    network threads, JIT compilers, GC, the KRaft raft loop...), from /proc/PID/task: where a broker's
    CPU goes without JMX."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._before: dict[str, tuple[str, float]] = {}

    def _threads(self) -> dict[str, tuple[str, float]]:
        threads: dict[str, tuple[str, float]] = {}
        if self.pid is None:
            return threads
        for task in os.listdir(f"/proc/{self.pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                stat = Path(f"/proc/{self.pid}/task/{task}/stat").read_text()
                name = re.sub(r"\d+", "#", stat[stat.index("(") + 1:stat.rindex(")")])
                fields = stat[stat.rindex(")") + 2:].split()
                threads[task] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
        return threads

    def mark(self) -> None:
        self._before = self._threads()

    def line(self, wall_s: float, top: int = 6) -> str:
        groups: dict[str, float] = {}
        for task, (name, cpu) in self._threads().items():
            groups[name] = groups.get(name, 0.0) + cpu - self._before.get(task, (name, 0.0))[1]
        ranked = sorted(groups.items(), key=lambda item: -item[1])[:top]
        parts = ", ".join(f"{name} {cpu / wall_s * 1e3:.0f}" for name, cpu in ranked)
        return f"  broker CPU by thread: {parts} ms/s"


class RequestCounter:
    """Broker requests by api over a phase, from the broker's log (a private broker started with
    KAFKA_REQUEST_LOG=debug: every client of it is counted, so give it no other users)."""

    def __init__(self, log: Path | None) -> None:
        self.log = log
        self._offset = 0

    def mark(self) -> None:
        if self.log is not None:
            self._offset = self.log.stat().st_size

    def counts(self) -> dict[str, int]:
        assert self.log is not None
        with self.log.open("rb") as file:
            file.seek(self._offset)
            text = file.read()
        counts: dict[str, int] = {}
        for match in COMPLETED_REQUEST.finditer(text):
            name = match.group(1).decode().lower()
            counts[name] = counts.get(name, 0) + 1
        return counts

    def rate_line(self, seconds: float) -> str:
        counts = self.counts()
        parts = ", ".join(f"{name} {count / seconds:.1f}" for name, count in counts.items())
        total = sum(counts.values()) / seconds
        return f"  broker requests per second with the stack idle: {total:.1f} ({parts})"

    def line(self, events: int, runs: int) -> str:
        if self.log is None:
            return "  (broker requests not counted: --request-log)"
        counts = self.counts()
        total = sum(counts.values())
        parts = ", ".join(f"{name} {count / max(events, 1):.3f}" for name, count in
                          sorted(counts.items(), key=lambda item: -item[1]))
        return (f"  broker requests per delivered event: {total / max(events, 1):.3f} ({parts});"
                f" {total / max(runs, 1):.1f} per run, {total} in all")


async def bench(args: argparse.Namespace) -> None:
    plan = QUICK if args.quick else FULL
    config = load_settings()
    bootstrap = config.kafka.bootstrap
    database, dsn = await create_database(TENANTS)
    topic = await create_topic(bootstrap, config.kafka.partitions)
    settings = StackSettings(token_delay_ms=args.token_delay_ms, gateways=args.gateways,
                             routing_workers=args.routing_workers,
                             max_runs_per_worker=max(64, -(-256 // args.routing_workers)),
                             max_backlog_per_pool=10**6, wire_replicas=args.wire_replicas)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-platform-"))
    stack = PlatformStack(settings, dsn, topic, log_dir)
    meter = CpuMeter(stack, database)
    client: Client | None = None
    try:
        await asyncio.to_thread(stack.start)
        await meter.start()
        client = Client(stack.gateway_addresses, prompt_of(args.prompt_tokens), corpus_of(args.prompt_source))
        kind = "wire replicas (bench/wire_replica.py: the simple engine's bytes without Triton)" \
            if args.wire_replicas else "simple-engine replicas"
        print(f"bench-platform{' --quick' if args.quick else ''}: {kind} x2 at"
              f" {args.token_delay_ms} ms/token, {args.gateways} gateway processes, {args.routing_workers}"
              f" routing worker process(es) (max_runs_per_worker {settings.max_runs_per_worker}),"
              f" coalesce_ms {config.kafka.coalesce_ms}, {TENANTS} tenants, prompts of"
              f" {len(encode(TINY_CHAT.tokenizer, client.prompt))} tokens ({len(client.prompt)} characters"
              f"{', each a random slice of the corpus' if args.prompt_source == 'corpus' else ''});"
              f" logs in {log_dir}", flush=True)
        # Warm channels, tails and pools at the run-cost phase's concurrency (16): a pool still growing
        # there charged each new connection's start (fork, SCRAM, type introspection: ~25 per bench,
        # ~1 ms a run) to the runs.
        await bounded(32, 16, lambda: client.run(4))
        if args.warm_broker:
            # The broker's JIT compiles its produce/fetch paths under load: a phase that comes first
            # after an idle broker would pay that compilation. Not counted in any phase.
            started = time.perf_counter()
            await bounded(args.warm_broker, 64, lambda: client.run(plan.stream_tokens))
            print(f"broker warmed: {args.warm_broker} runs of {plan.stream_tokens} tokens, 64 concurrent,"
                  f" {time.perf_counter() - started:.1f} s, before any measured phase", flush=True)
        requests = RequestCounter(Path(args.request_log) if args.request_log else None)
        threads = BrokerThreads(meter.kafka)
        print(f"[{load()}]", flush=True)
        background = await kafka_background(meter)
        print(f"Kafka background with the stack idle: {background * 1e3:.1f} ms CPU/s (whole broker,"
              " shared with other users of it)", flush=True)
        profiles = start_profiles(stack, args.py_spy, log_dir, native=args.py_spy_native,
                                  rate=args.py_spy_rate) \
            if args.py_spy and args.py_spy_phase == "idle" else []
        idle_s = max(args.idle_s, args.py_spy + 0.5) if profiles else args.idle_s
        requests.mark()
        threads.mark()
        _, idle = await measured(meter, asyncio.sleep(idle_s))
        print(f"idle stack: {idle_line(idle)}", flush=True)
        if args.request_log:
            print(requests.rate_line(idle.wall_s), flush=True)
        if args.broker_threads:
            print(threads.line(idle.wall_s), flush=True)
        await print_profiles(profiles, f"{args.py_spy} s of the idle stack")
        phases = set(args.phases.split(","))
        if "ttft" in phases:
            for line in await phase_ttft(client, stack.replica_addresses, plan, dsn, meter,
                                         token_delay_s=args.token_delay_ms / 1000):
                print(line, flush=True)
        if "runs" in phases:
            cost_runs = args.cost_runs or plan.cost_runs
            profiles = start_profiles(stack, args.py_spy, log_dir, native=args.py_spy_native,
                                  rate=args.py_spy_rate) \
                if args.py_spy and args.py_spy_phase == "runs" else []
            requests.mark()
            threads.mark()
            outcomes, spent = await phase_runs(meter, client, cost_runs, 16, 2)
            print(f"CPU per run of 2 tokens ({cost_runs} runs, 16 concurrent;"
                  f" {outcome_counts(outcomes)}): {spent.split(len(outcomes), 'ms', 1e3)}", flush=True)
            events = sum(o.events for o in outcomes) / max(len(outcomes), 1)
            print(f"  {spent.wall_s:.1f} s wall, {len(outcomes) / spent.wall_s:.0f} runs/s,"
                  f" {events:.2f} events per run delivered", flush=True)
            print(requests.line(sum(o.events for o in outcomes), len(outcomes)), flush=True)
            if args.broker_threads:
                print(threads.line(spent.wall_s), flush=True)
            if args.pg_backends:
                print(pg_roles_line(meter, spent, len(outcomes), "ms", 1e3), flush=True)
            await print_profiles(profiles, f"{args.py_spy} s of the run-cost phase")
        widths = ((64, plan.stream_runs_64), (256, plan.stream_runs_256))
        passes = range(1, args.stream_passes + 1)
        for width, runs, pass_no in ((w, r, p) for w, r in widths if f"stream{w}" in phases for p in passes):
            profiles = start_profiles(stack, args.py_spy, log_dir, native=args.py_spy_native,
                                  rate=args.py_spy_rate) \
                if args.py_spy and width == 64 and args.py_spy_phase == "stream64" else []
            print(f"[{load()}]", flush=True)
            requests.mark()
            threads.mark()
            outcomes, spent = await phase_runs(meter, client, runs, width, plan.stream_tokens)
            await print_profiles(profiles, f"{args.py_spy} s of stream-64")
            label = f"{width} concurrent {plan.stream_tokens}-token streams" \
                + (f" (pass {pass_no} of {args.stream_passes})" if args.stream_passes > 1 else "")
            for line in stream_lines(label, outcomes, spent, background, idle):
                print(line, flush=True)
            print(requests.line(sum(o.events for o in outcomes), len(outcomes)), flush=True)
            if args.broker_threads:
                print(threads.line(spent.wall_s), flush=True)
            if args.pg_backends:
                tokens = sum(o.tokens for o in outcomes)
                print(pg_roles_line(meter, spent, tokens, "us/token", 1e6), flush=True)
        if "interrupt" in phases:
            runs = args.interrupt_runs or plan.interrupt_runs
            tokens = args.interrupt_tokens or plan.interrupt_tokens
            with burners(args.burn):
                print(f"[{load()}; {args.burn} CPU burners at nice 0]", flush=True)
                outcomes, spent = await phase_runs(meter, client, runs, 256, tokens)
                loaded = load()
            interrupted = sum(1 for o in outcomes if o.status == "INTERRUPTED")
            print(f"INTERRUPTED: {interrupted} of {len(outcomes)} runs ({tokens} tokens each,"
                  f" 256 concurrent, {spent.wall_s:.0f} s, {args.burn} CPU burners; at the end {loaded});"
                  f" outcomes: {outcome_counts(outcomes)}", flush=True)
            for line in ending_reasons(outcomes) + lease_log_lines(log_dir):
                print(f"  {line}", flush=True)
        print(f"[{load()}]", flush=True)
        if "submit" in phases:
            await asyncio.to_thread(stack.stop_workers)
            profiles = start_profiles(stack, args.py_spy, log_dir, workers=False, native=args.py_spy_native,
                                      rate=args.py_spy_rate) \
                if args.py_spy and args.py_spy_phase == "submit" else []
            lines, _ = await phase_submit(meter, client, dsn, args.submit_rate, plan.submit_seconds,
                                          lean=args.submit_client == "lean")
            for line in lines:
                print(line, flush=True)
            await print_profiles(profiles, f"{args.py_spy} s of the submit phase")
    finally:
        # The processes go first: nothing that fails below may leave them running.
        await asyncio.to_thread(stack.stop)
        if client is not None:
            await client.close()
        with contextlib.suppress(Exception):
            await meter.close()
        await replica_client.close_channels()
        with contextlib.suppress(Exception):
            await delete_topic(bootstrap, topic)
        await drop_database(database)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_platform", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small phases (a few minutes)")
    parser.add_argument("--token-delay-ms", type=float, default=100)
    parser.add_argument("--wire-replicas", action="store_true",
                        help="serve the simple engine from bench/wire_replica.py instead of Triton: the same"
                             " responses for a few us of CPU per token, so that streams can run at seed 002's"
                             " ~117 tokens/s (--token-delay-ms 8.5) on the platform's own box")
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                        help="every run's prompt about N tokens long (seed 002: 2000); 0: one short sentence")
    parser.add_argument("--prompt-source", choices=("repeat", "corpus"), default="repeat",
                        help="repeat: every run sends the same prompt; corpus: each Submit a random slice"
                             " of sluice/models/corpus.txt of as many tokens (texts that never repeat, words"
                             " that do)")
    parser.add_argument("--routing-workers", type=int, default=1)
    parser.add_argument("--submit-rate", type=float, default=500.0)
    parser.add_argument("--py-spy", type=int, default=0, metavar="SECONDS",
                        help="profile a gateway and the routing worker this long during stream-64")
    parser.add_argument("--py-spy-phase", choices=("stream64", "runs", "idle", "submit"), default="stream64",
                        help="the phase --py-spy samples")
    parser.add_argument("--py-spy-rate", type=int, default=100, metavar="HZ",
                        help="with --py-spy: samples per second (py-spy's default 100)")
    parser.add_argument("--py-spy-native", action="store_true",
                        help="with --py-spy: sample C and Cython frames too (grpc, uvloop, asyncpg)")
    parser.add_argument("--idle-s", type=float, default=3.0, metavar="SECONDS",
                        help="how long the idle stack is measured (the idle line; longer: steadier)")
    parser.add_argument("--submit-client", choices=("lean", "grpc.aio"), default="lean",
                        help="what sends the submit phase's Submits: bench/lean_client.py (default, the"
                             " lighter load on the shared box) or grpc.aio")
    parser.add_argument("--cost-runs", type=int, default=0,
                        help="runs in the run-cost phase (default: the plan's, 48 quick, 200 full)")
    parser.add_argument("--interrupt-runs", type=int, default=0,
                        help="runs in the interrupt phase (default: the plan's, 256 quick, 1,000 full)")
    parser.add_argument("--interrupt-tokens", type=int, default=0,
                        help="output tokens per run in the interrupt phase (default: 40 quick, 100 full)")
    parser.add_argument("--burn", type=int, default=0, metavar="N",
                        help="N CPU-burning processes at nice 0 during the interrupt phase (a loaded box)")
    parser.add_argument("--pg-backends", action="store_true",
                        help="split PostgreSQL's CPU by what each backend was found running (its role)")
    parser.add_argument("--stream-passes", type=int, default=1,
                        help="run each stream phase this many times in a row, each reported (warm-up check)")
    parser.add_argument("--warm-broker", type=int, default=64, metavar="RUNS",
                        help="before any measured phase, this many stream-length runs at 64 concurrent"
                             " (the broker's JIT warm-up), not counted; 0: none (default 64)")
    parser.add_argument("--request-log", default="", metavar="KAFKA_LOG",
                        help="count broker requests per event from this broker log (a private broker"
                             " started with KAFKA_REQUEST_LOG=debug)")
    parser.add_argument("--broker-threads", action="store_true",
                        help="after each run/stream phase, the broker's CPU by thread (from /proc)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    main()

