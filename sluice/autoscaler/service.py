"""The live autoscaler: one pool's control loop over real replicas (sluice.autoscaler.control decides).

Every `interval_s`:

    measure   the ledger (ledger/pool_load.py: runs waiting, in flight, arriving, ending, p95 TTFT)
              and the serving replicas' metrics (KV use, engine queues) -> PoolSignals (signals.py)
    decide    Autoscaler.decide: promote / start / drain / retire_warm
    act       through the replica registry (the `replicas` table every routing process follows,
              state serving | warm | draining) and the Provider (start, stop)

A replica moves through these states; only `serving` is routed new runs (sluice.router.registry)::

    start() ── cold start ──> warm ── promote ──> serving ── drain ──> draining ──(no runs)──> warm | stopped
                  (a started replica serves at once          ^── undrain (a surge) ──┘
                   while the pool is under min_replicas)

Scale-in never interrupts a run: a draining replica keeps streaming the runs it holds; it is
stopped (or returned to the warm pool) only once the ledger shows no run QUEUED or RUNNING on it,
and only `drain_settle_s` after the mark, by when every routing process has applied it (a claim
that chose it just before could otherwise still commit a run onto it after the count was read).
A surge while a replica drains returns it to serving before anything is promoted or started.
The autoscaler owns the replicas it started (`<pool>-as-<suffix>`); at start it adopts those its
provider runs but did not start (Kubernetes pods a predecessor held: they keep the state of their
registry row) and tombstones rows of that form that its provider does not run (a crashed
predecessor's local processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.autoscaler.control import Autoscaler, PoolSignals, ScaleDecision, ScalerConfig
from sluice.autoscaler.provider import OWNED_INFIX, Provider, ProviderError, ReplicaHandle
from sluice.autoscaler.signals import ArrivalTrend, Members, pool_signals
from sluice.ledger.pool_load import PoolLoad, read_pool_load
from sluice.ledger.replicas import ReplicaRepository
from sluice.router.load import LoadSnapshot, parse_metrics
from sluice.router.registry import DRAINING, SERVING, WARM, ReplicaSpec

log = logging.getLogger("sluice.autoscaler")

SCRAPE_TIMEOUT_S = 1.0
HISTORY = 1024                     # ticks kept for inspection (tests, logs)


@dataclass(frozen=True, slots=True)
class LoopSettings:
    interval_s: float = 5.0        # between ticks
    window_s: float = 30.0         # rates and p95 TTFT over this window
    slope_windows: int = 3
    drain_settle_s: float = 2.0    # a drain mark is trusted this long after it is written


@dataclass(slots=True)
class Member:
    handle: ReplicaHandle
    state: str                     # WARM | SERVING | DRAINING
    since: float                   # clock time of the last state change


@dataclass(frozen=True, slots=True)
class Tick:
    """One pass of the loop, kept for inspection."""

    at: float
    signals: PoolSignals
    decision: ScaleDecision


class PoolAutoscaler:
    def __init__(self, pool: str, scaler: ScalerConfig, provider: Provider,
                 sessions: async_sessionmaker[AsyncSession], loop: LoopSettings = LoopSettings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.scaler = Autoscaler(scaler)
        self.provider = provider
        self.sessions = sessions
        self.loop = loop
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.history: deque[Tick] = deque(maxlen=HISTORY)
        self.actions: list[tuple[float, str, str]] = []     # (time, action, replica): what it did
        self._starting: set[asyncio.Task[None]] = set()
        self._unready = 0            # cold starts not yet members: counted as starting (see _cold_start)
        self._stopping: set[asyncio.Task[None]] = set()
        self._trend = ArrivalTrend(loop.window_s, loop.interval_s, loop.slope_windows)
        self._started_at = clock()
        self._http: aiohttp.ClientSession | None = None

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        await self.provider.refresh(self.pool)
        await self.adopt()
        await self.forget_predecessors()
        while not stopping.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler %s: tick failed; retrying", self.pool)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.loop.interval_s)

    async def tick(self) -> ScaleDecision:
        now = self.clock()
        await self.provider.refresh(self.pool)
        await self._forget_dead()
        await self.adopt()
        async with self.sessions() as session:
            load = await read_pool_load(session, self.pool, self.loop.window_s, list(self.members))
        scraped = await self._scrape([m.handle for m in self.members.values() if m.state == SERVING])
        rate, slope = self._trend.observe(load.arrivals, now - self._started_at)
        signals = pool_signals(now, load, self._counts(), scraped, self.loop.window_s, rate, slope)
        decision = self.scaler.decide(signals)
        self.history.append(Tick(now, signals, decision))
        if decision.acts:
            log.info("autoscaler %s: %s (demand %.1f runs, serving %d, warm %d, starting %d): "
                     "undrain %d, promote %d, start %d, drain %d, retire %d", self.pool, decision.reason,
                     decision.demand_runs, signals.serving, signals.warm, signals.starting,
                     decision.undrain, decision.promote, decision.start, decision.drain, decision.retire_warm)
        await self._act(decision, load, now)
        await self._finish_drains(load, now)
        return decision

    def _counts(self) -> Members:
        states = [member.state for member in self.members.values()]
        return Members(serving=states.count(SERVING), warm=states.count(WARM), starting=self._unready,
                       draining=[name for name, m in self.members.items() if m.state == DRAINING])

    async def _act(self, decision: ScaleDecision, load: PoolLoad, now: float) -> None:
        # A surge cancels drains first, the busiest first: they hold the most runs, so would stay longest.
        draining = sorted((m for m in self.members.values() if m.state == DRAINING),
                          key=lambda m: (-load.by_replica.get(m.handle.name, 0), m.handle.name))
        for member in draining[:decision.undrain]:
            await self._set_state(member, SERVING, now, "undrain")
        warm = sorted((m for m in self.members.values() if m.state == WARM), key=lambda m: m.since)
        for member in warm[:decision.promote]:
            await self._set_state(member, SERVING, now, "promote")
        for member in warm[decision.promote:decision.promote + decision.retire_warm]:
            await self._retire(member, now, "retire")
        for _ in range(decision.start):
            self._unready += 1
            self._spawn(self._starting, self._cold_start())
        # Drain the least busy first: they empty soonest.
        serving = sorted((m for m in self.members.values() if m.state == SERVING),
                         key=lambda m: (load.by_replica.get(m.handle.name, 0), m.handle.name))
        for member in serving[:decision.drain]:
            await self._set_state(member, DRAINING, now, "drain")

    async def _finish_drains(self, load: PoolLoad, now: float) -> None:
        """A draining replica whose runs all ended goes back to the warm pool if it is short, else stops."""
        for member in [m for m in self.members.values() if m.state == DRAINING]:
            if now - member.since < self.loop.drain_settle_s or load.by_replica.get(member.handle.name, 0):
                continue
            warm = sum(1 for m in self.members.values() if m.state == WARM)
            if warm < self.scaler.config.warm_pool:
                await self._set_state(member, WARM, now, "drained to warm")
            else:
                await self._retire(member, now, "drained, stop")

    # --- replica lifecycle ---------------------------------------------------------------------

    async def _cold_start(self) -> None:
        try:
            handle = await self.provider.start(self.pool)
        except ProviderError as exc:
            log.error("autoscaler %s: cold start failed: %s", self.pool, exc)
            return
        finally:
            # Ready (a member from the next line on, counted by its state) or failed: no longer starting.
            # Not when the task ends: while its registry row is written a tick counted it twice (a
            # member and a start: 4 replicas held of a maximum of 3, seen under load).
            self._unready -= 1
        now = self.clock()
        serving = sum(1 for m in self.members.values() if m.state == SERVING)
        # The pool's floor is not a scaling decision: below min_replicas a ready replica serves at once.
        # Counted and held before the first await: two starts that finish together fill it once.
        state = SERVING if serving < self.scaler.config.min_replicas else WARM
        member = self.members[handle.name] = Member(handle, state, now)
        try:
            await self._write(member, state)
        except BaseException:
            del self.members[handle.name]
            await self.provider.stop(handle.name)      # never a process the registry does not know
            raise
        self.actions.append((now, "ready " + state, handle.name))
        log.info("autoscaler %s: replica %s ready (%s)", self.pool, handle.name, state)

    async def _set_state(self, member: Member, state: str, now: float, action: str) -> None:
        await self._write(member, state)
        member.state, member.since = state, now
        self.actions.append((now, action, member.handle.name))

    async def _retire(self, member: Member, now: float, action: str) -> None:
        """Out of the registry first (routing forgets it), then the process is stopped."""
        name = member.handle.name
        await self._write(member, member.state, removed=True)
        del self.members[name]
        self.actions.append((now, action, name))
        self._spawn(self._stopping, self.provider.stop(name))

    async def _write(self, member: Member, state: str, removed: bool = False) -> None:
        handle = member.handle
        spec = ReplicaSpec(name=handle.name, pool=handle.pool, grpc_address=handle.grpc_address,
                           metrics_url=handle.metrics_url, block_size=handle.block_size,
                           kv_capacity_blocks=handle.kv_capacity_blocks, state=state)
        async with self.sessions() as session, session.begin():
            await ReplicaRepository(session).put(spec, removed=removed)
        member.state = state

    def _spawn(self, tasks: set[asyncio.Task[None]], work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _forget_dead(self) -> None:
        """A replica whose process ended on its own leaves the registry (its runs are the driver's)."""
        alive = {handle.name for handle in self.provider.list(self.pool)}
        for name in [name for name in self.members if name not in alive]:
            log.warning("autoscaler %s: replica %s is gone; removing it", self.pool, name)
            await self._retire(self.members[name], self.clock(), "gone")

    async def adopt(self) -> None:
        """Replicas the provider runs but did not start join the pool: in the state of their live
        registry row (a predecessor's), else warm (serving while the pool is under min_replicas)."""
        handles = await self.provider.adopt(self.pool)
        if not handles:
            return
        async with self.sessions() as session:
            rows = {row.name: row for row in await ReplicaRepository(session).all() if not row.removed}
        now = self.clock()
        for handle in handles:
            row = rows.get(handle.name)
            serving = sum(1 for m in self.members.values() if m.state == SERVING)
            state = (row.state if row is not None and row.pool == self.pool
                     else SERVING if serving < self.scaler.config.min_replicas else WARM)
            member = self.members[handle.name] = Member(handle, state, now)
            await self._write(member, state)
            self.actions.append((now, "adopt " + state, handle.name))
            log.info("autoscaler %s: adopted replica %s (%s)", self.pool, handle.name, state)

    async def forget_predecessors(self) -> None:
        """Tombstone this pool's autoscaled rows that no process of this provider serves."""
        ours = {handle.name for handle in self.provider.list(self.pool)}
        async with self.sessions() as session, session.begin():
            replicas = ReplicaRepository(session)
            for row in await replicas.all():
                owned = row.name.startswith(self.pool + OWNED_INFIX)
                if row.pool == self.pool and owned and not row.removed and row.name not in ours:
                    await replicas.put(row, removed=True)
                    log.info("autoscaler %s: removed %s, left by a previous autoscaler", self.pool, row.name)

    # --- measuring ----------------------------------------------------------------------------

    async def _scrape(self, handles: list[ReplicaHandle]) -> dict[str, LoadSnapshot]:
        if not handles:
            return {}
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        results = await asyncio.gather(*(self._scrape_one(self._http, h) for h in handles))
        return {handle.name: snapshot for handle, snapshot in zip(handles, results, strict=True)
                if snapshot is not None}

    @staticmethod
    async def _scrape_one(http: aiohttp.ClientSession, handle: ReplicaHandle) -> LoadSnapshot | None:
        try:
            async with http.get(handle.metrics_url) as response:
                response.raise_for_status()
                return parse_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None        # a replica that does not answer adds no KV or queue reading

    # --- shutdown -----------------------------------------------------------------------------

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Drain every replica (bounded), then stop them: a process exit interrupts no run it can wait for.
        Replicas that outlive the autoscaler (pods) are left serving as they are, for its successor."""
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        if self.provider.outlives_autoscaler:
            await asyncio.gather(*self._stopping, return_exceptions=True)
            await self._close_http()
            return
        now = self.clock()
        for member in [m for m in self.members.values() if m.state != DRAINING]:
            await self._set_state(member, DRAINING, now, "drain (exit)")
        await asyncio.sleep(self.loop.drain_settle_s)
        deadline = time.monotonic() + drain_timeout_s
        while self.members and time.monotonic() < deadline:
            async with self.sessions() as session:
                load = await read_pool_load(session, self.pool, self.loop.window_s, list(self.members))
            for member in [m for m in self.members.values() if not load.by_replica.get(m.handle.name, 0)]:
                await self._retire(member, self.clock(), "drained, stop (exit)")
            if self.members:
                await asyncio.sleep(min(self.loop.interval_s, 0.5))
        for member in list(self.members.values()):
            await self._retire(member, self.clock(), "stop (exit, drain timed out)")
        await asyncio.gather(*self._stopping, return_exceptions=True)
        await self._close_http()

    async def _close_http(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
