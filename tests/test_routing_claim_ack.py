"""A claim whose COMMIT acknowledgment is lost (issue 10, the orphan claim): PostgreSQL committed
ACCEPTED -> QUEUED with a lease to this worker, but the worker saw its connection drop instead of
the answer. The worker asks the ledger which of those runs it holds under the epochs it was granted
and drives them: none is left to lapse and be reaped INTERRUPTED without ever having started.

The lost acknowledgment is real: the worker's pool reaches PostgreSQL through a proxy that lets the
claim's COMMIT through and drops the connection before the answer (tests/support/tcp_proxy.py); its
lease keeper and listeners connect directly.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import pytest
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import Run, UsageEntry
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice_client.sdk import SluiceClient
from sqlalchemy import func, select

from sluice.v1 import common_pb2
from tests.support.routing_stack import Stack, collect, deltas_tokens
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

RUNS = 4
TOKENS = 30
# The claim's statement: ACCEPTED -> QUEUED stamps queued_at with the ledger's clock (claims_sql._QUEUE).
CLAIM = re.compile(r"\bSET\s+status\s*=\s*'QUEUED',\s*queued_at\s*=", re.IGNORECASE)


async def test_runs_of_a_claim_whose_commit_acknowledgment_was_lost_are_driven_to_completion(
        stack: Stack, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="sluice.services.routing.worker")
    proxy, proxied = await TcpProxy.before_database(stack.config.database.url)
    engine = make_engine(proxied)
    worker = RoutingWorker(WorkerSettings.from_config(stack.config, new_owner_id("lost-ack")),
                           make_sessionmaker(engine), stack.events, policy_from_config(stack.config),
                           registry_from_config(stack.config), dsn=stack.config.database.url)
    proxy.lose_commit_ack(lambda sql: CLAIM.search(sql) is not None)
    serving = asyncio.create_task(worker.serve(drain_s=0.5))
    try:
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            runs = await asyncio.gather(*[sdk.submit(f"Name a canal #{i}", max_output_tokens=TOKENS)
                                          for i in range(RUNS)])
            streams = await asyncio.gather(*[collect(sdk.stream(run.run_id), timeout_s=60) for run in runs])
    finally:
        worker.stop()
        await serving
        await engine.dispose()
        await proxy.close()
    assert proxy.lost_acks == 1                               # one claim's answer never arrived ...
    endings = [(common_pb2.RunStatus.Name(events[-1].status), events[-1].detail) for events in streams]
    assert endings == [("RUN_STATUS_COMPLETED", "")] * RUNS  # ... yet every run ran, none was reaped
    assert any("after its COMMIT landed" in record.getMessage() for record in caplog.records)
    assert [deltas_tokens(events) for events in streams] == [TOKENS] * RUNS
    ids = [uuid.UUID(run.run_id) for run in runs]
    async with stack.sessionmaker() as session:
        epochs = (await session.scalars(select(Run.lease_epoch).where(Run.id.in_(ids)))).all()
        settled = await session.scalar(select(func.count()).select_from(UsageEntry)
                                       .where(UsageEntry.run_id.in_(ids)))
    assert sorted(epochs) == [1] * RUNS                       # claimed once each, never taken over
    assert settled == RUNS
