"""Pure core of the event log: no I/O, no clock reads (time arrives as arguments).

A run's events are numbered 1, 2, 3, ... by the one process driving the run.
`RunEventSequencer` hands out those numbers; `DeltaCoalescer` batches tokens
that arrive within one window into one DELTA event; `EventDeduper` is the
reader's filter that turns "at least once, in order" (a terminal event may be
republished by a reaper) into "exactly the events with sequence > after".

Fencing (DESIGN.md "Leases and fencing"). Every event carries the lease epoch of
the process that wrote it. A process that takes a run over from one whose lease
expired first publishes a FENCE (sequence 0, its newer epoch) and then reads the
run's durable events up to the end of the log: what the old owner wrote before
the fence counts, what it writes after the fence (a zombie's late events) is
dropped by every reader, because `EventDeduper` refuses an event whose epoch is
older than one it already saw for the run. All readers see one partition in one
order, so they all accept the same events, live or replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from sluice.v1 import common_pb2, runs_pb2

TERMINAL_STATUSES = frozenset({
    common_pb2.RUN_STATUS_COMPLETED,
    common_pb2.RUN_STATUS_CANCELLED,
    common_pb2.RUN_STATUS_INTERRUPTED,
    common_pb2.RUN_STATUS_FAILED,
    common_pb2.RUN_STATUS_EXPIRED,
})


def status_value(name: str) -> common_pb2.RunStatus:
    """Ledger status text ('RUNNING') -> RunStatus enum value."""
    return cast(common_pb2.RunStatus, common_pb2.RunStatus.Value(f"RUN_STATUS_{name}"))


def status_name(value: common_pb2.RunStatus) -> str:
    """RunStatus enum value -> ledger status text ('RUNNING')."""
    return str(common_pb2.RunStatus.Name(value)).removeprefix("RUN_STATUS_")


def delta_event(run_id: str, sequence: int, token_ids: Sequence[int], text: str,
                time_ms: int, epoch: int = 0) -> runs_pb2.RunEvent:
    return runs_pb2.RunEvent(run_id=run_id, sequence=sequence, type=runs_pb2.EVENT_TYPE_DELTA,
                             token_ids=list(token_ids), text=text, time_ms=time_ms, lease_epoch=epoch)


def status_event(run_id: str, sequence: int, status: common_pb2.RunStatus, time_ms: int,
                 epoch: int = 0) -> runs_pb2.RunEvent:
    assert status not in TERMINAL_STATUSES, "terminal statuses travel in terminal events"
    return runs_pb2.RunEvent(run_id=run_id, sequence=sequence, type=runs_pb2.EVENT_TYPE_STATUS,
                             status=status, time_ms=time_ms, lease_epoch=epoch)


def terminal_event(run_id: str, sequence: int, status: common_pb2.RunStatus, usage: common_pb2.TokenUsage,
                   detail: str, time_ms: int, epoch: int = 0) -> runs_pb2.RunEvent:
    assert status in TERMINAL_STATUSES, f"{status_name(status)} is not terminal"
    return runs_pb2.RunEvent(run_id=run_id, sequence=sequence, type=runs_pb2.EVENT_TYPE_TERMINAL,
                             status=status, usage=usage, detail=detail, time_ms=time_ms, lease_epoch=epoch)


FENCE_SEQUENCE = 0   # below every real sequence: no reader ever passes a fence on


def fence_event(run_id: str, epoch: int, time_ms: int) -> runs_pb2.RunEvent:
    """Marks where the owner of `epoch` took the run over: older epochs' events after it are refused."""
    return runs_pb2.RunEvent(run_id=run_id, sequence=FENCE_SEQUENCE, type=runs_pb2.EVENT_TYPE_STATUS,
                             time_ms=time_ms, lease_epoch=epoch)


def is_terminal(event: runs_pb2.RunEvent) -> bool:
    return event.type == runs_pb2.EVENT_TYPE_TERMINAL


class RunEventSequencer:
    """Numbers one run's events. Only the process holding the run's lease owns one."""

    __slots__ = ("run_id", "epoch", "_last")

    def __init__(self, run_id: str, last_sequence: int = 0, epoch: int = 0) -> None:
        self.run_id = run_id
        self.epoch = epoch           # the owner's lease epoch, stamped on every event
        self._last = last_sequence

    @property
    def last_sequence(self) -> int:
        return self._last

    def next_sequence(self) -> int:
        self._last += 1
        return self._last

    def status(self, status: common_pb2.RunStatus, time_ms: int) -> runs_pb2.RunEvent:
        return status_event(self.run_id, self.next_sequence(), status, time_ms, self.epoch)

    def delta(self, token_ids: Sequence[int], text: str, time_ms: int) -> runs_pb2.RunEvent:
        return delta_event(self.run_id, self.next_sequence(), token_ids, text, time_ms, self.epoch)

    def terminal(self, status: common_pb2.RunStatus, usage: common_pb2.TokenUsage, detail: str,
                 time_ms: int) -> runs_pb2.RunEvent:
        return terminal_event(self.run_id, self.next_sequence(), status, usage, detail, time_ms, self.epoch)


class DeltaCoalescer:
    """A run's tokens batched into DELTA events by time: the tokens that arrive while a window is open
    share one event. A window opens with the first token buffered and closes `window_ms` later, or
    at once when it holds `max_tokens` (0: no count limit). No token waits longer than `window_ms`.

    `aligned`: a window closes instead at the first multiple of `window_ms` on the clock after it
    opened (the callers' clock is time.monotonic(), the host's), so the windows of every run of every
    process on the host close at the same instants: their DELTAs leave in one produce request per
    window (a request per broker, per linger, whatever it carries, was most of the broker's cost per
    token), and each gateway takes them in one fetch. A token still waits at most `window_ms`; a
    run's first window after its first token is shorter, the ones after it as long (a run whose
    tokens keep coming is in step with the clock after one window).

    The trade-off (README "Cost per token"): each event costs the platform the same whatever it
    carries (a log record, an acknowledgment, a fetch and a gRPC message per reader), so a wider
    window divides that cost by the tokens it gathers, and a reader sees tokens in bursts at most
    `window_ms` apart instead of one by one. The run's first token is never held (the driver
    publishes it at once): TTFT does not pay the window.
    """

    __slots__ = ("window_ms", "max_tokens", "aligned", "_tokens", "_closes_ms")

    def __init__(self, window_ms: float, max_tokens: int = 0, *, aligned: bool = False) -> None:
        assert window_ms >= 0, "coalescing window cannot be negative"
        assert max_tokens >= 0, "a window's token limit cannot be negative"
        self.window_ms = window_ms
        self.max_tokens = max_tokens
        self.aligned = aligned and window_ms > 0
        self._tokens: list[int] = []
        self._closes_ms: float | None = None

    def add(self, token_ids: Sequence[int], now_ms: float) -> None:
        if not token_ids:
            return
        if self._closes_ms is None:
            if self.aligned:
                self._closes_ms = (now_ms // self.window_ms + 1) * self.window_ms
            else:
                self._closes_ms = now_ms + self.window_ms
        self._tokens.extend(token_ids)

    def pending(self) -> bool:
        return bool(self._tokens)

    def full(self) -> bool:
        """The window holds its token limit: it closes without waiting out its time."""
        return 0 < self.max_tokens <= len(self._tokens)

    def due(self, now_ms: float) -> bool:
        """True when the buffered tokens should be emitted now."""
        return self._closes_ms is not None and (now_ms >= self._closes_ms or self.full())

    def closes_ms(self) -> float | None:
        """When the open window closes by time (on the callers' clock); None when nothing is buffered.
        Aligned windows of every run share these instants exactly (one timer may serve them all)."""
        return self._closes_ms

    def remaining_ms(self, now_ms: float) -> float | None:
        """How long until the window closes; None when nothing is buffered."""
        if self._closes_ms is None:
            return None
        if self.full():
            return 0.0
        return max(0.0, self._closes_ms - now_ms)

    def take(self) -> list[int]:
        tokens, self._tokens, self._closes_ms = self._tokens, [], None
        return tokens


class EventDeduper:
    """Reader-side filter: pass each sequence > `after` once, in order; note the terminal.

    The log holds a run's events in sequence order (one key, one partition, an
    idempotent producer), but a terminal event may be published twice (a
    reaper republishes one whose publication was never confirmed), so a
    sequence at or below the last one passed is dropped. An event whose lease epoch
    is older than the newest seen for the run (a fence's included) is dropped too:
    it was written by a process that had lost the run (module doc, "Fencing").
    """

    __slots__ = ("_last", "finished", "gaps", "epoch")

    def __init__(self, after: int) -> None:
        self._last = after
        self.finished = False
        self.gaps = 0  # sequences skipped over; 0 unless the log lost events (it must not)
        self.epoch = 0  # the newest lease epoch seen for the run

    @property
    def last_sequence(self) -> int:
        return self._last

    def accept(self, event: runs_pb2.RunEvent) -> bool:
        if event.lease_epoch < self.epoch:
            return False       # a fenced-off writer's late event
        self.epoch = event.lease_epoch
        if self.finished:
            return False
        if is_terminal(event):
            # A terminal event ends the run whatever cursor the reader holds:
            # a reader already past it has nothing more to receive.
            self.finished = True
        if event.sequence <= self._last:
            return False
        if event.sequence > self._last + 1:
            self.gaps += event.sequence - self._last - 1
        self._last = event.sequence
        return True


def tokens_in(events: Sequence[runs_pb2.RunEvent]) -> int:
    """Output tokens carried by the DELTA events among `events`."""
    return sum(len(event.token_ids) for event in events if event.type == runs_pb2.EVENT_TYPE_DELTA)
