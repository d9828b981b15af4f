"""The run driver on its own: an in-memory event log, a scripted replica and an in-memory ledger,
no servers. Each test pins the exact events a run publishes and the ledger calls it makes."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import pytest
from sluice.ledger.models import RunStatus
from sluice.services.admission_rules import ENGINE_DEFAULT, Sampling
from sluice.services.finish import Ending, TerminalRecord
from sluice.services.replica_client import ReplicaLost, ReplicaRejected, TokenChunk
from sluice.services.routing import driver as driver_module
from sluice.services.routing.claims import ClaimedRun
from sluice.services.routing.driver import DriverSettings, RunDriver, Target, Wake
from sluice.services.routing.leases import Lease
from sluice.services.routing.monitor import JUDGED_FROM_S, STALLED_TICK_S, Silence, StallGuard, hung
from sluice.services.routing.outcome import (
    DETAIL_CANCELLED,
    DETAIL_REPLICA_HUNG,
    DETAIL_REPLICA_LOST,
    Attempt,
    RunSoFar,
    Stop,
    decide,
)
from sluice.services.routing.run_ledger import LeaseLost

from sluice.eventlog.events import EventDeduper, fence_event, terminal_event
from sluice.eventlog.interface import LogPosition
from sluice.v1 import common_pb2, runs_pb2

DELTA, STATUS, TERMINAL = runs_pb2.EVENT_TYPE_DELTA, runs_pb2.EVENT_TYPE_STATUS, runs_pb2.EVENT_TYPE_TERMINAL
EPOCH = 7
SPARSE_S = 0.03      # tokens this far apart: each is its own DELTA (more than the 5 ms window)
START = LogPosition(0, 0)   # where a run's events start in a fresh MemoryLog (its STATUS RUNNING)


# --- fakes -------------------------------------------------------------------------------------


@dataclass
class MemoryLog:
    """Events in publication order; each publication acknowledged after `ack_delay_s`."""

    ack_delay_s: float = 0.0
    events: list[runs_pb2.RunEvent] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)         # sequences, in acknowledgment order
    at_once: list[int] = field(default_factory=list)       # sequences published to be sent unbatched

    async def publish(self, event: runs_pb2.RunEvent, *,
                      at_once: bool = False) -> asyncio.Future[LogPosition]:
        position = LogPosition(0, len(self.events))
        self.events.append(event)
        if at_once:
            self.at_once.append(event.sequence)
        ack: asyncio.Future[LogPosition] = asyncio.get_running_loop().create_future()

        def acknowledge() -> None:
            self.acked.append(event.sequence)
            ack.set_result(position)
        asyncio.get_running_loop().call_later(self.ack_delay_s, acknowledge)
        return ack

    async def append(self, event: runs_pb2.RunEvent) -> LogPosition:
        return await (await self.publish(event))

    def shape(self) -> list[tuple[int, int, int, int]]:
        """(sequence, type, tokens, epoch) of each event."""
        return [(e.sequence, e.type, len(e.token_ids), e.lease_epoch) for e in self.events]


@dataclass
class MemoryLedger:
    log: MemoryLog
    calls: list[tuple[str, object]] = field(default_factory=list)
    refuse_running: bool = False
    running_saw: tuple[int, list[int]] | None = None     # (events published, sequences acked) at RUNNING

    async def mark_running(self, lease: Lease, first: LogPosition | None, last_sequence: int) -> None:
        if self.refuse_running:
            raise LeaseLost("refused")
        # What RUNNING's commit may overlap: events published, none of them durable yet.
        self.running_saw = (len(self.log.events), list(self.log.acked))
        self.calls.append(("running", (first, last_sequence)))

    def record_start(self, lease: Lease, first: LogPosition, last_sequence: int) -> None:
        self.calls.append(("start", (first, last_sequence)))

    async def reassign(self, lease: Lease, replica: str) -> None:
        self.calls.append(("reassign", replica))

    async def finish(self, lease: Lease, ending: Ending) -> TerminalRecord | None:
        # What the terminal write may rely on: every event before it is durable.
        durable = sorted(self.log.acked) == [e.sequence for e in self.log.events]
        self.calls.append(("finish", (ending, durable)))
        usage = common_pb2.TokenUsage(output_tokens=ending.output_tokens)
        return TerminalRecord(lease.run_id, ending.last_sequence + 1, ending.status, usage,
                              ending.detail or "", lease.epoch)

    async def publish_terminal(self, record: TerminalRecord) -> None:
        await self.log.append(terminal_event(record.run_id, record.sequence, common_pb2.RUN_STATUS_COMPLETED
                                             if record.status is RunStatus.COMPLETED else
                                             common_pb2.RUN_STATUS_INTERRUPTED, record.usage, record.detail,
                                             0, record.epoch))

    def finished(self) -> Ending:
        (ending, durable_first), = [args for name, args in self.calls if name == "finish"]  # type: ignore[misc]
        assert durable_first, "the terminal write came before every event was durable"
        return ending  # type: ignore[no-any-return]


@dataclass
class Script:
    """What a replica does: chunks of tokens, `gap_s` apart, then ends, fails, or goes silent."""

    chunks: list[tuple[int, ...]]
    gap_s: float = SPARSE_S
    then: BaseException | None = None
    silent_after: bool = False


@dataclass
class ScriptedReplicas:
    scripts: dict[str, Script]
    stops: list[str] = field(default_factory=list)
    _stopped: dict[str, asyncio.Event] = field(default_factory=dict)

    def stream_generate(self, address: str, request_id: str, prompt_ids: Sequence[int],
                        max_new_tokens: int, end_id: int | None = None, *, cache_salt: int = 0,
                        sampling: Sampling = ENGINE_DEFAULT) -> AsyncIterator[TokenChunk]:
        return self._stream(address, self.scripts[address])

    async def generate(self, address: str, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
                       end_id: int | None = None, *, cache_salt: int = 0, sampling: Sampling = ENGINE_DEFAULT,
                       on_chunk: Callable[[TokenChunk], None]) -> None:
        async for chunk in self._stream(address, self.scripts[address]):
            on_chunk(chunk)

    async def _stream(self, address: str, script: Script) -> AsyncIterator[TokenChunk]:
        stopped = self._stopped.setdefault(address, asyncio.Event())
        for chunk in script.chunks:
            if stopped.is_set():
                yield TokenChunk((), 3, 0, stopped=True)
                return
            await asyncio.sleep(script.gap_s)
            yield TokenChunk(chunk, 3, 0)
        if script.then is not None:
            raise script.then
        if script.silent_after:
            await asyncio.Event().wait()

    async def stop(self, address: str, request_id: str) -> None:
        self.stops.append(address)
        self._stopped.setdefault(address, asyncio.Event()).set()


def claim(max_output_tokens: int = 100) -> ClaimedRun:
    return ClaimedRun(run_id=str(uuid.uuid4()), tenant_id=uuid.uuid4(), model_version="m", worker_pool="m",
                      tokenizer="no-such-tokenizer.json", end_id=0, prompt_token_ids=(5, 6, 7),
                      input_tokens=3,
                      max_output_tokens=max_output_tokens, conversation_id=None,
                      deadline_at=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1), replica="r0",
                      queued_at=None, epoch=EPOCH)


def driver_for(replicas: ScriptedReplicas, log: MemoryLog | None = None, *, max_attempts: int = 2,
               targets: list[Target] | None = None, window_ms: float = 5.0,
               window_tokens: int = 0) -> tuple[RunDriver, MemoryLedger, list[str]]:
    log = log or MemoryLog()
    ledger = MemoryLedger(log)
    lost: list[str] = []
    waiting = list(targets or [])

    async def reroute(driver: RunDriver) -> Target | None:
        return waiting.pop(0) if waiting else None

    run = claim()
    settings = DriverSettings("me", 5.0, window_ms, 30.0, 16, max_attempts, coalesce_max_tokens=window_tokens)
    driver = RunDriver(claim=run, address="r0", settings=settings,
                       events=log, ledger=ledger, lease=Lease(run.run_id, EPOCH, time.monotonic() + 60),
                       replicas=replicas, on_replica_lost=lost.append, reroute=reroute)
    return driver, ledger, lost


async def until(condition: Callable[[], bool]) -> None:
    """Poll the driver's state (it offers no event for a test to wait on)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never met")


# --- the driver ----------------------------------------------------------------------------------


async def test_a_run_publishes_running_then_a_delta_per_sparse_chunk_and_settles_once_all_are_durable():
    replicas = ScriptedReplicas({"r0": Script([(11, 12), (13,), (14, 15)])})
    log = MemoryLog(ack_delay_s=0.02)                  # acks lag behind publication
    driver, ledger, lost = driver_for(replicas, log)
    record = await driver.run()
    assert log.shape() == [(1, STATUS, 0, EPOCH), (2, DELTA, 2, EPOCH), (3, DELTA, 1, EPOCH),
                           (4, DELTA, 2, EPOCH), (5, TERMINAL, 0, EPOCH)]
    assert [e.token_ids for e in log.events if e.type == DELTA] == [[11, 12], [13], [14, 15]]
    assert ledger.calls[:2] == [("running", (None, 0)), ("start", (START, 1))]
    assert ledger.finished() == Ending(RunStatus.COMPLETED, 4, 5, None, first=START,
                                       cached_input_tokens=0)
    assert record is not None and record.sequence == 5 and lost == []
    assert (driver.last_sequence, driver.output_tokens) == (4, 5)       # durable progress, for renewals
    assert (driver.lease.last_sequence, driver.lease.output_tokens) == (4, 5)


async def test_running_is_committed_while_the_first_events_travel_and_their_start_recorded_once_durable():
    # A Stream holds the first event until RUNNING is committed: RUNNING is written while the STATUS
    # and the first DELTA are on their way to the log (both published, neither acknowledged), not
    # after their acknowledgment; where they start is recorded once the STATUS is durable.
    replicas = ScriptedReplicas({"r0": Script([(11, 12), (13,)])})
    log = MemoryLog(ack_delay_s=0.05)
    driver, ledger, _ = driver_for(replicas, log)
    await driver.run()
    assert ledger.running_saw == (2, [])
    assert ledger.calls[:2] == [("running", (None, 0)), ("start", (START, 1))]
    # Settled with that start too, should its own write have been lost.
    assert ledger.finished().first == START


async def test_tokens_arriving_within_one_window_share_one_delta():
    replicas = ScriptedReplicas({"r0": Script([(1,), (2,), (3,), (4,)], gap_s=0.0)})
    driver, ledger, _ = driver_for(replicas)
    await driver.run()
    deltas = [list(e.token_ids) for e in driver.events.events if e.type == DELTA]  # type: ignore[attr-defined]
    assert sum(deltas, []) == [1, 2, 3, 4] and len(deltas) < 4
    assert ledger.finished().output_tokens == 4


async def test_the_first_token_is_published_at_once_and_the_rest_in_windows_closed_by_their_token_limit():
    # A window far longer than the run: only the token limit (3) and the stream's end close one.
    replicas = ScriptedReplicas({"r0": Script([(1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,)], gap_s=0.0)})
    driver, ledger, _ = driver_for(replicas, window_ms=60_000, window_tokens=3)
    await driver.run()
    deltas = [list(e.token_ids) for e in driver.events.events if e.type == DELTA]  # type: ignore[attr-defined]
    assert deltas == [[1], [2, 3, 4], [5, 6, 7], [8]]
    assert ledger.finished() == Ending(RunStatus.COMPLETED, 5, 8, None, first=START, cached_input_tokens=0)


async def test_the_first_token_does_not_wait_for_its_window():
    replicas = ScriptedReplicas({"r0": Script([(1,), (2,)], gap_s=0.5)})
    driver, _, _ = driver_for(replicas, window_ms=60_000)
    running = asyncio.create_task(driver.run())
    await until(lambda: driver.output_tokens >= 1)          # the first DELTA is durable ...
    assert driver._pump is not None and driver._pump.received_tokens == 1   # ... before the second token
    await running
    deltas = [list(e.token_ids) for e in driver.events.events if e.type == DELTA]  # type: ignore[attr-defined]
    assert deltas == [[1], [2]]


async def test_only_the_first_delta_is_sent_without_waiting_to_be_batched():
    # The STATUS before it goes with it; every later event may wait for the producer's linger.
    replicas = ScriptedReplicas({"r0": Script([(1,), (2,), (3,)])})
    log = MemoryLog()
    driver, _, _ = driver_for(replicas, log)
    await driver.run()
    assert log.shape()[:2] == [(1, STATUS, 0, EPOCH), (2, DELTA, 1, EPOCH)]
    assert log.at_once == [2]


class CountingWake(Wake):
    """The driver's wake-up call, counting how often it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


async def test_tokens_joining_an_open_window_do_not_wake_the_driver():
    # Ten tokens 5 ms apart inside one 60 s window: the first token wakes the driver (published at
    # once), the second opens a window (its timer would wake it, but the stream ends first), the
    # eight after it join that window and wake nobody, and the stream's end wakes it once more.
    replicas = ScriptedReplicas({"r0": Script([(t,) for t in range(1, 11)], gap_s=0.005)})
    driver, ledger, _ = driver_for(replicas, window_ms=60_000)
    driver._wake = wake = CountingWake()
    await driver.run()
    deltas = [list(e.token_ids) for e in driver.events.events if e.type == DELTA]  # type: ignore[attr-defined]
    assert deltas == [[1], list(range(2, 11))]
    assert wake.sets == 2
    assert ledger.finished().output_tokens == 10


async def test_a_window_closes_on_its_timer_while_the_replica_is_still_streaming():
    # Tokens 100 ms apart, a 250 ms window: after the first (alone), the window opened by token 2 holds
    # tokens 2-4 and is closed by its timer 50 ms before token 5 arrives (the next token would have
    # joined it had the window waited for one); tokens 5-7 then share the next, closed by the end.
    replicas = ScriptedReplicas({"r0": Script([(t,) for t in range(1, 8)], gap_s=0.1)})
    driver, _, _ = driver_for(replicas, window_ms=250)
    await driver.run()
    deltas = [list(e.token_ids) for e in driver.events.events if e.type == DELTA]  # type: ignore[attr-defined]
    assert deltas == [[1], [2, 3, 4], [5, 6, 7]]


async def test_a_run_in_a_process_that_records_no_spans_makes_none(monkeypatch: pytest.MonkeyPatch):
    # No exporter (the default): a no-op span still cost its context managers and attributes.
    def no_spans() -> None:
        raise AssertionError("a span was made while nothing records spans")

    monkeypatch.setattr(driver_module, "tracer", no_spans)
    driver, ledger, _ = driver_for(ScriptedReplicas({"r0": Script([(1,), (2, 3)])}))
    assert await driver.run() is not None
    assert ledger.finished().output_tokens == 3
    assert driver.outcome is not None and driver.outcome.output_tokens == 3


async def test_a_replica_lost_mid_stream_ends_the_run_interrupted_with_exactly_the_tokens_received():
    error = ReplicaLost("connection reset")
    replicas = ScriptedReplicas({"r0": Script([(1, 2), (3, 4)], then=error)})
    driver, ledger, lost = driver_for(replicas)
    await driver.run()
    assert [e.type for e in driver.events.events] == [STATUS, DELTA, DELTA, TERMINAL]  # type: ignore[attr-defined]
    ending = ledger.finished()
    assert ending == Ending(RunStatus.INTERRUPTED, 3, 4, DETAIL_REPLICA_LOST.format(replica="r0", tokens=4,
                                                                                  error=error), first=START)
    assert lost == ["r0"]


async def test_a_refusal_before_the_first_token_moves_the_run_to_another_replica_recorded_first():
    replicas = ScriptedReplicas({"r0": Script([], then=ReplicaRejected("busy")), "r1-addr": Script([(9,)])})
    driver, ledger, lost = driver_for(replicas, targets=[Target("r1", "r1-addr", 16)])
    await driver.run()
    assert [name for name, _ in ledger.calls] == ["reassign", "running", "start", "finish"]
    assert ledger.calls[0] == ("reassign", "r1")
    assert driver.tried == ["r0", "r1"] and lost == []        # a refusal says nothing of the replica
    assert ledger.finished() == Ending(RunStatus.COMPLETED, 2, 1, None, first=START,
                                       cached_input_tokens=0)


async def test_a_cancel_mid_stream_stops_the_replica_and_ends_cancelled_with_what_it_produced():
    replicas = ScriptedReplicas({"r0": Script([(1,)] * 50)})
    driver, ledger, _ = driver_for(replicas)
    running = asyncio.create_task(driver.run())
    await until(lambda: driver.output_tokens >= 3)
    driver.request_cancel()
    await running
    ending = ledger.finished()
    assert replicas.stops == ["r0"]
    assert (ending.status, ending.detail) == (RunStatus.CANCELLED, DETAIL_CANCELLED)
    assert 3 <= ending.output_tokens < 50
    assert ending.output_tokens == sum(len(e.token_ids) for e in driver.events.events)  # type: ignore[attr-defined]


async def test_a_hung_replica_is_abandoned_not_asked_and_the_run_ends_interrupted_with_the_tokens_received():
    replicas = ScriptedReplicas({"r0": Script([(1,), (2,), (3,)], silent_after=True)})
    driver, ledger, lost = driver_for(replicas)
    running = asyncio.create_task(driver.run())
    await until(lambda: driver.output_tokens >= 3)
    driver.replica_hung("silent 2.6s")
    await asyncio.wait_for(running, 1.0)
    ending = ledger.finished()
    assert ending == Ending(RunStatus.INTERRUPTED, 4, 3, DETAIL_REPLICA_HUNG.format(
        replica="r0", tokens=3, why="silent 2.6s"), first=START, cached_input_tokens=0)
    assert replicas.stops == [] and lost == ["r0"]


async def test_a_refused_lease_stops_the_driver_without_settling_or_publishing_more():
    replicas = ScriptedReplicas({"r0": Script([(1,)] * 50)})
    driver, ledger, _ = driver_for(replicas)
    running = asyncio.create_task(driver.run())
    await until(lambda: driver.output_tokens >= 2)
    driver.revoke_lease()
    published = len(driver.events.events)  # type: ignore[attr-defined]
    assert await running is None
    assert [name for name, _ in ledger.calls] == ["running", "start"]
    assert len(driver.events.events) == published          # type: ignore[attr-defined]


async def test_a_lease_expired_by_the_ledgers_clock_stops_the_driver():
    replicas = ScriptedReplicas({"r0": Script([(1,)] * 50)})
    driver, ledger, _ = driver_for(replicas)
    driver.lease.expires_at = time.monotonic() + 0.1       # no renewal arrives
    assert await driver.run() is None
    assert "finish" not in [name for name, _ in ledger.calls]


async def test_a_silent_stream_stops_at_the_lease_end_a_renewal_moved_with_nothing_else_to_wake_it():
    # No token, no ack, no cancel: only the driver's own timer can notice the lease ending. A renewal
    # moves the end from 0.2 s to 0.5 s after the timer for 0.2 s was armed: it must not stop at 0.2 s,
    # and it must still stop at 0.5 s (well before the 30 s first-token limit).
    replicas = ScriptedReplicas({"r0": Script([], silent_after=True)})
    driver, ledger, _ = driver_for(replicas)
    started = time.monotonic()
    driver.lease.expires_at = started + 0.2

    async def renew() -> None:
        await asyncio.sleep(0.1)
        driver.lease.expires_at = started + 0.5

    renewal = asyncio.create_task(renew())
    assert await asyncio.wait_for(driver.run(), 5.0) is None
    assert time.monotonic() - started >= 0.5
    await renewal
    assert "finish" not in [name for name, _ in ledger.calls]


# --- the pure parts ------------------------------------------------------------------------------


def so_far(attempts: int = 1, tokens: int = 0) -> RunSoFar:
    return RunSoFar(attempts=attempts, max_attempts=2, last_sequence=tokens and tokens + 1,
                    output_tokens=tokens, cached_input_tokens=0, prompt_taken=False)


def test_decide_retries_a_silent_replica_once_then_fails_the_run_with_its_prompt_charged():
    silent = Attempt("r0", 0, None, Stop(RunStatus.INTERRUPTED, "no token in 30s", no_first_token=True))
    first, second = decide(silent, so_far(1)), decide(silent, so_far(2))
    assert (first.ending, first.replica_failed, first.prompt_taken) == (None, True, True)
    assert second.ending is not None and second.ending.status is RunStatus.FAILED
    assert second.ending.prompt_taken is True


def test_decide_never_retries_once_a_token_exists():
    lost = Attempt("r0", 5, ReplicaLost("gone"), None)
    decision = decide(lost, so_far(1, tokens=5))
    assert decision.ending is not None and decision.ending.status is RunStatus.INTERRUPTED
    assert decision.ending.output_tokens == 5 and decision.replica_failed


def test_decide_does_not_charge_a_prompt_every_replica_refused():
    refused = Attempt("r1", 0, ReplicaRejected("bad input"), None)
    decision = decide(refused, so_far(2))
    assert decision.ending is not None and decision.ending.prompt_taken is False
    assert not decision.replica_failed


def test_a_silent_stream_is_hung_only_when_the_replica_also_stopped_proving_alive():
    assert hung(Silence(silent_s=3.0, step_s=0.02, alive_age_s=0.3)) is None      # slow, but alive
    assert hung(Silence(silent_s=0.5, step_s=0.02, alive_age_s=9.0)) is None      # metrics slow, tokens flow
    assert hung(Silence(silent_s=2.6, step_s=0.02, alive_age_s=2.6)) is not None
    assert hung(Silence(silent_s=2.6, step_s=0.2, alive_age_s=9.0)) is None       # < 20 of its steps
    assert hung(Silence(silent_s=9.0, step_s=None, alive_age_s=None)) is None     # unscraped: the old limit
    assert hung(Silence(silent_s=10.0, step_s=None, alive_age_s=None)) is not None


def test_readers_drop_a_fenced_off_writers_late_events():
    # The old owner (epoch 1) wrote 1..3; the reaper (epoch 2) fenced, then the zombie's 4 landed,
    # then the reaper's terminal 4: every reader accepts 1..3 and the terminal, never the zombie's 4.
    def delta(sequence: int, epoch: int) -> runs_pb2.RunEvent:
        return runs_pb2.RunEvent(run_id="r", sequence=sequence, type=DELTA, token_ids=[sequence],
                                 lease_epoch=epoch)
    log = [delta(1, 1), delta(2, 1), delta(3, 1), fence_event("r", 2, 0), delta(4, 1),
           terminal_event("r", 4, common_pb2.RUN_STATUS_INTERRUPTED, common_pb2.TokenUsage(), "", 0, 2)]
    reader = EventDeduper(after=0)
    accepted = [(e.sequence, e.type, e.lease_epoch) for e in log if reader.accept(e)]
    assert accepted == [(1, DELTA, 1), (2, DELTA, 1), (3, DELTA, 1), (4, TERMINAL, 2)]
    resumed = EventDeduper(after=2)
    assert [e.sequence for e in log if resumed.accept(e)] == [3, 4]


def test_a_stream_silent_for_less_than_the_monitors_floor_is_never_hung():
    # The monitor skips these streams without building their Silence: no step time, liveness or first
    # token may make one of them hung.
    for silent_s in (0.0, JUDGED_FROM_S / 2, JUDGED_FROM_S - 1e-9):
        for step_s in (None, 0.0, 0.001, 1.0):
            for alive_age_s in (None, 0.0, 3.0, 1e6):
                for first_token in (True, False):
                    assert hung(Silence(silent_s, step_s, alive_age_s, first_token)) is None
    assert hung(Silence(JUDGED_FROM_S, 0.001, 1e6)) is not None     # the floor itself may be


def test_the_monitor_judges_nobody_on_the_first_tick_after_its_own_process_stalled():
    # Ticks every 0.25 s may judge; a tick 3.5 s after the previous one (the process was starved, its
    # sockets unread) may not; the tick after it, once I/O has been polled, judges again.
    guard = StallGuard(started_at=100.0)
    ticks = [100.25, 100.5, 100.75, 104.25, 104.5, 104.75]
    assert [guard.may_judge(t) for t in ticks] == [True, True, True, False, True, True]
    # A tick merely late (the loop busy for a few hundred ms) still judges: STALLED_TICK_S bounds it.
    assert guard.may_judge(104.75 + STALLED_TICK_S * 0.9) is True
    assert guard.may_judge(105.0 + STALLED_TICK_S * 2) is False
