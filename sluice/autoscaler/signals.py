"""From what the platform measures to the control law's PoolSignals. Pure: the service reads the
ledger (sluice.ledger.pool_load) and scrapes the replicas; this module only combines them.

    queue_depth   runs the ledger holds ACCEPTED + runs waiting in the serving engines' queues
    in_flight     runs QUEUED/RUNNING on serving replicas, less those still in an engine queue
                  (a draining replica's runs are not demand: they end and are not replaced)
    kv            mean KV fraction over the serving replicas that answered their scrape
    ttft          the larger of the ledger's p95 TTFT over the window and the predicted queue wait
                  (runs waiting / runs completed per second over the window): a run admitted now
                  waits that long before its first token, so TTFT headroom is spent before any
                  run that waited has reported it; the measured p95 alone lags by a queue
    arrival       runs created over the window (over the time elapsed, until a window has passed)
    slope         change of that rate against `slope_windows` ticks ago (none while the window fills:
                  a filling window would look like a traffic step)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.autoscaler.control import PoolSignals
from sluice.ledger.pool_load import PoolLoad
from sluice.router.load import LoadSnapshot


@dataclass(frozen=True, slots=True)
class Members:
    """The pool's replicas by state, as the autoscaler holds them."""

    serving: int
    warm: int
    starting: int
    draining: Sequence[str]      # names: their runs are subtracted from the demand


def predicted_wait_s(load: PoolLoad, window_s: float) -> float:
    """How long the runs waiting now take to leave the queue at the rate runs ended over the window;
    a whole window when nothing ended in it (a queue that did not move is at least that old)."""
    if load.accepted == 0:
        return 0.0
    if load.completions == 0:
        return window_s
    return load.accepted / (load.completions / window_s)


class ArrivalTrend:
    """The arrival rate tick by tick and its slope, as the simulator's host measures them."""

    def __init__(self, window_s: float, interval_s: float, slope_windows: int) -> None:
        self._window_s = window_s
        self._interval_s = interval_s
        self._rates: deque[float] = deque(maxlen=slope_windows + 1)

    def observe(self, arrivals: int, elapsed_s: float) -> tuple[float, float]:
        """(rate, slope) from the window's arrivals, `elapsed_s` after the loop started."""
        span = min(elapsed_s, self._window_s)
        rate = arrivals / span if span > 0 else 0.0
        if elapsed_s >= self._window_s:
            self._rates.append(rate)
        slope = ((rate - self._rates[0]) / ((len(self._rates) - 1) * self._interval_s)
                 if len(self._rates) > 1 else 0.0)
        return rate, slope


def pool_signals(now_s: float, load: PoolLoad, members: Members, scraped: Mapping[str, LoadSnapshot],
                 window_s: float, rate: float, slope: float) -> PoolSignals:
    engine_waiting = sum(replica.waiting for replica in scraped.values())
    draining_runs = sum(load.by_replica.get(name, 0) for name in members.draining)
    in_flight = max(load.in_flight - draining_runs - engine_waiting, 0)
    kv = sum(replica.kv_fraction for replica in scraped.values()) / len(scraped) if scraped else 0.0
    wait = predicted_wait_s(load, window_s)
    ttft = load.ttft_p95_s
    if wait > 0:
        ttft = wait if ttft is None else max(ttft, wait)
    return PoolSignals(now_s=now_s, serving=members.serving, warm=members.warm, starting=members.starting,
                       draining=len(members.draining), in_flight=in_flight,
                       queue_depth=load.accepted + engine_waiting, kv_utilization=kv, ttft_p95_s=ttft,
                       arrival_rate=rate, arrival_slope=slope)
