"""One pool's load as the ledger knows it, for the autoscaler (sluice/autoscaler/signals.py).

Everything the control loop needs from the runs table, in two statements on the database's clock.
A run belongs to the pool its routing decision recorded (runs.worker_pool), else its model's:

    accepted      runs admitted and not yet claimed by a routing worker (the pool's queue)
    in_flight     runs QUEUED on or RUNNING on a replica of the pool
    arrivals      runs created in the last `window_s`
    completions   runs that ended in the last `window_s` (the pool's measured drain rate)
    ttft_p95_s    p95 of started_at - created_at over runs whose first token came in the window
                  (the driver marks RUNNING right after the first token is durable)
    by_replica    in-flight runs per named replica (a drained replica is stopped only at 0)

The active runs come from ix_runs_status_created_at's leading status; the window's runs are found
among those created in the last LOOKBACK_WINDOWS windows, so a run that waited or streamed longer
than that before it ended is not counted among the completions (nor its TTFT): a bound on what one
tick reads, whatever the size of the runs table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.ledger.models import RunStatus, unfinished
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.types import Float, Text

LOOKBACK_WINDOWS = 10
_ACTIVE = f"('{RunStatus.QUEUED.value}', '{RunStatus.RUNNING.value}')"
_WAITING = f"'{RunStatus.ACCEPTED.value}'"

_POOL = text(f"""
SELECT count(*) FILTER (WHERE r.status = {_WAITING}) AS accepted,
       count(*) FILTER (WHERE r.status IN {_ACTIVE}) AS in_flight,
       count(*) FILTER (WHERE r.created_at > now() - make_interval(secs => :window_s)) AS arrivals,
       count(*) FILTER (WHERE r.finished_at > now() - make_interval(secs => :window_s)) AS completions,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM r.started_at - r.created_at))
           FILTER (WHERE r.started_at > now() - make_interval(secs => :window_s)) AS ttft_p95_s
FROM runs r JOIN models m ON m.version = r.model_version
WHERE coalesce(r.worker_pool, m.worker_pool) = :pool
  AND (r.status IN ({_WAITING}, '{RunStatus.QUEUED.value}', '{RunStatus.RUNNING.value}')
       OR r.created_at > now() - make_interval(secs => :lookback_s))
""").bindparams(bindparam("window_s", type_=Float), bindparam("lookback_s", type_=Float),
                bindparam("pool", type_=Text))

_BY_REPLICA = text(f"""
SELECT r.replica, count(*) AS runs FROM runs r
WHERE r.status IN {_ACTIVE} AND {unfinished("r.")} AND r.replica = ANY(:names)
GROUP BY r.replica
""").bindparams(bindparam("names", type_=ARRAY(Text)))


@dataclass(frozen=True, slots=True)
class PoolLoad:
    accepted: int                    # admitted, not yet claimed
    in_flight: int                   # QUEUED or RUNNING
    arrivals: int                    # created in the window
    completions: int                 # ended in the window
    ttft_p95_s: float | None         # None: no first token in the window
    by_replica: Mapping[str, int]    # in-flight runs of each replica asked about (0 when none)


async def read_pool_load(session: AsyncSession, pool: str, window_s: float,
                         replicas: Sequence[str] = ()) -> PoolLoad:
    row = (await session.execute(_POOL, {"pool": pool, "window_s": window_s,
                                         "lookback_s": window_s * LOOKBACK_WINDOWS})).one()
    counts = {name: 0 for name in replicas}
    if replicas:
        for name, runs in (await session.execute(_BY_REPLICA, {"names": list(replicas)})).all():
            counts[name] = int(runs)
    return PoolLoad(accepted=int(row.accepted), in_flight=int(row.in_flight), arrivals=int(row.arrivals),
                    completions=int(row.completions),
                    ttft_p95_s=None if row.ttft_p95_s is None else float(row.ttft_p95_s),
                    by_replica=counts)
