"""Many runs' writes of one kind in one statement (issue 9: PostgreSQL's cost per run).

A write's fixed cost in PostgreSQL (the round trip, executor start, its commit, the listeners a
NOTIFY wakes) is most of what a single-row UPDATE of `runs` costs; a row more in the same statement
costs ~50 us (bench/bench_ledger_run.py). Runs reach each step together (a replica's step gives every
run in its batch a token at once, and they end together), so the routing worker hands each kind of
write to a batcher that sends every item waiting in ONE `write(items)` call:

    submit(a) ──▶ write([a]) ─────────────┐            (nothing in flight: sent at once)
    submit(b), submit(c) while in flight ─┴▶ write([b, c])   (sent as the one in flight ends)

`linger_s` > 0 holds a first item that long for more to join (for writes nobody waits on, such as
the terminal-published mark). With linger 0 nothing waits longer than the write in flight, and an
item alone is sent at once: batching adds no latency to a lone run.

Each submitter gets its own item's result, or the error of the call that carried it (it may then
submit again: a retried write joins the next batch). `write` returns one result per item, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(slots=True)
class WriteBatcher(Generic[Item, Result]):
    """Sends items through `write` in batches, at most `max_in_flight` calls at once."""

    write: Callable[[list[Item]], Awaitable[Sequence[Result]]]
    linger_s: float = 0.0        # a first item waits this long for others (0: only while one is in flight)
    max_items: int = 256         # items per call; more waiting are sent in the next call
    max_in_flight: int = 1
    _waiting: list[tuple[Item, asyncio.Future[Result]]] = field(default_factory=list)
    _in_flight: set[asyncio.Task[None]] = field(default_factory=set)
    _timer: asyncio.TimerHandle | None = None
    _due: bool = False           # the first waiting item has lingered its time: send when a call may start

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """Queue `item`; its future resolves with its result once the call carrying it ends."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Result] = loop.create_future()
        self._waiting.append((item, done))
        if len(self._waiting) >= self.max_items or self.linger_s <= 0:
            self._send()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger_s, self._lingered)
        return done

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def flush(self) -> None:
        """Send every item waiting now (lingering or not) and wait until every call has ended."""
        while self._waiting or self._in_flight:
            self._send(force=True)
            if self._in_flight:
                await asyncio.wait(set(self._in_flight))

    def _lingered(self) -> None:
        self._timer = None
        self._due = True
        self._send()

    def _send(self, force: bool = False) -> None:
        """Start calls for the items waiting while fewer than max_in_flight are running. Items still
        lingering are left for their timer unless `force` or a full batch."""
        while self._waiting and len(self._in_flight) < self.max_in_flight:
            if not (force or self._due) and self.linger_s > 0 and len(self._waiting) < self.max_items:
                return
            batch, self._waiting = self._waiting[:self.max_items], self._waiting[self.max_items:]
            if not self._waiting:
                self._due = False
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            task = asyncio.get_running_loop().create_task(self._call(batch))
            self._in_flight.add(task)

    async def _call(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self.write([item for item, _ in batch])
            assert len(results) == len(batch), f"write returned {len(results)} results for {len(batch)} items"
        except asyncio.CancelledError:
            for _, done in batch:
                done.cancel()
            raise
        except Exception as error:
            for _, done in batch:
                if not done.done():
                    done.set_exception(error)
        else:
            for (_, done), result in zip(batch, results, strict=True):
                if not done.done():
                    done.set_result(result)
        finally:
            self._in_flight.discard(asyncio.current_task())
            with contextlib.suppress(RuntimeError):           # the loop is closing
                self._send()
