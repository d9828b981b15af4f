"""A run's replica call started while the claim that routed it commits (issue 9, TTFT).

One at a time, a claim's queue UPDATE and its COMMIT are two round trips to PostgreSQL after the
routing decision, and the replica's prefill waited behind both. The call now leaves as soon as the
run is routed, and its chunks are kept until the run's driver takes them: nothing reaches the event
log before the claim is committed (the driver exists only then), so a claim that fails leaves no
trace but a generation cancelled on its replica (the run stays ACCEPTED for the next claim).

    routed ──► EarlyCall(...)          the request leaves; chunks are kept
    COMMIT ──► RunDriver(early=...)    deliver(pump.take): the kept chunks, then each as it comes
    failed ──► cancel()                the replica stops the request (replica_client: an abandoned
                                       stream is stopped)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from sluice.services.replica_client import TokenChunk

OnChunk = Callable[[TokenChunk], None]


class EarlyCall:
    """A replica call in flight for a run whose driver does not exist yet."""

    def __init__(self, address: str, start: Callable[[OnChunk], Awaitable[None]]) -> None:
        self.address = address
        self.sent_at = time.monotonic()
        self._kept: list[TokenChunk] = []
        self._take: OnChunk | None = None
        self._task = asyncio.ensure_future(start(self._on_chunk))

    def _on_chunk(self, chunk: TokenChunk) -> None:
        if self._take is None:
            self._kept.append(chunk)
        else:
            self._take(chunk)

    async def deliver(self, take: OnChunk) -> None:
        """Hand `take` the chunks kept so far, then each as it arrives (no await in between: none is
        lost or reordered); return when the call ends, raising what it raised (or what `take` did).
        Cancelling this cancels the call."""
        kept, self._kept = self._kept, []
        try:
            for chunk in kept:
                take(chunk)
        except BaseException:
            self.cancel()
            raise
        self._take = take
        await self._task

    def cancel(self) -> None:
        """Abandon the call: the replica is told to stop in the background (replica_client)."""
        if not self._task.done():
            self._task.cancel()
        self._task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[None]) -> None:
    """Done callback of a call nobody awaits any more: its outcome is read so it is not reported."""
    if not task.cancelled():
        task.exception()
