"""Replica health: a circuit breaker per replica and the schedule of active checks.

Pure: the host reads its own clock and passes ``now`` (seconds), performs the
checks (the live routing service probes Triton's readiness endpoint and the
metrics endpoint), and reports each outcome here. Routing only sees the result,
``ReplicaView.healthy``.

Breaker states::

              failures >= threshold                  open_s elapsed
    CLOSED ---------------------------> OPEN ---------------------------> HALF_OPEN
      ^                                  ^                                    |
      |            success               |            failure                 |
      +----------------------------------+------------------------------------+

CLOSED routes normally. OPEN routes nothing. HALF_OPEN routes nothing either:
it waits for one probe (an active check, or a real run the host lets through
with ``allow_trial``); a success closes the breaker, a failure reopens it for
another ``open_s``. Failures are consecutive: one success resets the count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class HealthOptions:
    failure_threshold: int = 3          # consecutive failures that open the breaker
    open_s: float = 5.0                 # how long an open breaker rests before a trial
    check_interval_s: float = 2.0       # active check period of a closed (healthy) replica
    probe_interval_s: float = 1.0       # active check period of an open / half-open replica


class CircuitBreaker:
    """One replica's breaker."""

    def __init__(self, options: HealthOptions | None = None) -> None:
        self.options = options or HealthOptions()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.options.open_s:
            self._state = BreakerState.HALF_OPEN
        return self._state

    def allows_routing(self, now: float) -> bool:
        return self.state(now) is BreakerState.CLOSED

    def allow_trial(self, now: float) -> bool:
        """A half-open breaker may let one real request through as its probe."""
        return self.state(now) is BreakerState.HALF_OPEN

    def record_success(self, now: float) -> None:
        self._failures = 0
        self._state = BreakerState.CLOSED

    def record_failure(self, now: float) -> None:
        self._failures += 1
        state = self.state(now)
        if state is BreakerState.HALF_OPEN or (
                state is BreakerState.CLOSED and self._failures >= self.options.failure_threshold):
            self._state = BreakerState.OPEN
            self._opened_at = now

    @property
    def consecutive_failures(self) -> int:
        return self._failures


class HealthBook:
    """Every replica's breaker and when each is next due an active check."""

    def __init__(self, options: HealthOptions | None = None) -> None:
        self.options = options or HealthOptions()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._next_check: dict[str, float] = {}

    def track(self, replica: str, now: float) -> None:
        """Start tracking a replica (idempotent); its first check is due at once."""
        if replica not in self._breakers:
            self._breakers[replica] = CircuitBreaker(self.options)
            self._next_check[replica] = now

    def forget(self, replica: str) -> None:
        self._breakers.pop(replica, None)
        self._next_check.pop(replica, None)

    def sync(self, replicas: Iterable[str], now: float) -> None:
        """Track exactly these replicas (after a registry change)."""
        wanted = set(replicas)
        for name in list(self._breakers):
            if name not in wanted:
                self.forget(name)
        for name in sorted(wanted):
            self.track(name, now)

    def breaker(self, replica: str) -> CircuitBreaker:
        return self._breakers[replica]

    def is_healthy(self, replica: str, now: float) -> bool:
        """A tracked replica starts healthy (closed); one never tracked is not routed to."""
        breaker = self._breakers.get(replica)
        return breaker is not None and breaker.allows_routing(now)

    def record_success(self, replica: str, now: float) -> None:
        self._breakers[replica].record_success(now)
        self._schedule(replica, now)

    def record_failure(self, replica: str, now: float) -> None:
        self._breakers[replica].record_failure(now)
        self._schedule(replica, now)

    def due_checks(self, now: float) -> list[str]:
        """Replicas whose active check is due, in name order; the host checks them, then records."""
        return sorted(name for name, due in self._next_check.items() if due <= now)

    def next_due(self) -> float | None:
        """When the host should wake for the next check (None when nothing is tracked)."""
        return min(self._next_check.values(), default=None)

    def _schedule(self, replica: str, now: float) -> None:
        breaker = self._breakers[replica]
        interval = (self.options.check_interval_s if breaker.state(now) is BreakerState.CLOSED
                    else self.options.probe_interval_s)
        self._next_check[replica] = now + interval
