"""One run on one replica, from the first token to its terminal event.

    replica stream ──pump──▶ DeltaCoalescer ──loop──▶ event log (1 event in flight)
                                  ▲                         │ durable position
        cancel / deadline / lease ┘                         ▼
                                               progress (renewed into the ledger)

The pump task only reads the replica's stream into the coalescer; the main
loop publishes. While an append is in flight new tokens keep accumulating, so
a slow log produces fewer, larger DELTA events rather than a backlog.

Every token the replica produced before the run ended is published before the
terminal event and counted in its usage (consumed compute counts, DESIGN.md).

Retry (router/retry.py). An attempt that fails before its first token (the
replica refused the connection or the request, died, or produced nothing within
first_token_timeout_s) is not the end of the run: nothing was promised yet, so
the worker may route it to a replica it has not tried (`reroute`, which records
the new replica in the ledger before it is contacted), up to max_attempts. Once
a token exists a replica failure ends the run INTERRUPTED, never retried. A run
no replica ever took ends FAILED and its prompt is not charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sluice.ledger.models import RunStatus
from sluice.services import replica_client
from sluice.services.finish import Ending, TerminalRecord, publish_terminal, settle_and_fix_terminal
from sluice.services.replica_client import ReplicaLost, ReplicaRejected, TokenChunk
from sluice.services.routing.claims import ClaimedRun, LeaseProgress, lock_own_active, mark_running
from sluice.services.routing.observability import RunOutcome
from sluice.services.routing.textdecode import IncrementalDecoder, load_tokenizer
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.events import DeltaCoalescer, RunEventSequencer
from sluice.eventlog.interface import EventLog, LogPosition
from sluice.router.retry import DEFAULT_MAX_ATTEMPTS, NO_REPLICA_STARTED, FailureAction, after_replica_failure
from sluice.v1 import common_pb2

log = logging.getLogger(__name__)

STOP_DRAIN_S = 3.0  # after `stop`, how long the replica may take to close the stream
FENCE_FRACTION = 0.5  # a driver stops appending this far (in leases) after its last renewal was sent

DETAIL_CANCELLED = "cancelled by the caller"
DETAIL_EXPIRED = "deadline passed before the run completed"
DETAIL_NO_FIRST_TOKEN = "replica {replica} produced no token within {seconds:g}s"
DETAIL_REPLICA_LOST = "replica {replica} lost mid-stream after {tokens} tokens: {error}"
DETAIL_REPLICA_REJECTED = "replica {replica} refused the run: {error}"
DETAIL_NOT_STARTED = NO_REPLICA_STARTED + "; the last: {last}"
DETAIL_FAILED_BEFORE_START = "replica {replica} failed before the first token: {error}"


class ReplicaClient(Protocol):
    def stream_generate(self, address: str, request_id: str, prompt_ids: Sequence[int],
                        max_new_tokens: int, end_id: int | None = None, *,
                        cache_salt: int = 0) -> AsyncIterator[TokenChunk]:
        ...

    async def stop(self, address: str, request_id: str) -> None:
        ...


class _ModuleReplicaClient:
    """The Triton client module as a ReplicaClient (the seam tests never need to replace)."""

    def stream_generate(self, address: str, request_id: str, prompt_ids: Sequence[int],
                        max_new_tokens: int, end_id: int | None = None, *,
                        cache_salt: int = 0) -> AsyncIterator[TokenChunk]:
        return replica_client.stream_generate(address, request_id, prompt_ids, max_new_tokens, end_id,
                                              cache_salt=cache_salt)

    async def stop(self, address: str, request_id: str) -> None:
        await replica_client.stop(address, request_id)


TRITON = _ModuleReplicaClient()


@dataclass(frozen=True, slots=True)
class DriverSettings:
    owner: str                   # this process's lease owner id
    lease_seconds: float
    coalesce_ms: float
    first_token_timeout_s: float
    block_size: int              # replica KV block size: reused blocks → cached prompt tokens
    max_attempts: int = DEFAULT_MAX_ATTEMPTS   # replicas a run may try before its first token


class LeaseLost(Exception):
    """Another routing process took the run over; this driver must not write anything more."""


@dataclass(frozen=True, slots=True)
class Target:
    """A replica a run is (re)sent to."""

    replica: str
    address: str                 # Triton gRPC host:port
    block_size: int              # its KV block size


Reroute = Callable[["RunDriver"], Awaitable[Target | None]]
"""The worker's retry hook: choose an untried replica for the driver's run and record it in the
ledger (None: nowhere to go). Raises LeaseLost when the run is no longer this process's."""


async def _nowhere(driver: RunDriver) -> Target | None:
    return None


@dataclass(frozen=True, slots=True)
class _Stop:
    """Why the driver stopped the replica's stream itself."""

    status: RunStatus
    detail: str
    no_first_token: bool = False  # the first-token timeout: a failed attempt, retryable


@dataclass(slots=True)
class _Pump:
    coalescer: DeltaCoalescer
    wake: asyncio.Event
    done: bool = False
    error: BaseException | None = None
    received_tokens: int = 0
    reused_blocks: int = 0
    first_token_at: float | None = None     # monotonic
    first_token_wall: float | None = None   # time.time(), for TTFT from the submit
    last_token_at: float | None = None      # monotonic


@dataclass(slots=True)
class RunDriver:
    claim: ClaimedRun
    address: str
    settings: DriverSettings
    sessions: async_sessionmaker[AsyncSession]
    events: EventLog
    replicas: ReplicaClient = TRITON
    on_replica_lost: Callable[[str], None] = lambda name: None
    reroute: Reroute = _nowhere
    # Driver state read by the worker's lease keeper and cancel listener.
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    lease_lost: bool = False
    # Self-fencing: the driver appends nothing at or after this monotonic time unless a lease
    # renewal moved it. It trails the ledger's lease_expires_at by half a lease, so a driver
    # cut off from the ledger (paused, partitioned) stops writing before any reaper may act.
    fence_at: float = float("inf")
    last_sequence: int = 0       # last event durable in the log
    output_tokens: int = 0       # tokens in durable DELTA events
    tried: list[str] = field(default_factory=list)   # replicas sent this run, in order
    prompt_taken: bool = False   # some replica produced output or held the request until stopped
    outcome: RunOutcome | None = None                # set when the driver settled the run
    _reported_cached: int = 0
    _first_token_wall: float | None = None
    _tpot_s: float | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def run_id(self) -> str:
        return self.claim.run_id

    def progress(self) -> LeaseProgress:
        return LeaseProgress(self.run_id, self.last_sequence, self.output_tokens)

    def request_cancel(self) -> None:
        self.cancel_requested.set()
        self._wake.set()

    def revoke_lease(self) -> None:
        self.lease_lost = True
        self._wake.set()

    def extend_fence(self, renewal_sent_at: float) -> None:
        """A renewal sent at `renewal_sent_at` (monotonic) succeeded."""
        fence = renewal_sent_at + self.settings.lease_seconds * FENCE_FRACTION
        self.fence_at = fence if self.fence_at == float("inf") else max(self.fence_at, fence)

    def _check_lease(self) -> None:
        if self.lease_lost or time.monotonic() >= self.fence_at:
            raise LeaseLost()

    async def run(self) -> TerminalRecord | None:
        """Drive the run to its end; None when the lease was lost (someone else ends it)."""
        try:
            ending = await self._drive()
            record = await self._finish(ending)
            if record is not None:
                self.outcome = self._outcome(record)
            return record
        except LeaseLost:
            log.warning("run %s: lease lost, leaving it to the reaper", self.run_id)
            return None

    async def _drive(self) -> Ending:
        claim = self.claim
        sequencer = RunEventSequencer(claim.run_id)
        decoder = IncrementalDecoder(load_tokenizer(claim.tokenizer))
        self.tried.append(claim.replica or self.address)
        pump, task = self._send()
        started = time.monotonic()
        stop_reason: _Stop | None = None
        try:
            while True:
                self._wake.clear()
                self._check_lease()
                now = time.monotonic()
                if stop_reason is None:
                    stop_reason = self._stop_reason(pump, now, started)
                    if stop_reason is not None:
                        await self._stop_replica(task)
                coalescer = pump.coalescer
                if coalescer.pending() and (pump.done or stop_reason or coalescer.due(now * 1000)):
                    await self._publish_delta(sequencer, decoder, coalescer.take())
                    continue
                if pump.done or stop_reason is not None:
                    retry = self._failed_before_first_token(pump, stop_reason)
                    if retry and await self._retry(pump, stop_reason):
                        await _cancelled(task)
                        pump, task = self._send()
                        started, stop_reason = time.monotonic(), None
                        continue
                    break
                await self._sleep(self._next_wake(pump, now, started))
        finally:
            await _cancelled(task)
        self._note_timing(pump)
        return self._ending(sequencer, pump, stop_reason)

    def _send(self) -> tuple[_Pump, asyncio.Task[None]]:
        """One attempt: stream the run from the current replica into a fresh pump."""
        pump = _Pump(DeltaCoalescer(self.settings.coalesce_ms), self._wake)
        return pump, asyncio.create_task(self._pump(pump), name=f"pump-{self.run_id}-{len(self.tried)}")

    def _stop_reason(self, pump: _Pump, now: float, started: float) -> _Stop | None:
        if self.cancel_requested.is_set():
            return _Stop(RunStatus.CANCELLED, DETAIL_CANCELLED)
        if time.time() >= self.claim.deadline_at.timestamp():
            return _Stop(RunStatus.EXPIRED, DETAIL_EXPIRED)
        if pump.first_token_at is None and now - started >= self.settings.first_token_timeout_s:
            return _Stop(RunStatus.INTERRUPTED, DETAIL_NO_FIRST_TOKEN.format(
                replica=self.claim.replica, seconds=self.settings.first_token_timeout_s), no_first_token=True)
        return None

    @staticmethod
    def _failed_before_first_token(pump: _Pump, stop: _Stop | None) -> bool:
        """The attempt ended with no token: the replica refused or lost it, or never answered in time."""
        if pump.received_tokens:
            return False
        if stop is not None:
            return stop.no_first_token
        return isinstance(pump.error, ReplicaLost | ReplicaRejected)

    def _attempt_detail(self, pump: _Pump, stop: _Stop | None) -> str:
        replica = self.claim.replica or self.address
        if stop is not None:
            return stop.detail
        if isinstance(pump.error, ReplicaRejected):
            return DETAIL_REPLICA_REJECTED.format(replica=replica, error=pump.error)
        return DETAIL_FAILED_BEFORE_START.format(replica=replica, error=pump.error)

    async def _retry(self, pump: _Pump, stop: _Stop | None) -> bool:
        """After an attempt that failed before its first token: True when the run moved to another replica."""
        failed = self.claim.replica or self.address
        if stop is not None:
            self.prompt_taken = True         # the replica held the prompt until we stopped it
        if stop is not None or isinstance(pump.error, ReplicaLost):
            self.on_replica_lost(failed)     # a refusal of this request says nothing of the replica
        if after_replica_failure(0, len(self.tried), self.settings.max_attempts) is not FailureAction.RETRY:
            return False
        self._check_lease()
        target = await self.reroute(self)
        if target is None:
            return False
        log.info("run %s: %s failed before the first token (%s); retrying on %s", self.run_id, failed,
                 self._attempt_detail(pump, stop), target.replica)
        self.claim = dataclasses.replace(self.claim, replica=target.replica)
        self.address = target.address
        self.settings = dataclasses.replace(self.settings, block_size=target.block_size)
        self.tried.append(target.replica)
        return True

    def _next_wake(self, pump: _Pump, now: float, started: float) -> float:
        """Seconds until something time-based can happen: window close, deadline, first-token limit."""
        waits = [self.claim.deadline_at.timestamp() - time.time()]
        window = pump.coalescer.remaining_ms(now * 1000)
        if window is not None:
            waits.append(window / 1000)
        if pump.first_token_at is None:
            waits.append(started + self.settings.first_token_timeout_s - now)
        return max(0.0, min(waits))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    async def _pump(self, pump: _Pump) -> None:
        claim = self.claim
        try:
            stream = self.replicas.stream_generate(self.address, claim.run_id, claim.prompt_token_ids,
                                                   claim.max_output_tokens, claim.end_id,
                                                   cache_salt=claim.cache_salt)
            async for chunk in stream:
                pump.reused_blocks = max(pump.reused_blocks, chunk.kv_cache_reused_blocks)
                # Never more than the cap the budget reserved for, whatever the replica sends.
                room = claim.max_output_tokens - pump.received_tokens
                tokens = list(chunk.token_ids[:room])
                if not tokens:
                    continue
                arrived = time.monotonic()
                if pump.first_token_at is None:
                    pump.first_token_at, pump.first_token_wall = arrived, time.time()
                pump.last_token_at = arrived
                pump.received_tokens += len(tokens)
                pump.coalescer.add(tokens, arrived * 1000)
                pump.wake.set()
        except Exception as exc:  # the outcome is classified in _ending
            pump.error = exc
        finally:
            pump.done = True
            pump.wake.set()

    async def _stop_replica(self, pump_task: asyncio.Task[None]) -> None:
        """Ask the replica to stop and give its stream a moment to end with what it produced."""
        try:
            await asyncio.wait_for(self.replicas.stop(self.address, self.run_id), STOP_DRAIN_S)
            await asyncio.wait_for(asyncio.shield(pump_task), STOP_DRAIN_S)
        except Exception as exc:
            log.warning("run %s: stop on %s did not complete cleanly: %s", self.run_id, self.address, exc)

    async def _publish_delta(self, sequencer: RunEventSequencer, decoder: IncrementalDecoder,
                             tokens: list[int]) -> None:
        now_ms = int(time.time() * 1000)
        if sequencer.last_sequence == 0:
            # The first token makes the run RUNNING: STATUS event first, then the ledger
            # records the transition together with where the run's events start.
            self._check_lease()
            first = await self.events.append(sequencer.status(common_pb2.RUN_STATUS_RUNNING, now_ms))
            self.last_sequence = sequencer.last_sequence
            await self._mark_running(first)
        self._check_lease()
        await self.events.append(sequencer.delta(tokens, decoder.push(tokens), now_ms))
        self.last_sequence = sequencer.last_sequence
        self.output_tokens += len(tokens)

    async def _mark_running(self, first: LogPosition) -> None:
        async with self.sessions() as session, session.begin():
            if not await mark_running(session, self.run_id, self.settings.owner, first, self.last_sequence):
                raise LeaseLost()

    def _note_timing(self, pump: _Pump) -> None:
        self._reported_cached = min(self.claim.input_tokens, pump.reused_blocks * self.settings.block_size)
        self._first_token_wall = pump.first_token_wall
        if pump.received_tokens >= 2 and pump.first_token_at is not None and pump.last_token_at is not None:
            self._tpot_s = (pump.last_token_at - pump.first_token_at) / (pump.received_tokens - 1)

    def _ending(self, sequencer: RunEventSequencer, pump: _Pump, stop_reason: _Stop | None) -> Ending:
        last, tokens = sequencer.last_sequence, self.output_tokens
        cached = self._reported_cached
        if pump.received_tokens or (stop_reason is not None and pump.error is None):
            self.prompt_taken = True
        if self._failed_before_first_token(pump, stop_reason):
            return Ending(RunStatus.FAILED, last, tokens,
                          DETAIL_NOT_STARTED.format(attempts=len(self.tried),
                                                    last=self._attempt_detail(pump, stop_reason)),
                          prompt_taken=self.prompt_taken)
        if stop_reason is not None:
            return Ending(stop_reason.status, last, tokens, stop_reason.detail, cached_input_tokens=cached,
                          prompt_taken=self.prompt_taken)
        replica = self.claim.replica or self.address
        if isinstance(pump.error, ReplicaLost):
            self.on_replica_lost(replica)
            return Ending(RunStatus.INTERRUPTED, last, tokens,
                          DETAIL_REPLICA_LOST.format(replica=replica, tokens=tokens, error=pump.error),
                          cached_input_tokens=cached)
        if isinstance(pump.error, ReplicaRejected):
            return Ending(RunStatus.FAILED, last, tokens,
                          DETAIL_REPLICA_REJECTED.format(replica=replica, error=pump.error),
                          prompt_taken=self.prompt_taken)
        if pump.error is not None:
            log.error("run %s: replica stream failed", self.run_id, exc_info=pump.error)
            return Ending(RunStatus.FAILED, last, tokens, f"replica stream failed: {pump.error!r}",
                          prompt_taken=self.prompt_taken)
        return Ending(RunStatus.COMPLETED, last, tokens, cached_input_tokens=cached)

    def _outcome(self, record: TerminalRecord) -> RunOutcome:
        created = self.claim.created_at
        ttft = None
        if self._first_token_wall is not None and created is not None:
            ttft = self._first_token_wall - created.timestamp()
        usage = record.usage
        return RunOutcome(status=record.status, replica=self.claim.replica, attempts=len(self.tried),
                          input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                          cached_input_tokens=usage.cached_input_tokens,
                          reported_cached_tokens=self._reported_cached, ttft_s=ttft, tpot_s=self._tpot_s)

    async def _finish(self, ending: Ending) -> TerminalRecord | None:
        async with self.sessions() as session, session.begin():
            if await lock_own_active(session, self.run_id, self.settings.owner) is None:
                raise LeaseLost()
            record = await settle_and_fix_terminal(session, self.run_id, ending, self.settings.owner,
                                                   self.settings.lease_seconds)
        if record is None:
            return None
        await publish_terminal(self.events, self.sessions, record)
        return record


async def _cancelled(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
