"""The autoscaler on the simulator's clock: the same control law (sluice.autoscaler.control) drives a
fleet whose replicas start cold, wait warm, serve and drain, while the gateway sheds with a retry-after.

The fleet allocates `scaler.max_replicas` replica slots; the first `initial_serving` serve from the
start, `initial_warm` more sit warm, the rest are off. Every `interval_s` the host measures the pool
(queue depth, runs in flight, KV utilization, p95 TTFT and the arrival rate over the last window, its
slope over the last `slope_windows`), asks the control law, and acts:

    undrain   draining -> serving at once (a surge cancels a drain before anything is promoted or started)
    start     off -> starting, warm `cold_start_s` later (ScalerConfig.cold_start_s)
    promote   warm -> serving `promote_s` later (routing picks it up)
    drain     serving -> draining: no new runs; when its last run ends it goes back to the warm pool
              if that is short, else off; a run is never interrupted to scale in
    retire    warm -> off

Gateway shedding (seed 000: "beyond that the gateway rejects with a retry-after"): a run arriving
while the pool's predicted queue wait (runs waiting / runs completed per second over the last
window, the measured drain rate) exceeds `shed_queue_wait_s` is refused; its user comes back after
the retry-after it was given, that same predicted wait.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sluice.autoscaler.control import Autoscaler, PoolSignals, ScaleDecision, ScalerConfig

if TYPE_CHECKING:
    from sluice.sim.fleet import SimReplica, _Run
    from sluice.sim.workload import Turn


@dataclass(frozen=True, slots=True)
class Autoscaling:
    scaler: ScalerConfig
    initial_serving: int
    initial_warm: int = 0
    interval_s: float = 5.0                 # how often the control loop runs
    window_s: float = 30.0                  # the window its rates and p95 TTFT are measured over
    slope_windows: int = 3                  # arrival slope: rate now vs this many intervals ago
    promote_s: float = 5.0                  # warm -> serving
    shed_queue_wait_s: float | None = 10.0  # None: never shed


@dataclass(frozen=True, slots=True)
class ScalingSample:
    """The pool at one control-loop tick."""

    at_s: float
    serving: int
    warm: int
    starting: int
    draining: int
    ttft_p95_s: float                       # first tokens in the last window (nan: none)
    shed_in_interval: int
    arrival_rate: float
    reason: str


class ScalingHost:
    """What an autoscaler process does against real replicas, done to SimReplicas on the virtual clock."""

    def __init__(self, run: _Run, settings: Autoscaling) -> None:
        self.run = run
        self.settings = settings
        self.scaler = Autoscaler(settings.scaler)
        self.samples: list[ScalingSample] = []
        self.shed_total = 0
        self._shed_since_tick = 0
        self._arrivals: deque[float] = deque()
        self._completions: deque[float] = deque()
        self._first_tokens: deque[tuple[float, float]] = deque()     # (time, TTFT)
        self._rates: deque[float] = deque(maxlen=settings.slope_windows + 1)

    # -- set-up -------------------------------------------------------------------------------------

    def place_initial(self, replicas: list[SimReplica]) -> None:
        settings = self.settings
        for index, replica in enumerate(replicas):
            if index < settings.initial_serving:
                replica.state = "serving"
            elif index < settings.initial_serving + settings.initial_warm:
                replica.state = "warm"
            else:
                replica.state = "off"
        self.run.push_control(settings.interval_s, None, "scale")

    # -- what the run reports -----------------------------------------------------------------------

    def shed(self, turn: Turn, at: float) -> bool:
        """Refuse the run when the predicted queue wait is past the limit; the user retries after it."""
        self._arrivals.append(at)
        limit = self.settings.shed_queue_wait_s
        if limit is None:
            return False
        wait = self._predicted_wait(at)
        if wait <= limit:
            return False
        self.shed_total += 1
        self._shed_since_tick += 1
        self.run.push_arrival(at + wait, turn)
        return True

    def first_token(self, at: float, ttft: float) -> None:
        self._first_tokens.append((at, ttft))

    def finished(self, replica: SimReplica, at: float) -> None:
        self._completions.append(at)
        if replica.state == "draining" and replica.in_flight == 0:
            self._drained(replica)

    def _drained(self, replica: SimReplica) -> None:
        """A draining replica's last run ended: back to the warm pool if it is short, else off."""
        warm = sum(1 for r in self.run.fleet.replicas if r.state == "warm")
        replica.state = "warm" if warm < self.settings.scaler.warm_pool else "off"

    # -- control events -----------------------------------------------------------------------------

    def on_control(self, kind: str, replica: SimReplica | None, at: float) -> None:
        if kind == "scale":
            self._tick(at)
            self.run.push_control(at + self.settings.interval_s, None, "scale")
        elif kind == "ready" and replica is not None and replica.state == "starting":
            replica.state = "warm"
        elif kind == "promoted" and replica is not None and replica.state == "promoting":
            replica.state = "serving"

    def _tick(self, at: float) -> None:
        signals = self._signals(at)
        decision = self.scaler.decide(signals)
        self._act(decision, at)
        ttft = signals.ttft_p95_s if signals.ttft_p95_s is not None else math.nan
        self.samples.append(ScalingSample(
            at_s=at, serving=signals.serving, warm=signals.warm, starting=signals.starting,
            draining=signals.draining, ttft_p95_s=ttft, shed_in_interval=self._shed_since_tick,
            arrival_rate=signals.arrival_rate, reason=decision.reason))
        self._shed_since_tick = 0

    def _signals(self, at: float) -> PoolSignals:
        replicas = self.run.fleet.replicas
        serving = [r for r in replicas if r.state == "serving" and not r.down]
        promoting = sum(1 for r in replicas if r.state == "promoting")
        horizon = at - self.settings.window_s
        for events in (self._arrivals, self._completions):
            while events and events[0] < horizon:
                events.popleft()
        while self._first_tokens and self._first_tokens[0][0] < horizon:
            self._first_tokens.popleft()
        # Until a whole window has passed, the rate is over the time elapsed, and no slope is read
        # from a window still filling (it would look like a traffic step at start-up).
        elapsed = min(at, self.settings.window_s)
        rate = len(self._arrivals) / elapsed if elapsed > 0 else 0.0
        if at >= self.settings.window_s:
            self._rates.append(rate)
        slope = ((rate - self._rates[0]) / ((len(self._rates) - 1) * self.settings.interval_s)
                 if len(self._rates) > 1 else 0.0)
        ttfts = [ttft for _, ttft in self._first_tokens]
        count = {state: sum(1 for r in replicas if r.state == state)
                 for state in ("warm", "starting", "draining")}
        return PoolSignals(
            now_s=at, serving=len(serving) + promoting, warm=count["warm"], starting=count["starting"],
            draining=count["draining"], in_flight=sum(r.in_flight for r in serving),
            queue_depth=sum(r.engine.num_waiting for r in serving),
            kv_utilization=(sum(r.engine.pool.num_used / r.engine.pool.num_blocks for r in serving)
                            / len(serving) if serving else 0.0),
            ttft_p95_s=float(np.percentile(ttfts, 95)) if ttfts else None,
            arrival_rate=rate, arrival_slope=slope)

    def _predicted_wait(self, at: float) -> float:
        horizon = at - self.settings.window_s
        while self._completions and self._completions[0] < horizon:
            self._completions.popleft()
        waiting = sum(r.engine.num_waiting for r in self.run.fleet.replicas if r.state == "serving")
        if waiting == 0:
            return 0.0
        drain_rate = len(self._completions) / self.settings.window_s
        return waiting / drain_rate if drain_rate > 0 else math.inf

    def _act(self, decision: ScaleDecision, at: float) -> None:
        replicas = self.run.fleet.replicas
        for replica in [r for r in replicas if r.state == "draining"][:decision.undrain]:
            replica.state = "serving"                     # still loaded: routed again at once
        warm = [r for r in replicas if r.state == "warm"]
        for replica in warm[:decision.promote]:
            replica.state = "promoting"                   # committed: counted as serving, not routed yet
            self.run.push_control(at + self.settings.promote_s, replica, "promoted")
        for replica in warm[decision.promote:decision.promote + decision.retire_warm]:
            replica.state = "off"
        off = [r for r in replicas if r.state == "off"]
        for replica in off[:decision.start]:
            replica.state = "starting"
            replica.engine = self.run.fleet.fresh_engine(replicas.index(replica))
            replica.start_time = at
            self.run.policy.on_replica_restarted(replica.name)
            self.run.push_control(at + self.settings.scaler.cold_start_s, replica, "ready")
        # Drain the least busy first: they empty soonest.
        serving = sorted((r for r in replicas if r.state == "serving"), key=lambda r: (r.in_flight, r.name))
        for replica in serving[:decision.drain]:
            replica.state = "draining"
            if replica.in_flight == 0:
                self._drained(replica)
