"""PoolAutoscaler's count of its replicas while a cold start becomes a member (sluice/autoscaler/
service.py). A started replica is written to the registry before the start is over: a tick in
between counted it twice, as a member and as a start (4 replicas held of a maximum of 3, seen in
test_autoscaler_live under load). No database: the registry write is held open by the test."""

from __future__ import annotations

import asyncio
from typing import Any

from sluice.ledger.pool_load import PoolLoad

from sluice.autoscaler.control import ScaleDecision, ScalerConfig
from sluice.autoscaler.provider import ProviderError, ReplicaHandle
from sluice.autoscaler.service import Member, PoolAutoscaler
from sluice.router.registry import SERVING

POOL = "m1"
CONFIG = ScalerConfig(runs_per_replica=4, min_replicas=1, max_replicas=3, warm_pool=1)


class Provider:
    """Starts replicas at once (or fails to, when told); nothing runs."""

    outlives_autoscaler = False

    def __init__(self) -> None:
        self.started: list[str] = []
        self.failing = False

    async def refresh(self, pool: str) -> None:
        return None

    async def adopt(self, pool: str) -> list[ReplicaHandle]:
        return []

    async def start(self, pool: str) -> ReplicaHandle:
        await asyncio.sleep(0)
        if self.failing:
            raise ProviderError("no GPU")
        name = f"r{len(self.started)}"
        self.started.append(name)
        return ReplicaHandle(name, pool, "127.0.0.1:1", "http://127.0.0.1:2/metrics", 16, 100)

    async def stop(self, name: str) -> None:
        return None

    def list(self, pool: str) -> list[ReplicaHandle]:
        return []


class HeldWrites(PoolAutoscaler):
    """Registry writes wait for `opened`: the moment between a member's creation and its row."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened = asyncio.Event()
        self.writing = 0

    async def _write(self, member: Member, state: str, removed: bool = False) -> None:
        self.writing += 1
        await self.opened.wait()
        member.state = state


def starts(n: int) -> ScaleDecision:
    return ScaleDecision(undrain=0, promote=0, start=n, drain=0, retire_warm=0, serving_target=n,
                         demand_runs=float(n), reason="test")


IDLE = PoolLoad(accepted=0, in_flight=0, arrivals=0, completions=0, ttft_p95_s=None, by_replica={})


def held(counts: Any) -> int:
    return counts.serving + counts.warm + counts.starting + len(counts.draining)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_started_replica_whose_row_is_being_written_is_counted_once():
    provider = Provider()
    scaler = HeldWrites(POOL, CONFIG, provider, None)  # type: ignore[arg-type]
    await scaler._act(starts(2), IDLE, 0.0)
    assert held(scaler._counts()) == 2         # two starts, nothing ready yet
    await settle()
    # Both replicas are up and members; their rows are being written (the starts are not over).
    assert len(provider.started) == 2 and scaler.writing == 2 and len(scaler._starting) == 2
    counts = scaler._counts()
    assert (counts.serving, counts.warm, counts.starting) == (1, 1, 0)
    assert held(counts) == 2
    scaler.opened.set()
    await asyncio.gather(*scaler._starting)
    counts = scaler._counts()
    assert (counts.serving, counts.warm, counts.starting, held(counts)) == (1, 1, 0, 2)
    assert scaler.members["r0"].state == SERVING


async def test_a_failed_start_stops_counting_as_starting():
    provider = Provider()
    provider.failing = True
    scaler = HeldWrites(POOL, CONFIG, provider, None)  # type: ignore[arg-type]
    await scaler._act(starts(1), IDLE, 0.0)
    assert scaler._counts().starting == 1
    await asyncio.gather(*scaler._starting)
    assert held(scaler._counts()) == 0 and provider.started == []
