"""The canary guard: a small loop in each routing process that judges every active canary and rolls
a breaching one back to 0%.

    every [routing].canary_check_interval_s:
        for each active canary:  samples of both arms from the run rows (ledger/canaries.py)
                                 → traffic.canary.judge (pure)  → last_judgment on the canary row
                                 BREACH → share 0, state rolled_back, reason, audit row — one transaction

Several routing processes may run it at once: the rollback is a conditional UPDATE (only while the
canary is active), so exactly one of them ends it and writes the audit row; the others find it ended.
Admission reads the canary in its one SELECT, so the next Submit after the commit goes to the baseline.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge
from sluice.ledger import audit
from sluice.ledger.audit import Actor
from sluice.ledger.canaries import CanaryRecord, CanaryRepository
from sluice.ledger.models import CanaryState
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.traffic.canary import Judgment, Verdict, judge, summarize

log = logging.getLogger(__name__)

GUARD_ACTOR = Actor(None, "canary-guard")   # names the guard in audit rows
ROLLBACK_REASON = "guardrail breach: {reason}"


class CanaryGuard:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], interval_s: float,
                 registry: CollectorRegistry | None = None) -> None:
        self._sessions = sessions
        self.interval_s = interval_s
        registry = registry or CollectorRegistry()
        self._share = Gauge("sluice_canary_share_bp", "Share of the alias's new runs sent to its canary",
                            ["alias", "candidate"], registry=registry)
        self._rollbacks = Counter("sluice_canary_rollbacks", "Canaries this process rolled back to 0%",
                                  ["alias", "candidate"], registry=registry)

    async def serve(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("canary guard pass failed; retrying")
            try:
                await asyncio.wait_for(stopping.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def check_once(self) -> dict[str, Judgment]:
        """Judge every active canary now; the judgments by alias."""
        async with self._sessions() as session:
            active = await CanaryRepository(session).active()
        return {canary.alias: await self._judge(canary) for canary in active}

    async def _judge(self, canary: CanaryRecord) -> Judgment:
        limits = canary.guardrails
        async with self._sessions() as session, session.begin():
            canaries = CanaryRepository(session)
            since, window = canary.started_at, limits.window_s
            candidate = summarize(await canaries.samples(canary.candidate_version, since, window))
            baseline = summarize(await canaries.samples(canary.baseline_version, since, window))
            judgment = judge(candidate, baseline, limits)
            await canaries.record_judgment(canary.alias, {
                "verdict": judgment.verdict.value, "reason": judgment.reason,
                "candidate": candidate.as_json(), "baseline": baseline.as_json()})
            ended = judgment.verdict is Verdict.BREACH and await canaries.end(
                canary.alias, CanaryState.ROLLED_BACK, ROLLBACK_REASON.format(reason=judgment.reason))
            if ended:
                after = await canaries.get(canary.alias)
                await audit.record(session, GUARD_ACTOR, "canary.rollback", canary.alias, canary, after)
        labels = {"alias": canary.alias, "candidate": canary.candidate_version}
        if ended:
            log.warning("canary %s -> %s rolled back to 0%%: %s", canary.alias, canary.candidate_version,
                        judgment.reason)
            self._rollbacks.labels(**labels).inc()
        self._share.labels(**labels).set(0 if ended else canary.share_bp)
        return judgment
