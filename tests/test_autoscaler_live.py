"""The live autoscaler on real local replicas (LocalProcessProvider starting `sluice.replica.serve`),
a real routing worker following the durable registry, runs submitted through Admission. Timings are
shortened (0.5 s ticks, 5 s windows, seconds of cool-down) and the replicas are the simple engine at
50 ms a token, so how long a run lasts is its output cap x 50 ms.

One scenario, seed 000's in miniature: a pool at its floor (1 serving + 1 warm) takes a step of 7
runs; the warm replica is promoted first and a cold one started for the third slot (max 3, so the
warm pool is not refilled); the cold one is promoted only after the scale-out cool-down. Then each
serving replica takes one long run, the step's runs end (the test cancels them: a slow cold start on
a busy box then cannot outlast them), and the pool drains one replica WHILE it
streams its run: the run completes with every token, and only then does the replica leave the
draining state. Fewer runs then want the floor, so one more replica drains a scale-in cool-down
later; of the two drained, one refills the warm pool and the other stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sluice.ledger.models import RunStatus
from sluice.services.routing.registry_sync import follow_durable_registry
from sluice.services.routing.worker import RoutingWorker
from sluice_client.sdk import SluiceClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.autoscaler.control import ScalerConfig
from sluice.autoscaler.local import LocalProcessProvider
from sluice.autoscaler.service import LoopSettings, PoolAutoscaler
from sluice.router.registry import DRAINING, SERVING, WARM
from tests.support.chaos import full_only
from tests.support.routing_stack import MODEL, Stack, open_stack

pytestmark = pytest.mark.integration

TOKEN_DELAY_MS = 50
REPLICA = {"engine": "simple", "token_delay_ms": TOKEN_DELAY_MS}
SCALER = ScalerConfig(
    runs_per_replica=4, min_replicas=1, max_replicas=3, warm_pool=1,
    target_utilization=0.75,          # grow past 3 runs a serving replica
    scale_in_utilization=0.5,         # shrink while still under 2 runs a replica with one fewer
    ttft_slo_s=60.0,                  # out of the way: this test drives the pool by its runs
    cold_start_s=6.0, scale_out_cooldown_s=5.0, scale_in_cooldown_s=4.0)
LOOP = LoopSettings(interval_s=0.5, window_s=5.0, slope_windows=3, drain_settle_s=1.0)
STEP_RUNS, STEP_TOKENS = 7, 2000      # 7 runs wanted at 3 a replica: 3 replicas. 100 s long: they last
                                      #   until the test cancels them, however slow a cold start is here
LONG_TOKENS = 600                     # 30 s: outlasts the window after which their arrival stops counting
WAIT_S = 90.0
TERMINAL = {RunStatus.COMPLETED.value, RunStatus.INTERRUPTED.value, RunStatus.FAILED.value,
            RunStatus.CANCELLED.value, RunStatus.EXPIRED.value}
TRACE: list[Callable[[], str]] = [lambda: ""]


@dataclass(slots=True)
class Scaled:
    stack: Stack
    autoscaler: PoolAutoscaler
    provider: LocalProcessProvider
    worker: RoutingWorker


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:.0f} s{TRACE[0]()}")
        await asyncio.sleep(0.05)


def states(scaled: Scaled) -> dict[str, str]:
    return {name: member.state for name, member in scaled.autoscaler.members.items()}


def named(scaled: Scaled, state: str) -> list[str]:
    return sorted(name for name, s in states(scaled).items() if s == state)


def actions(scaled: Scaled, kind: str) -> list[tuple[float, str]]:
    return [(at, name) for at, action, name in scaled.autoscaler.actions if action == kind]


def routable(scaled: Scaled) -> set[str]:
    """What the routing worker would route a new run to now."""
    return {view.name for view in scaled.worker.registry.views(MODEL.version, time.time())}


@asynccontextmanager
async def open_scaled(database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], tmp_path: Path,
                      scaler: ScalerConfig, loop_settings: LoopSettings) -> AsyncIterator[Scaled]:
    async with open_stack(database_dsn, sessionmaker, [], tmp_path) as stack:
        worker = await stack.start_worker()
        sync = await follow_durable_registry(worker.registry, sessionmaker, database_dsn,
                                             worker.replicas_changed)
        provider = LocalProcessProvider(stack.config, REPLICA, tmp_path, start_timeout_s=60.0,
                                        stop_grace_s=5.0)
        autoscaler = PoolAutoscaler(MODEL.version, scaler, provider, sessionmaker, loop_settings)
        stopping = asyncio.Event()
        loop = asyncio.create_task(autoscaler.run(stopping))
        try:
            yield Scaled(stack, autoscaler, provider, worker)
        finally:
            stopping.set()
            await loop
            await autoscaler.close(drain_timeout_s=5.0)
            await provider.close()
            await sync.close()


@pytest.fixture
async def scaled(database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession],
                 tmp_path: Path) -> AsyncIterator[Scaled]:
    async with open_scaled(database_dsn, sessionmaker, tmp_path, SCALER, LOOP) as opened:
        yield opened


async def test_scales_out_on_a_step_warm_first_and_back_in_by_draining_without_interrupting(scaled: Scaled):
    stack, autoscaler = scaled.stack, scaled.autoscaler
    TRACE[0] = lambda: "\n" + "\n".join(map(str, autoscaler.actions)) + "\n" + "\n".join(
        f"{t.at:.1f} {t.decision.reason} {t.signals}" for t in list(autoscaler.history)[-12:])
    # The floor: the first replica ready serves (min 1), the second waits warm (warm pool 1).
    # (a member's state is set before its row is written, its action recorded after: wait for both)
    await until(lambda: len(named(scaled, SERVING)) == 1 and len(named(scaled, WARM)) == 1
                and len([a for _, a, _ in autoscaler.actions if a.startswith("ready")]) == 2, "at the floor")
    first, warm = named(scaled, SERVING)[0], named(scaled, WARM)[0]
    assert len(actions(scaled, "ready serving")) == 1     # two starts ready together fill the floor once
    await until(lambda: routable(scaled) == {first}, "the warm replica registered but not routed")

    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        step = [(await sdk.submit(f"step {i}", max_output_tokens=STEP_TOKENS)).run_id
                for i in range(STEP_RUNS)]
        # The warm replica serves within a tick or two; the cold one is started for the third slot.
        await until(lambda: warm in named(scaled, SERVING), "the warm replica promoted", timeout_s=10.0)
        promoted_at = actions(scaled, "promote")[0][0]
        await until(lambda: len(named(scaled, SERVING)) == 3, "the cold start promoted")
        (cold,) = set(named(scaled, SERVING)) - {first, warm}
        ready_at = next(at for at, name in actions(scaled, "ready warm") if name == cold)
        second_promotion = next(at for at, name in actions(scaled, "promote") if name == cold)
        await until(lambda: routable(scaled) == {first, warm, cold}, "all three routed")

        # One long run each (round robin over the three serving replicas).
        long = [(await sdk.submit(f"long {i}", max_output_tokens=LONG_TOKENS)).run_id for i in range(3)]
        for run_id in long:
            await stack.wait_for_status(run_id, {RunStatus.RUNNING.value}, timeout_s=30.0)
        on = {(await stack.run_row(run_id)).replica: run_id for run_id in long}
        assert set(on) == {first, warm, cold}

        # The step ends (its runs cancelled); 3 runs in flight want 2 replicas: one drains while it streams.
        for run_id in step:
            await sdk.cancel(run_id)
        await until(lambda: bool(actions(scaled, "drain")), "a replica drained")
        drained_at, drained = actions(scaled, "drain")[0]
        its_run = on[drained]
        assert (await stack.run_row(its_run)).status == RunStatus.RUNNING.value   # drained mid-run
        assert states(scaled)[drained] == DRAINING, TRACE[0]()
        await until(lambda: drained not in routable(scaled), "the drain applied by routing",
                    timeout_s=LOOP.drain_settle_s)
        # Until its run has ended it stays draining, alive, routed nothing; the run completes in full.
        while (row := await stack.run_row(its_run)).status not in TERMINAL:
            assert states(scaled).get(drained) == DRAINING and drained not in routable(scaled)
            assert drained in {handle.name for handle in scaled.provider.list(MODEL.version)}
            await asyncio.sleep(0.05)
        assert row.status == RunStatus.COMPLETED.value and row.output_tokens == LONG_TOKENS

        # With the step over, 2 (then 0) runs want the floor: one more replica drains a scale-in
        # cool-down later. Of the two drained, one refills the warm pool and the other stops.
        await until(lambda: len(named(scaled, SERVING)) == 1 and not named(scaled, DRAINING)
                    and len(actions(scaled, "drained, stop")) == 1, "back at the floor")
        assert len(named(scaled, WARM)) == 1 and len(actions(scaled, "drained to warm")) == 1
        stopped = actions(scaled, "drained, stop")[0][1]
        await until(lambda: stopped not in {h.name for h in scaled.provider.list(MODEL.version)},
                    "the stopped replica's process gone", timeout_s=15.0)

    for run_id in step:
        assert (await stack.run_row(run_id)).status == RunStatus.CANCELLED.value
    for run_id in long:
        row = await stack.run_row(run_id)
        assert row.status == RunStatus.COMPLETED.value and row.output_tokens == LONG_TOKENS, row.detail

    ticks = list(autoscaler.history)
    # max: never more than 3 replicas held (serving + warm + starting + draining);
    # min: never under 1 serving once up
    assert max(t.signals.serving + t.signals.warm + t.signals.starting + t.signals.draining
               for t in ticks) == SCALER.max_replicas
    assert min(t.signals.serving for t in ticks if t.at > promoted_at) >= SCALER.min_replicas
    # warm first: promoted before the cold start was even ready; the cold one waited out the cool-down
    assert promoted_at < ready_at
    assert second_promotion - promoted_at >= SCALER.scale_out_cooldown_s
    assert any(t.decision.reason == "scale-out cool-down" for t in ticks)
    drains = [at for at, _ in actions(scaled, "drain")]
    assert drains[0] == drained_at and len(drains) == 2
    assert drains[1] - drains[0] >= SCALER.scale_in_cooldown_s


# Drain cancelled by a surge: no warm pool, so without the cancel the surge would start a cold replica
# (max 3 leaves room for one beside 1 serving + 1 draining). A 2 s window and a token cold_start_s keep
# the leading indicator near the runs present (slope x cold start ~ 0). 3.6 runs a replica (4 x 0.9):
# the step's 4 runs want 2 serving, 4 + 2 long ones still 2 (a margin for the leading indicator, which
# reads a little above the runs present while they arrive), the 2 long ones alone 1 (under 2 a replica
# with one fewer), and the surge's 4 beside the remaining long one 2 again.
SURGE_SCALER = dataclasses.replace(SCALER, warm_pool=0, target_utilization=0.9, cold_start_s=0.1,
                                   scale_out_cooldown_s=2.0, scale_in_cooldown_s=2.0)
SURGE_LOOP = dataclasses.replace(LOOP, window_s=2.0)
FIRST_STEP, SURGE = 4, 4


@full_only       # make chaos; its decision is pinned without processes in test_autoscaler.py
async def test_a_surge_during_a_drain_returns_the_draining_replica_to_serving_and_starts_nothing(
        database_dsn: str, sessionmaker: async_sessionmaker[AsyncSession], tmp_path: Path):
    async with open_scaled(database_dsn, sessionmaker, tmp_path, SURGE_SCALER, SURGE_LOOP) as scaled:
        stack, autoscaler = scaled.stack, scaled.autoscaler
        TRACE[0] = lambda: "\n" + "\n".join(map(str, autoscaler.actions)) + "\n" + "\n".join(
            f"{t.at:.1f} {t.decision.reason} {t.signals}" for t in list(autoscaler.history)[-12:])
        await until(lambda: len(named(scaled, SERVING)) == 1, "at the floor")
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            step = [(await sdk.submit(f"step {i}", max_output_tokens=STEP_TOKENS)).run_id
                    for i in range(FIRST_STEP)]
            await until(lambda: len(named(scaled, SERVING)) == 2, "a second replica started and promoted")
            both = set(named(scaled, SERVING))
            await until(lambda: routable(scaled) == both, "both routed")
            long = [(await sdk.submit(f"long {i}", max_output_tokens=LONG_TOKENS)).run_id for i in range(2)]
            for run_id in long:
                await stack.wait_for_status(run_id, {RunStatus.RUNNING.value}, timeout_s=30.0)
            on = {(await stack.run_row(run_id)).replica: run_id for run_id in long}
            assert set(on) == both
            for run_id in step:
                await sdk.cancel(run_id)
            # 2 runs on 2 replicas: under half of what one fewer holds, so one drains while it streams
            await until(lambda: bool(actions(scaled, "drain")), "a replica drained")
            drained_at, drained = actions(scaled, "drain")[0]
            assert states(scaled)[drained] == DRAINING
            starts = len([a for a in autoscaler.actions if a[1].startswith("ready")])
            assert starts == 2

            surge = [(await sdk.submit(f"surge {i}", max_output_tokens=STEP_TOKENS)).run_id
                     for i in range(SURGE)]
            await until(lambda: bool(actions(scaled, "undrain")), "the drain cancelled", timeout_s=30.0)
            undrained_at, undrained = actions(scaled, "undrain")[0]
            assert undrained == drained and states(scaled)[drained] == SERVING
            await until(lambda: drained in routable(scaled), "routed again")
            # nothing started, stopped or promoted for the surge: the same two processes serve it
            after = [t for t in autoscaler.history if t.at >= drained_at]
            assert all(t.decision.start == 0 and t.signals.starting == 0 for t in after), TRACE[0]()
            assert len([a for a in autoscaler.actions if a[1].startswith("ready")]) == starts
            assert {h.name for h in scaled.provider.list(MODEL.version)} == both
            assert not actions(scaled, "drained, stop") and len(actions(scaled, "promote")) == 1
            # the run it held while draining went on streaming and completes in full
            row = await stack.wait_for_status(on[drained], TERMINAL, timeout_s=60.0)
            assert row.status == RunStatus.COMPLETED.value and row.output_tokens == LONG_TOKENS
            for run_id in surge:
                await sdk.cancel(run_id)
