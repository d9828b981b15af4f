"""The autoscaler's control law: one pool's signals in, one scaling decision out. Pure: no clock, no I/O.

Seed 000: "replica count from queue depth, KV pressure and TTFT headroom, with the
cold start counted: a 70B replica takes a minute or more to load weights and warm
up, so the scaler acts on a leading indicator and keeps a warm pool."

Demand is counted in runs the pool must hold at once (concurrency), from three
signals the platform already has, and the largest wins::

    now        = in_flight + queue_depth
    leading    = (arrival_rate + arrival_slope * cold_start_s) * mean_run_s + queue_depth
                 (Little's law on the arrival rate projected one cold start ahead:
                  a replica ordered now serves the traffic of a cold start from now)
    kv         = serving * kv_utilization / target_kv_utilization   (in replicas)
    ttft       = serving + 1 while p95 TTFT is past ttft_headroom x the SLO

    scale-out target = ceil(demand / (runs_per_replica * target_utilization))
    scale-in target  = ceil(demand / (runs_per_replica * scale_in_utilization))

Hysteresis: the pool grows when demand passes target_utilization of what the
serving replicas hold and shrinks only when it would still be under
scale_in_utilization with one replica fewer; each direction has its own
cool-down. Replicas are ordered in three states besides serving::

    cold start (cold_start_s) -> warm (loaded, idle, not routed to) -> serving -> draining -> warm | stopped

Growing first returns draining replicas to serving (they are loaded and still
hold runs: a drain cancelled costs nothing), then promotes warm replicas
(seconds) and starts cold ones for the rest; cold starts also refill the warm
pool after a promotion. Shrinking drains: a
draining replica takes no new run and stops (or returns to the warm pool) only
when its last run has ended, so scaling in never interrupts a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BAD_BOUNDS = "autoscaler: need 0 <= min_replicas <= max_replicas (got {low}..{high})"
BAD_HYSTERESIS = "autoscaler: scale_in_utilization must be below target_utilization (got {low} >= {high})"
BAD_CAPACITY = "autoscaler: runs_per_replica must be positive (got {value})"


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool at one instant, as the platform measures it."""

    now_s: float
    serving: int                    # replicas taking new runs
    warm: int                       # loaded and idle, not routed to: promotable in seconds
    starting: int                   # cold starts under way
    draining: int                   # finishing their runs before they stop
    in_flight: int                  # runs running on serving replicas
    queue_depth: int                # runs waiting: engines' queues plus accepted runs not yet routed
    kv_utilization: float           # mean over serving replicas, 0..1
    ttft_p95_s: float | None        # over the last window (None: no first token in it)
    arrival_rate: float             # runs / s admitted over the last window
    arrival_slope: float            # change of that rate, runs / s per s, over the last windows


@dataclass(frozen=True, slots=True)
class ScalerConfig:
    runs_per_replica: float         # concurrent runs one replica serves within its SLOs (planner: goodput)
    min_replicas: int = 1
    max_replicas: int = 16          # serving + warm + starting + draining: the GPUs the pool may hold
    warm_pool: int = 1              # replicas kept loaded and idle beyond what serves
    target_utilization: float = 0.8
    scale_in_utilization: float = 0.5
    target_kv_utilization: float = 0.85
    ttft_slo_s: float = 0.5
    ttft_headroom: float = 0.8      # scale out once p95 TTFT passes this share of the SLO
    cold_start_s: float = 90.0      # weights loaded and warmed up (seed 000: "a minute or more" for 70B)
    scale_out_cooldown_s: float = 15.0
    scale_in_cooldown_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(BAD_BOUNDS.format(low=self.min_replicas, high=self.max_replicas))
        if self.scale_in_utilization >= self.target_utilization:
            raise ValueError(BAD_HYSTERESIS.format(low=self.scale_in_utilization,
                                                   high=self.target_utilization))
        if self.runs_per_replica <= 0:
            raise ValueError(BAD_CAPACITY.format(value=self.runs_per_replica))


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    undrain: int                    # draining -> serving (a drain cancelled by a surge)
    promote: int                    # warm -> serving
    start: int                      # cold starts to order
    drain: int                      # serving -> draining
    retire_warm: int                # warm replicas beyond the warm pool to stop
    serving_target: int             # serving replicas wanted
    demand_runs: float              # the demand the target was sized for
    reason: str                     # which signal decided, for metrics and logs

    @property
    def acts(self) -> bool:
        return bool(self.undrain or self.promote or self.start or self.drain or self.retire_warm)


def demand_runs(signals: PoolSignals, config: ScalerConfig) -> tuple[float, str]:
    """Concurrent runs the pool must hold, and the signal that set it."""
    now = float(signals.in_flight + signals.queue_depth)
    mean_run_s = signals.in_flight / signals.arrival_rate if signals.arrival_rate > 0 else 0.0
    projected_rate = max(signals.arrival_rate + signals.arrival_slope * config.cold_start_s, 0.0)
    leading = projected_rate * mean_run_s + signals.queue_depth
    kv = signals.serving * signals.kv_utilization / config.target_kv_utilization * (
        config.runs_per_replica * config.target_utilization)
    candidates = (("queue", now), ("leading", leading), ("kv", kv))
    reason, demand = max(candidates, key=lambda item: item[1])
    return demand, reason


class Autoscaler:
    """Holds only the times of its last actions (for cool-downs); everything else arrives as signals."""

    def __init__(self, config: ScalerConfig) -> None:
        self.config = config
        self._last_out = -math.inf
        self._last_in = -math.inf

    def decide(self, signals: PoolSignals) -> ScaleDecision:
        config = self.config
        demand, reason = demand_runs(signals, config)
        per_replica = config.runs_per_replica
        out_target = math.ceil(demand / (per_replica * config.target_utilization))
        in_target = math.ceil(demand / (per_replica * config.scale_in_utilization))
        ttft = signals.ttft_p95_s
        ttft_hot = ttft is not None and ttft > config.ttft_slo_s * config.ttft_headroom
        if ttft_hot and out_target <= signals.serving:
            out_target, reason = signals.serving + 1, "ttft"
        limit = config.max_replicas
        out_target = min(max(out_target, config.min_replicas), limit)
        if out_target > signals.serving:
            return self._grow(signals, out_target, demand, reason)
        in_target = max(in_target, config.min_replicas)
        if in_target < signals.serving and not ttft_hot:
            return self._shrink(signals, in_target, demand)
        return self._hold(signals, demand, "steady")

    def _grow(self, signals: PoolSignals, target: int, demand: float, reason: str) -> ScaleDecision:
        config = self.config
        if signals.now_s - self._last_out < config.scale_out_cooldown_s:
            # Warm replicas beyond the warm pool are the ones this growth is waiting to promote: kept.
            return self._hold(signals, demand, "scale-out cool-down", retire=False)
        missing = target - signals.serving
        undrain = min(signals.draining, missing)
        promote = min(signals.warm, missing - undrain)
        # Cold starts already under way count toward what is missing, then the warm pool is refilled.
        warm_after = signals.warm - promote
        wanted = (missing - undrain - promote) + max(config.warm_pool - warm_after, 0)
        start = max(min(wanted - signals.starting, _room(signals, config)), 0)
        self._last_out = signals.now_s
        return ScaleDecision(undrain=undrain, promote=promote, start=start, drain=0, retire_warm=0,
                             serving_target=target,
                             demand_runs=demand, reason=reason)

    def _shrink(self, signals: PoolSignals, target: int, demand: float) -> ScaleDecision:
        if signals.now_s - self._last_in < self.config.scale_in_cooldown_s:
            return self._hold(signals, demand, "scale-in cool-down")
        self._last_in = signals.now_s
        return ScaleDecision(undrain=0, promote=0, start=0, drain=signals.serving - target, retire_warm=0,
                             serving_target=target, demand_runs=demand, reason="scale-in")

    def _hold(self, signals: PoolSignals, demand: float, reason: str, retire: bool = True) -> ScaleDecision:
        """No change to serving; keep the warm pool at its size (start the missing, retire the extra
        unless `retire` is False: growth held by its cool-down still wants them)."""
        config = self.config
        # A draining replica returns to the warm pool if it is short when its runs end: counted in it.
        pool = signals.warm + signals.starting + signals.draining
        start = max(min(config.warm_pool - pool, _room(signals, config)), 0)
        extra = max(signals.warm - config.warm_pool, 0) if retire else 0
        return ScaleDecision(undrain=0, promote=0, start=start, drain=0, retire_warm=extra,
                             serving_target=signals.serving, demand_runs=demand, reason=reason)


def _room(signals: PoolSignals, config: ScalerConfig) -> int:
    """Replicas that may still be started: a draining replica holds its GPUs until its runs end."""
    held = signals.serving + signals.warm + signals.starting + signals.draining
    return config.max_replicas - held
