"""Hung-replica judgment (issue 10.4), pure: is a silent stream's replica hung?

A replica that is alive but silent (SIGSTOPped, deadlocked, its host frozen) keeps its
TCP connections open, so nothing fails; the run would wait for the client's fixed
inactivity limit (replica_client, 10 s). The routing process's replica monitor asks,
four times a second, for every run in progress:

    silent for longer than HUNG_STEPS of the run's own step time (at least MIN_SILENCE_S)
    AND the replica has not proved alive for LIVENESS_STALE_S
        (no successful metrics scrape or readiness check, no token on any of its streams)
    ──▶ hung: the run ends INTERRUPTED with exactly the tokens received
        (before its first token: a failed attempt, retried elsewhere)

Both conditions, so that neither a slow step on a live replica (its scrapes answer)
nor a slow metrics endpoint on a streaming replica (its tokens flow) is mistaken for
a hang. A SIGSTOPped replica is judged hung about LIVENESS_STALE_S after it stopped
(plus one scrape interval and one monitor tick): well within 5 s. A replica with no
liveness source (not scraped) falls back to UNSCRAPED_SILENCE_S of silence.
"""

from __future__ import annotations

from dataclasses import dataclass

HUNG_STEPS = 20              # silence longer than this many of the run's steps is suspicious
MIN_SILENCE_S = 2.0          # ... and never less than this (batching pauses, a GC, a busy box)
LIVENESS_STALE_S = 2.5       # scrapes run every 0.25 s with a 1 s timeout: ~8 missed in a row
UNSCRAPED_SILENCE_S = 10.0   # no liveness source: the old fixed limit
# A stream silent for less than this is never hung, whatever its step time and liveness (both
# branches of `hung` ask for at least this much): the monitor, which looks at every stream four times
# a second, judges only the streams silent this long (a Silence per stream per tick was ~4 us each).
JUDGED_FROM_S = min(MIN_SILENCE_S, UNSCRAPED_SILENCE_S)
MONITOR_TICK_S = 0.25
# A tick later than this after the previous one means the routing process itself was stalled (a
# starved box, a long GC): every silence it measures now includes time it could not read its sockets,
# and uvloop runs due timers before polling I/O, so tokens already in the socket are not yet seen.
STALLED_TICK_S = 1.0

DETAIL_HUNG = "silent {silent:.1f}s (~{step_ms:.0f} ms per step), not alive for {stale:.1f}s"
DETAIL_HUNG_UNSCRAPED = "silent {silent:.1f}s"


@dataclass(frozen=True, slots=True)
class Silence:
    silent_s: float              # since the stream's last token (or since the request was sent)
    step_s: float | None         # the run's observed time per token; None before its second token
    alive_age_s: float | None    # since the replica last proved alive; None: no liveness source
    first_token: bool = True     # the stream produced a token (before it, an unscraped replica may
                                 #   be queueing: the first-token limit applies instead)


def hung(silence: Silence) -> str | None:
    """Why the replica counts as hung for this stream, or None while it does not."""
    if silence.alive_age_s is None:
        if silence.first_token and silence.silent_s >= UNSCRAPED_SILENCE_S:
            return DETAIL_HUNG_UNSCRAPED.format(silent=silence.silent_s)
        return None
    step = silence.step_s or 0.0
    if silence.silent_s >= max(MIN_SILENCE_S, HUNG_STEPS * step) and silence.alive_age_s >= LIVENESS_STALE_S:
        return DETAIL_HUNG.format(silent=silence.silent_s, step_ms=step * 1000, stale=silence.alive_age_s)
    return None


class StallGuard:
    """Whether the monitor may judge at this tick: not on the first tick after the process itself
    stalled (the replicas' tokens and scrape answers of the stall wait unread in the sockets until the
    loop polls I/O, which uvloop does after running due timers). The next tick judges as usual."""

    __slots__ = ("_last",)

    def __init__(self, started_at: float) -> None:
        self._last = started_at

    def may_judge(self, now: float) -> bool:
        gap, self._last = now - self._last, now
        return gap <= STALLED_TICK_S
