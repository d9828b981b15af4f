"""The degradation ladder: what a pool gives up, in order, as load rises (seed 003 "Traffic doubles
→ degradation ladder"; seed 000: "the gateway rejects with a retry-after rather than letting queues
grow").

    step               taken when                                 effect
    0 normal           -                                          everything admitted and dispatched
    1 defer batch      interactive runs wait to be claimed, or    batch runs stay queued (admitted,
                       the pool lacks headroom (has_headroom)     not dispatched)
    2 shed batch       interactive backlog >= shed_batch_backlog  new batch submits: UNAVAILABLE
    3 fallbacks        interactive backlog >= fallback_backlog    interactive submits that permit a
                                                                  fallback model go there
    4 shed interactive interactive backlog >= shed_backlog        every submit: UNAVAILABLE + retry-after

The thresholds are ordered (1 <= shed batch <= fallback <= shed), so as a backlog grows the steps are
taken in that order and given back in reverse: a step is never taken while an earlier one is not.

Retry-after is the time the pool needs to drain the backlog it holds now, at the rate it is
MEASURED to drain (runs claimed over a recent window) when the window saw enough claims to trust, at
the configured rate otherwise; it is clamped to [1 ms, max_retry_after_ms] so a stalled pool
(nothing drained) still answers with a finite wait.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Step(enum.IntEnum):
    NORMAL = 0
    DEFER_BATCH = 1
    SHED_BATCH = 2
    FALLBACK = 3
    SHED_INTERACTIVE = 4

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class LadderThresholds:
    """Interactive backlogs (ACCEPTED runs not yet claimed, per pool) at which each step is taken."""

    shed_batch_backlog: int
    fallback_backlog: int
    shed_backlog: int                     # [admission].max_backlog_per_pool
    configured_drain_runs_per_s: float    # [admission].pool_drain_runs_per_s
    min_drained_to_measure: int = 10      # claims a window needs before its rate is trusted
    max_retry_after_ms: int = 60_000

    def __post_init__(self) -> None:
        if not 1 <= self.shed_batch_backlog <= self.fallback_backlog <= self.shed_backlog:
            raise ValueError(
                "[traffic] thresholds must satisfy 1 <= shed_batch <= fallback <= max_backlog_per_pool "
                f"(got {self.shed_batch_backlog}, {self.fallback_backlog}, {self.shed_backlog})")
        if not self.configured_drain_runs_per_s > 0:
            raise ValueError("the configured drain rate must be positive")
        if self.min_drained_to_measure < 1 or self.max_retry_after_ms < 1:
            raise ValueError("min_drained_to_measure and max_retry_after_ms must be at least 1")

    @classmethod
    def from_fractions(cls, shed_backlog: int, shed_batch_fraction: float, fallback_fraction: float,
                       configured_drain_runs_per_s: float, min_drained_to_measure: int = 10,
                       max_retry_after_ms: int = 60_000) -> LadderThresholds:
        """Thresholds as fractions of the shedding backlog (each at least 1)."""
        return cls(shed_batch_backlog=max(1, math.ceil(shed_backlog * shed_batch_fraction)),
                   fallback_backlog=max(1, math.ceil(shed_backlog * fallback_fraction)),
                   shed_backlog=shed_backlog, configured_drain_runs_per_s=configured_drain_runs_per_s,
                   min_drained_to_measure=min_drained_to_measure, max_retry_after_ms=max_retry_after_ms)


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What the deciding side knows about one pool now."""

    interactive_backlog: int              # interactive runs ACCEPTED, not yet claimed
    headroom: bool | None = None          # priority.has_headroom; None where unknown (admission)
    drained_runs: int = 0                 # runs claimed from the pool in the last `window_s`
    window_s: float = 0.0                 # 0: no measurement


@dataclass(frozen=True, slots=True)
class Rung:
    """The ladder's decision for one pool."""

    step: Step
    retry_after_ms: int                   # what a shed submit is told (the backlog's drain time)
    drain_runs_per_s: float               # the rate retry_after_ms was derived from
    measured: bool                        # True: that rate was measured, not configured


def drain_rate(signals: PoolSignals, thresholds: LadderThresholds) -> tuple[float, bool]:
    """(runs/s, measured?): the measured rate when the window saw enough claims, else the configured."""
    if signals.window_s > 0 and signals.drained_runs >= thresholds.min_drained_to_measure:
        return signals.drained_runs / signals.window_s, True
    return thresholds.configured_drain_runs_per_s, False


def retry_after_ms(backlog: int, rate_runs_per_s: float, cap_ms: int) -> int:
    """ceil(backlog / rate) in ms, within [1, cap_ms]."""
    return min(cap_ms, max(1, math.ceil(backlog * 1000 / rate_runs_per_s)))


def climb(signals: PoolSignals, thresholds: LadderThresholds) -> Rung:
    """The highest step the pool's signals call for (steps below it are in force too)."""
    backlog = signals.interactive_backlog
    if backlog >= thresholds.shed_backlog:
        step = Step.SHED_INTERACTIVE
    elif backlog >= thresholds.fallback_backlog:
        step = Step.FALLBACK
    elif backlog >= thresholds.shed_batch_backlog:
        step = Step.SHED_BATCH
    elif backlog >= 1 or signals.headroom is False:
        step = Step.DEFER_BATCH
    else:
        step = Step.NORMAL
    rate, measured = drain_rate(signals, thresholds)
    return Rung(step, retry_after_ms(backlog, rate, thresholds.max_retry_after_ms), rate, measured)


def sheds_batch(rung: Rung) -> bool:
    return rung.step >= Step.SHED_BATCH


def allows_fallback(rung: Rung) -> bool:
    return rung.step >= Step.FALLBACK


def sheds_interactive(rung: Rung) -> bool:
    return rung.step >= Step.SHED_INTERACTIVE
