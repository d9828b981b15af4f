"""One run on one replica, from the first token to its terminal event.

    replica stream ──pump──▶ DeltaCoalescer ──loop──▶ event log (pipelined: up to
                                  ▲                    MAX_IN_FLIGHT events in flight)
     cancel / deadline / hung /   │                         │ acks, in order
     lease (ledger clock) ────────┘                         ▼
                                               durable progress (lease.last_sequence,
                                               renewed into the ledger by the keeper)

The pump task only reads the replica's stream into the coalescer; the main
loop publishes. Publishing does not wait for the broker: each window's DELTA is
handed to the process's shared producer (which batches across runs) and the
loop goes on; acknowledgments advance the run's durable progress in order. At
most MAX_IN_FLIGHT events of a run are unacknowledged; past that the loop waits
for the oldest, while new tokens keep accumulating into fewer, larger DELTAs.
The terminal ledger write happens only once every event before it is durable.

Every token the replica produced before the run ended is published before the
terminal event and counted in its usage (consumed compute counts, DESIGN.md).
How an attempt ended, and whether it is retried on another replica (router/retry.py),
is decided by outcome.decide; this module only observes and acts.

Leases (leases.py): the driver runs while its lease is valid by the ledger's clock
and stops (LeaseLost, writing nothing more) only when a renewal was refused or the
lease truly expired. Its ledger writes and events carry its lease epoch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import trace
from sluice.ledger.models import RunStatus
from sluice.services import replica_client
from sluice.services.admission_rules import ENGINE_DEFAULT, Sampling
from sluice.services.finish import Ending, TerminalRecord
from sluice.services.replica_client import ReplicaError, TokenChunk
from sluice.services.routes import route_message
from sluice.services.routing.claims import ClaimedRun
from sluice.services.routing.early_call import EarlyCall, OnChunk
from sluice.services.routing.leases import Lease
from sluice.services.routing.monitor import Silence
from sluice.services.routing.observability import (
    RunOutcome,
    stream_attributes,
    stream_end_attributes,
    stream_span_name,
)
from sluice.services.routing.outcome import (
    DETAIL_CANCELLED,
    DETAIL_EXPIRED,
    DETAIL_NO_FIRST_TOKEN,
    DETAIL_REPLICA_HUNG,
    Attempt,
    RunSoFar,
    Stop,
    decide,
    not_started,
)
from sluice.services.routing.run_ledger import LeaseLost, RunLedger
from sluice.services.routing.textdecode import IncrementalDecoder, load_tokenizer
from sluice.services.routing.windows import WindowClock
from sluice.services.telemetry import tracer, tracing

from sluice.eventlog.events import DeltaCoalescer, RunEventSequencer
from sluice.eventlog.interface import EventLog, LogPosition
from sluice.router.retry import DEFAULT_MAX_ATTEMPTS
from sluice.v1 import common_pb2, runs_pb2

log = logging.getLogger(__name__)

STOP_DRAIN_S = 3.0   # after `stop`, how long the replica may take to close the stream
MAX_IN_FLIGHT = 16   # a run's events published and not yet acknowledged

__all__ = ["DETAIL_CANCELLED", "DETAIL_EXPIRED", "LeaseLost", "RunDriver", "Target", "TRITON"]


class ReplicaClient(Protocol):
    async def generate(self, address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                       end_id: int | None = None, *, cache_salt: int = 0, sampling: Sampling = ENGINE_DEFAULT,
                       on_chunk: Callable[[TokenChunk], None]) -> None:
        """Stream a generation, handing each chunk to `on_chunk` as it arrives; return at its end."""
        ...

    async def stop(self, address: str, request_id: str) -> None:
        ...


class _ModuleReplicaClient:
    """The Triton client module as a ReplicaClient."""

    async def generate(self, address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                       end_id: int | None = None, *, cache_salt: int = 0, sampling: Sampling = ENGINE_DEFAULT,
                       on_chunk: Callable[[TokenChunk], None]) -> None:
        # A 0 field is left out: the replica then applies its default (TensorRT-LLM's).
        await replica_client.generate(address, request_id, prompt_ids, max_new_tokens, end_id,
                                      on_chunk=on_chunk, cache_salt=cache_salt,
                                      temperature=sampling.temperature or None, top_p=sampling.top_p or None,
                                      seed=sampling.seed or None)

    def stream_generate(self, address: str, request_id: str, prompt_ids: Sequence[int],
                        max_new_tokens: int, end_id: int | None = None, *, cache_salt: int = 0,
                        sampling: Sampling = ENGINE_DEFAULT) -> AsyncIterator[TokenChunk]:
        return replica_client.stream_generate(address, request_id, prompt_ids, max_new_tokens, end_id,
                                              cache_salt=cache_salt, temperature=sampling.temperature or None,
                                              top_p=sampling.top_p or None, seed=sampling.seed or None)

    async def stop(self, address: str, request_id: str) -> None:
        await replica_client.stop(address, request_id)


TRITON = _ModuleReplicaClient()


def call_replica(replicas: ReplicaClient, address: str, claim: ClaimedRun, salted: bool,
                 on_chunk: OnChunk) -> Awaitable[None]:
    """The run's generation on the replica at `address`, each chunk handed to `on_chunk`. `salted`: the
    replica takes the run's trust scope as its cache_salt_id (else 0: the replica's default)."""
    return replicas.generate(address, claim.run_id, claim.prompt_token_ids, claim.max_output_tokens,
                             claim.end_id, cache_salt=claim.cache_salt if salted else 0,
                             sampling=claim.sampling, on_chunk=on_chunk)


@dataclass(frozen=True, slots=True)
class DriverSettings:
    owner: str                   # this process's lease owner id
    lease_seconds: float
    coalesce_ms: float           # a DELTA window ([kafka].coalesce_ms); the first token is never held
    first_token_timeout_s: float
    block_size: int              # replica KV block size: reused blocks → cached prompt tokens
    max_attempts: int = DEFAULT_MAX_ATTEMPTS   # replicas a run may try before its first token
    coalesce_max_tokens: int = 0   # a window holding this many tokens closes at once (0: no limit)
    coalesce_aligned: bool = False   # windows close on the host's clock grid ([kafka].coalesce_aligned)
    cache_salt_id: bool = True   # the replica takes the trust scope's salt (else requests go unsalted)


@dataclass(frozen=True, slots=True)
class Target:
    """A replica a run is (re)sent to."""

    replica: str
    address: str                 # Triton gRPC host:port
    block_size: int              # its KV block size
    cache_salt_id: bool = True   # its model takes the trust scope's salt (ReplicaSpec.cache_salt_id)


Reroute = Callable[["RunDriver"], Awaitable[Target | None]]
"""The worker's retry hook: choose an untried replica for the driver's run (None: nowhere to go);
the driver records it in the ledger before contacting it."""


async def _nowhere(driver: RunDriver) -> Target | None:
    return None


class Wake:
    """The driver's wake-up call: set by a token, a window's end, an ack that failed, a cancel, a lease
    or hung verdict; the driver clears it, looks at everything, and waits for it again.

    asyncio.Event would do, but it asks for the running loop on every wait, and CPython 3.11 makes a
    getpid system call each time it is asked (a wait per event of every run); this one keeps the loop
    it first waited on, and its one waiter."""

    __slots__ = ("_flag", "_loop", "_waiter")

    def __init__(self) -> None:
        self._flag = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._flag = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    async def wait(self) -> None:
        """Until set (at once if it is). One waiter at a time: the driver."""
        if self._flag:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


@dataclass(slots=True)
class _Pump:
    coalescer: DeltaCoalescer
    wake: Wake
    sent_at: float                          # monotonic: the request left for the replica
    cap: int                                # the run's max output tokens (the budget reserved for them)
    clock: WindowClock | None = None        # closes its windows (the worker's, shared by every run)
    # Called by the clock when the open window ends: the driver's (RunDriver._window_closed); None:
    # wake the driver.
    publisher: Callable[[_Pump], Awaitable[None] | None] | None = None
    done: bool = False
    error: BaseException | None = None
    received_tokens: int = 0
    reused_blocks: int = 0
    first_token_at: float | None = None     # monotonic
    first_token_wall: float | None = None   # time.time(), for TTFT from the submit
    last_token_at: float | None = None      # monotonic
    window_at: float | None = None          # the instant (ms) the clock closes the open window at
    loop: asyncio.AbstractEventLoop | None = None     # the driver's, asked once (see Wake), not per window

    def wait_window(self) -> None:
        """Have the clock close the open window at its end (windows.py: one timer per instant)."""
        closes_ms = self.coalescer.closes_ms()
        if closes_ms is None:
            return
        if self.clock is None:
            self.clock = WindowClock(self.loop or asyncio.get_running_loop())
        self.clock.join(self, closes_ms)

    def disarm_window(self) -> None:
        """The open window is published (or the attempt ended): the clock passes it by."""
        self.window_at = None

    def window_closed(self) -> Awaitable[None] | None:
        """The clock closed the open window (windows.Closing)."""
        if self.publisher is not None:
            return self.publisher(self)
        self.wake.set()
        return None

    def take(self, chunk: TokenChunk) -> None:
        """A chunk from the replica, handed over as its response is parsed (ReplicaClient.generate)."""
        self.reused_blocks = max(self.reused_blocks, chunk.kv_cache_reused_blocks)
        # Never more than the cap the budget reserved for, whatever the replica sends.
        tokens = chunk.token_ids
        if len(tokens) > self.cap - self.received_tokens:
            tokens = tokens[:self.cap - self.received_tokens]
        if not tokens:
            return
        arrived = time.monotonic()
        first = self.first_token_at is None
        if first:
            self.first_token_at, self.first_token_wall = arrived, time.time()
        self.last_token_at = arrived
        self.received_tokens += len(tokens)
        # The driver sleeps while tokens stream: it is woken by the run's first token (published at
        # once) and by a window that is due as soon as it holds these tokens (full, or no window).
        # A window that closes by time is the clock's, which the token that opens it joins, and which
        # publishes the window's DELTA while the driver sleeps on (RunDriver._window_closed).
        # Tokens that join an open window wake nobody, even past its instant while the clock holds it
        # (the loop may read a socket before it runs a timer due as long: the tick publishes them).
        coalescer = self.coalescer
        opens = not coalescer.pending()
        coalescer.add(tokens, arrived * 1000)
        if first or coalescer.full() or not coalescer.window_ms:
            self.wake.set()
        elif opens:
            self.wait_window()


    def step_s(self) -> float | None:
        """The replica's observed time per token on this stream (None before the second token)."""
        if self.received_tokens < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (self.received_tokens - 1)


@dataclass(slots=True)
class RunDriver:
    claim: ClaimedRun
    address: str
    settings: DriverSettings
    events: EventLog
    ledger: RunLedger
    lease: Lease
    replicas: ReplicaClient = TRITON
    on_replica_lost: Callable[[str], None] = lambda name: None
    reroute: Reroute = _nowhere
    clock: WindowClock | None = None   # closes the DELTA windows (the worker's, shared; None: its own)
    early: EarlyCall | None = None     # the call to `address` sent while the claim committed (first attempt)
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    last_sequence: int = 0       # last event durable in the log
    output_tokens: int = 0       # tokens in durable DELTA events
    tried: list[str] = field(default_factory=list)   # replicas sent this run, in order
    prompt_taken: bool = False   # some replica produced output or held the request until stopped
    outcome: RunOutcome | None = None                # set when the driver settled the run
    _hung: str | None = None     # set by the replica monitor
    _pump: _Pump | None = None
    _in_flight: collections.deque[tuple[asyncio.Future[LogPosition], int, int]] = field(
        default_factory=collections.deque)           # (ack, sequence, tokens), oldest first
    _publish_error: BaseException | None = None
    _published_tokens: int = 0   # tokens in DELTA events published (durable by the time the run ends)
    _reported_cached: int = 0
    _first_token_wall: float | None = None
    _first: LogPosition | None = None   # where the run's events start, once durable (settled with it)
    _tpot_s: float | None = None
    _wake: Wake = field(default_factory=Wake)
    _deadline: float = float("inf")   # the run's deadline on the monotonic clock (set when the run starts)
    _horizon: asyncio.TimerHandle | None = None   # wakes the driver at the deadline, lease end or first-token
    _horizon_at: float = 0.0                      # limit, whichever comes first (monotonic)
    _sequencer: RunEventSequencer | None = None   # the run's events (set when it starts)
    _decoder: IncrementalDecoder | None = None
    _parked: bool = False        # the driver's loop sleeps until woken, nothing left to do meanwhile
    _publishing: bool = False    # the clock publishes a window of the run's (_window_closed)
    _published: asyncio.Future[None] | None = None   # resolved when that publication is done

    @property
    def run_id(self) -> str:
        return self.claim.run_id

    @property
    def replica(self) -> str:
        return self.claim.replica or self.address

    # --- signals from the worker's jobs (lease keeper, cancel listener, replica monitor) ---------

    def request_cancel(self) -> None:
        self.cancel_requested.set()
        self._wake.set()

    def revoke_lease(self) -> None:
        self.lease.refused = True
        self._wake.set()

    def silent_for(self, now: float) -> float | None:
        """Seconds since the current attempt's replica last sent a token (or was sent the request);
        None when nothing is streaming."""
        pump = self._pump
        if pump is None or pump.done:
            return None
        return now - (pump.last_token_at if pump.last_token_at is not None else pump.sent_at)

    def silence(self, now: float, alive_age_s: float | None) -> Silence | None:
        """How long the current attempt's replica has been silent (None when nothing is streaming)."""
        silent_s = self.silent_for(now)
        pump = self._pump
        if silent_s is None or pump is None:
            return None
        return Silence(silent_s, pump.step_s(), alive_age_s, first_token=pump.first_token_at is not None)

    def replica_hung(self, why: str) -> None:
        if self._hung is None:
            self._hung = why
            self._wake.set()

    # --- the run ------------------------------------------------------------------------------

    def _check_lease(self) -> None:
        now = time.monotonic()
        if not self.lease.valid(now):
            raise LeaseLost("refused by the ledger" if self.lease.refused
                            else f"expired {now - self.lease.ends_by:.2f}s ago by the ledger's clock")

    async def run(self) -> TerminalRecord | None:
        """Drive the run to its end; None when the lease was lost (someone else ends it)."""
        try:
            if not tracing():                # nothing records spans: none made
                record = await self._settle(await self._drive())
            else:
                # One span for the replica stream (tokens as attributes, never a span per token), then
                # one for the settlement; both in the run's trace (the worker's run.drive is current).
                claim = self.claim
                attributes = stream_attributes(claim, self.address)
                with tracer().start_as_current_span(stream_span_name(claim), kind=trace.SpanKind.CLIENT,
                                                    attributes=attributes) as span:
                    ending = await self._drive()
                    span.set_attributes(stream_end_attributes(claim, ending, len(self.tried),
                                                              self._ttft_s()))
                with tracer().start_as_current_span("run.settle", attributes={
                        "sluice.run_id": self.run_id, "sluice.status": ending.status.value}):
                    record = await self._settle(ending)
            if record is None:
                return None
            self.outcome = self._outcome(record)
            return record
        except LeaseLost as lost:
            log.warning("run %s: lease lost (%s), leaving it to the reaper", self.run_id, lost)
            return None
        finally:
            if self.early is not None:      # the run ended before its first attempt took the call
                self.early.cancel()
                self.early = None
            if self._horizon is not None:
                self._horizon.cancel()
            for ack, _, _ in self._in_flight:
                ack.cancel()

    async def _settle(self, ending: Ending) -> TerminalRecord | None:
        """The terminal write once every event is durable, then its event; None when the lease was
        refused meanwhile (LeaseLost is raised when the driver finds it lost first)."""
        await self._flush()
        self._check_lease()
        if ending.first is None and self._first is not None:
            # Recorded by record_start already, unless that write was lost: then settlement records it.
            ending = dataclasses.replace(ending, first=self._first)
        record = await self.ledger.finish(self.lease, ending)
        if record is not None:
            await self.ledger.publish_terminal(record)
        return record

    async def _drive(self) -> Ending:
        # Read once: a datetime's timestamp() on every wake-up was a measurable share of the loop.
        self._deadline = time.monotonic() + (self.claim.deadline_at.timestamp() - time.time())
        sequencer = self._sequencer = RunEventSequencer(self.run_id, epoch=self.lease.epoch)
        decoder = self._decoder = IncrementalDecoder(load_tokenizer(self.claim.tokenizer))
        self.tried.append(self.replica)
        while True:
            attempt = await self._attempt(sequencer, decoder)
            run = RunSoFar(attempts=len(self.tried), max_attempts=self.settings.max_attempts,
                           last_sequence=sequencer.last_sequence, output_tokens=self._published_tokens,
                           cached_input_tokens=self._reported_cached, prompt_taken=self.prompt_taken)
            decision = decide(attempt, run)
            self.prompt_taken = decision.prompt_taken
            if decision.replica_failed:
                self.on_replica_lost(attempt.replica)
            if decision.ending is not None:
                if attempt.error is not None and not isinstance(attempt.error, ReplicaError):
                    log.error("run %s: replica stream failed", self.run_id, exc_info=attempt.error)
                return decision.ending
            if not await self._move_to_another_replica(decision.detail):
                return not_started(run, decision.detail, self.prompt_taken)

    async def _attempt(self, sequencer: RunEventSequencer, decoder: IncrementalDecoder) -> Attempt:
        """Stream from the current replica, publishing as tokens arrive, until it ends or is stopped."""
        loop = asyncio.get_running_loop()
        if self.clock is None:
            self.clock = WindowClock(loop)
        early, self.early = self.early, None
        if early is not None and early.address != self.address:
            early.cancel()
            early = None
        pump = _Pump(DeltaCoalescer(self.settings.coalesce_ms, self.settings.coalesce_max_tokens,
                                    aligned=self.settings.coalesce_aligned), self._wake,
                     time.monotonic() if early is None else early.sent_at, self.claim.max_output_tokens,
                     self.clock, self._window_closed, loop=loop)
        self._pump, self._hung = pump, None
        task = asyncio.create_task(self._read(pump, early), name=f"pump-{self.run_id}-{len(self.tried)}")
        stop: Stop | None = None
        try:
            while True:
                if self._publishing:
                    await self._window_published(loop)
                self._wake.clear()
                self._check_lease()
                if self._publish_error is not None:
                    raise self._publish_error
                now = time.monotonic()
                if stop is None:
                    stop = self._stop_reason(pump, now)
                    if stop is not None:
                        await self._stop_replica(task, abandon=stop.hung)
                coalescer = pump.coalescer
                # The run's first token goes out at once (TTFT never waits for a window); after it,
                # a DELTA per window (events.DeltaCoalescer).
                first = sequencer.last_sequence == 0
                if coalescer.pending() and (pump.done or stop or first or coalescer.due(now * 1000)):
                    pump.disarm_window()
                    await self._publish_delta(sequencer, decoder, coalescer.take())
                    continue
                if pump.done or stop is not None:
                    break
                if coalescer.pending() and pump.window_at is None:
                    pump.wait_window()       # the clock handed its window back before its end
                self._arm_horizon(pump, now)
                self._parked = True
                try:
                    await self._wake.wait()
                finally:
                    self._parked = False
        finally:
            pump.disarm_window()
            await _cancelled(task)
            self._pump = None
        self._note_timing(pump)
        return Attempt(self.replica, pump.received_tokens, pump.error, stop)

    def _window_closed(self, pump: _Pump) -> Awaitable[None] | None:
        """The clock closed `pump`'s window. While the driver's loop sleeps with nothing else to look
        at, the window's DELTA is published for it (the clock runs one task for all the runs of an
        instant) and the loop sleeps on: no task wake-up per run per window. Anything that needs the
        loop's judgment (the run's first event, an ack to wait for, a publication that failed, a stop
        or a lease to act on, the stream's end) wakes it instead, and it publishes the window itself."""
        now = time.monotonic()
        sequencer = self._sequencer
        if not self._parked or self._wake.is_set() or self._publishing or pump is not self._pump \
                or pump.done or sequencer is None or sequencer.last_sequence == 0 \
                or len(self._in_flight) >= MAX_IN_FLIGHT or self._publish_error is not None \
                or not self.lease.valid(now) or self._stop_reason(pump, now) is not None \
                or not pump.coalescer.due(now * 1000):
            self._wake.set()
            return None
        self._publishing = True
        return self._publish_window(pump, pump.coalescer.take())

    async def _publish_window(self, pump: _Pump, tokens: Sequence[int]) -> None:
        """The clock's publication of one window of the run (_window_closed). The loop waits for it
        before it looks at anything (_window_published): a run's events have one publisher at a time,
        so their order in the log is their sequence order."""
        try:
            if self._pump is pump and self._sequencer is not None and self._decoder is not None:
                await self._publish_delta(self._sequencer, self._decoder, tokens)
        except Exception as error:   # the loop raises it when it next looks, as it does a failed ack
            self._publish_error = self._publish_error or error
            self._wake.set()
        finally:
            self._publishing = False
            published, self._published = self._published, None
            if published is not None and not published.done():
                published.set_result(None)

    async def _window_published(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the clock's publication of a window of this run is done."""
        published = self._published = loop.create_future()
        await published

    def _stop_reason(self, pump: _Pump, now: float) -> Stop | None:
        if self.cancel_requested.is_set():
            return Stop(RunStatus.CANCELLED, DETAIL_CANCELLED)
        if now >= self._deadline:
            return Stop(RunStatus.EXPIRED, DETAIL_EXPIRED)
        if self._hung is not None:
            return Stop(RunStatus.INTERRUPTED, DETAIL_REPLICA_HUNG.format(
                replica=self.replica, tokens=pump.received_tokens, why=self._hung),
                hung=True)
        if pump.first_token_at is None and now - pump.sent_at >= self.settings.first_token_timeout_s:
            return Stop(RunStatus.INTERRUPTED, DETAIL_NO_FIRST_TOKEN.format(
                replica=self.replica, seconds=self.settings.first_token_timeout_s), no_first_token=True)
        return None

    async def _move_to_another_replica(self, why: str) -> bool:
        """After an attempt that failed before its first token: True when the run moved elsewhere."""
        failed = self.replica
        self._check_lease()
        target = await self.reroute(self)
        if target is None:
            return False
        await self.ledger.reassign(self.lease, target.replica)
        log.info("run %s: %s failed before the first token (%s); retrying on %s", self.run_id, failed, why,
                 target.replica)
        self.claim = dataclasses.replace(self.claim, replica=target.replica)
        self.address = target.address
        self.settings = dataclasses.replace(self.settings, block_size=target.block_size,
                                            cache_salt_id=target.cache_salt_id)
        self.tried.append(target.replica)
        return True

    def _arm_horizon(self, pump: _Pump, now: float) -> None:
        """Make sure a timer wakes the driver by the next time-based limit: the deadline, the lease's end,
        the first-token limit. One timer serves every wake-up before it (a token, a window's end, an
        ack) instead of a timer armed and cancelled per sleep; it is re-armed only when it fired or a
        limit came closer. (A renewal moves the lease's end later: the old timer then wakes the driver
        once, early, and the next one is armed at the new end.) The window's end has its own timer,
        armed by the pump when a window opens."""
        at = min(self._deadline, self.lease.ends_by)
        if pump.first_token_at is None:
            at = min(at, pump.sent_at + self.settings.first_token_timeout_s)
        if self._horizon is not None:
            if self._horizon_at <= at:
                return
            self._horizon.cancel()
        self._horizon_at = at
        self._horizon = (pump.loop or asyncio.get_running_loop()).call_later(max(0.0, at - now),
                                                                            self._horizon_reached)

    def _horizon_reached(self) -> None:
        self._horizon = None
        self._wake.set()

    async def _read(self, pump: _Pump, early: EarlyCall | None) -> None:
        try:
            if early is not None:
                await early.deliver(pump.take)
            else:
                await call_replica(self.replicas, self.address, self.claim, self.settings.cache_salt_id,
                                   pump.take)
        except Exception as exc:  # the outcome is decided by outcome.decide
            pump.error = exc
        finally:
            pump.done = True
            pump.wake.set()

    async def _stop_replica(self, pump_task: asyncio.Task[None], abandon: bool = False) -> None:
        """Ask the replica to stop and give its stream a moment to end with what it produced. A hung
        replica is not asked (it would not answer): its stream is abandoned at once."""
        if abandon:
            await _cancelled(pump_task)
            return
        try:
            await asyncio.wait_for(self.replicas.stop(self.address, self.run_id), STOP_DRAIN_S)
            await asyncio.wait_for(asyncio.shield(pump_task), STOP_DRAIN_S)
        except Exception as exc:
            log.warning("run %s: stop on %s did not complete cleanly: %s", self.run_id, self.address, exc)

    # --- publishing ---------------------------------------------------------------------------

    async def _publish_delta(self, sequencer: RunEventSequencer, decoder: IncrementalDecoder,
                             tokens: Sequence[int]) -> None:
        now_ms = int(time.time() * 1000)
        if sequencer.last_sequence == 0:
            await self._publish_first(sequencer, decoder, tokens, now_ms)
            return
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            await asyncio.wait([self._in_flight[0][0]])
            self._check_lease()
        await self._publish(sequencer.delta(tokens, decoder.push(tokens), now_ms), len(tokens))

    async def _publish_first(self, sequencer: RunEventSequencer, decoder: IncrementalDecoder,
                             tokens: Sequence[int], now_ms: int) -> None:
        """The first token makes the run RUNNING: the STATUS event and the first DELTA go out together,
        sent at once (the first token never waits out the producer's linger). A Stream hands them on
        only once the ledger has committed RUNNING (DESIGN.md: durable before anyone is told), so
        RUNNING is written while they travel to the log, not after their acknowledgment: the two
        round trips overlap instead of adding up (issue 9, TTFT). Where the events start is only
        known once they are durable: recorded after, in a write nobody waits for."""
        self._check_lease()
        running = asyncio.ensure_future(self.ledger.mark_running(self.lease, None, 0))
        try:
            # It carries the routing decision, so a stream shows where the run went before any token.
            first_status = sequencer.status(common_pb2.RUN_STATUS_RUNNING, now_ms)
            first_status.route.CopyFrom(route_message(self.claim.route))
            status = await self.events.publish(first_status)
            self._track(status, sequencer.last_sequence, 0)
            delta = sequencer.delta(tokens, decoder.push(tokens), now_ms)
            await self._publish(delta, len(tokens), at_once=True)
            first = await status
        except BaseException:
            # The publication's failure decides the run's outcome; RUNNING may or may not be committed.
            running.cancel()
            running.add_done_callback(_retrieved)
            raise
        await running                     # LeaseLost: the ledger refused RUNNING under this epoch
        self._check_lease()
        self._first = first
        self.ledger.record_start(self.lease, first, 1)

    async def _publish(self, event: runs_pb2.RunEvent, tokens: int, at_once: bool = False) -> None:
        self._track(await self.events.publish(event, at_once=at_once), event.sequence, tokens)
        self._published_tokens += tokens

    def _track(self, ack: asyncio.Future[LogPosition], sequence: int, tokens: int) -> None:
        self._in_flight.append((ack, sequence, tokens))
        ack.add_done_callback(self._acked)

    def _acked(self, _: asyncio.Future[LogPosition]) -> None:
        """Advance durable progress over the acknowledged prefix of the run's events, in order."""
        while self._in_flight and self._in_flight[0][0].done():
            ack, sequence, tokens = self._in_flight.popleft()
            if ack.cancelled():
                continue
            if (error := ack.exception()) is not None:
                self._publish_error = self._publish_error or error
                self._wake.set()
                continue
            self.last_sequence = sequence
            self.output_tokens += tokens
            self.lease.last_sequence, self.lease.output_tokens = self.last_sequence, self.output_tokens

    async def _flush(self) -> None:
        """Wait until every event published is durable (the terminal write must follow them)."""
        if self._in_flight:
            await asyncio.wait([ack for ack, _, _ in self._in_flight])
        if self._publish_error is not None:
            raise self._publish_error

    # --- after the run ------------------------------------------------------------------------

    def _note_timing(self, pump: _Pump) -> None:
        self._reported_cached = min(self.claim.input_tokens, pump.reused_blocks * self.settings.block_size)
        self._first_token_wall = pump.first_token_wall
        self._tpot_s = pump.step_s()

    def _ttft_s(self) -> float | None:
        created = self.claim.created_at
        if self._first_token_wall is None or created is None:
            return None
        return self._first_token_wall - created.timestamp()

    def _outcome(self, record: TerminalRecord) -> RunOutcome:
        usage = record.usage
        return RunOutcome(status=record.status, replica=self.claim.replica, attempts=len(self.tried),
                          input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                          cached_input_tokens=usage.cached_input_tokens,
                          reported_cached_tokens=self._reported_cached, ttft_s=self._ttft_s(),
                          tpot_s=self._tpot_s)


def _retrieved(task: asyncio.Future[None]) -> None:
    """Done callback of a task nobody awaits any more: its outcome is read so it is not reported."""
    if not task.cancelled():
        task.exception()


async def _cancelled(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
