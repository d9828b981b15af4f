"""The edge of sluice.traffic for admission and routing: settings from [traffic], the checks a Submit
goes through for its priority class, GPU-memory budget and the degradation ladder, and the ladder's
metrics. The rules themselves are pure, in sluice/traffic/.

    Submit, after the model is known:
      priority batch and the tenant not permitted               → PERMISSION_DENIED
      prompt + cap > the tenant's whole KV token budget         → RESOURCE_EXHAUSTED (the cap that fits)
      the ladder's step for the model's pool (ladder.climb):
        batch:       step >= shed batch, or its own backlog full → UNAVAILABLE + retry-after
        interactive: step >= shed interactive                    → UNAVAILABLE + retry-after
                     step >= fallbacks                           → a permitted fallback may take it
    Routing worker, each claim pass:
      interactive runs first; batch runs only from pools with headroom (priority.has_headroom) and
      only while no interactive run waited in the pass (ladder step "defer batch")
      a run whose tenant's KV budget it would overflow waits ACCEPTED (gpu_budget.claimable)

Retry-after comes from the drain rate measured over [traffic].drain_window_s (runs of the model
claimed), read only when a submit is about to be refused, so the hot path pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from sluice.ledger.admission_sql import BacklogBounds
from sluice.ledger.repositories import TenantInfo
from sluice.services.errors import (
    BATCH_BACKLOG_FULL,
    BATCH_NOT_ALLOWED,
    BATCH_SHED,
    CONTEXT_ADVICE_LOWER_CAP,
    CONTEXT_ADVICE_SHORTEN_PROMPT,
    KV_BUDGET_NEVER_FITS,
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY,
    POOL_BACKLOG_FULL,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

from sluice.config import Settings
from sluice.traffic.gpu_budget import kv_tokens, never_fits
from sluice.traffic.ladder import LadderThresholds, PoolSignals, Rung, Step, climb, retry_after_ms
from sluice.traffic.priority import Headroom, Priority
from sluice.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class TrafficSettings:
    headroom: Headroom                   # what a pool must be below for batch dispatch
    ladder: LadderThresholds
    max_batch_backlog: int               # batch runs ACCEPTED per model before batch submits are shed
    default_batch_deadline_ms: int
    max_batch_deadline_ms: int
    drain_window_s: float                # the window the measured drain rate is counted over

    @classmethod
    def from_config(cls, config: Settings) -> TrafficSettings:
        traffic, admission = config.traffic, config.admission
        return cls(
            headroom=Headroom(max_queue_depth=traffic.batch_max_queue_depth,
                              max_kv_utilization=traffic.batch_max_kv_utilization,
                              max_slot_utilization=traffic.batch_max_slot_utilization),
            ladder=LadderThresholds.from_fractions(
                admission.max_backlog_per_pool, traffic.shed_batch_backlog_fraction,
                traffic.fallback_backlog_fraction, admission.pool_drain_runs_per_s,
                traffic.min_drained_to_measure, traffic.max_retry_after_ms),
            max_batch_backlog=traffic.max_batch_backlog_per_pool,
            default_batch_deadline_ms=traffic.default_batch_deadline_ms,
            max_batch_deadline_ms=traffic.max_batch_deadline_ms,
            drain_window_s=traffic.drain_window_s,
        )


DEFAULT_TRAFFIC = TrafficSettings(
    headroom=Headroom(), ladder=LadderThresholds.from_fractions(1_000, 0.25, 0.5, 50.0),
    max_batch_backlog=10_000, default_batch_deadline_ms=21_600_000, max_batch_deadline_ms=259_200_000,
    drain_window_s=10.0)


def check_priority_permitted(tenant: TenantInfo, priority: Priority) -> None:
    if priority is Priority.BATCH and not tenant.batch_allowed:
        raise PermissionDenied(BATCH_NOT_ALLOWED)


def check_kv_budget(tenant: TenantInfo, prompt_tokens: int, cap: int) -> None:
    """Refuse a run that could never be claimed: larger on its own than the tenant's whole budget."""
    budget = tenant.kv_token_budget
    needed = kv_tokens(prompt_tokens, cap)
    if budget is None or not never_fits(needed, budget):
        return
    fit = budget - prompt_tokens
    advice = CONTEXT_ADVICE_LOWER_CAP.format(fit=fit) if fit > 0 else \
        CONTEXT_ADVICE_SHORTEN_PROMPT.format(limit=budget)
    raise ResourceExhausted(
        KV_BUDGET_NEVER_FITS.format(needed=needed, prompt=prompt_tokens, cap=cap, budget=budget,
                                    advice=advice),
        metadata=[(MAX_OUTPUT_TOKENS_THAT_FIT_KEY, str(max(fit, 0)))], reason="KV_TOKEN_BUDGET")


def may_refuse(priority: Priority, backlog: int, batch_backlog: int, settings: TrafficSettings) -> bool:
    """Could the ladder refuse this submit? Only then is the drain rate worth measuring."""
    if priority is Priority.BATCH:
        return backlog >= settings.ladder.shed_batch_backlog or batch_backlog >= settings.max_batch_backlog
    return backlog >= settings.ladder.fallback_backlog


def backlog_bounds(priority: Priority, waiting_within: int,
                   settings: TrafficSettings) -> BacklogBounds | None:
    """The backlogs under which a submit that passed every load check with nothing waiting passes
    them all the same (a Submit decided on a cached context: services/submit_contexts.py). Below the
    first ladder step that acts on its class's admission (interactive: fallbacks, then shedding;
    batch: shedding by the interactive backlog or by its own), and with no more runs ahead of it than
    its deadline allows (`waiting_within`: admission_rules.largest_waiting_within; an interactive run
    waits behind interactive runs, a batch run behind both). None: no backlog at all would do."""
    if priority is Priority.BATCH:
        bounds = BacklogBounds(backlog=settings.ladder.shed_batch_backlog - 1,
                               batch=settings.max_batch_backlog - 1, waiting=waiting_within, count_batch=True)
    else:
        backlog = min(settings.ladder.fallback_backlog - 1, waiting_within)
        bounds = BacklogBounds(backlog=backlog, batch=0, waiting=backlog, count_batch=False)
    return bounds if min(bounds.backlog, bounds.batch, bounds.waiting) >= 0 else None


def rung_for(backlog: int, drained_runs: int, settings: TrafficSettings) -> Rung:
    return climb(PoolSignals(interactive_backlog=backlog, drained_runs=drained_runs,
                             window_s=settings.drain_window_s if drained_runs else 0.0), settings.ladder)


def check_ladder(model_version: str, worker_pool: str, priority: Priority, rung: Rung, backlog: int,
                 batch_backlog: int, settings: TrafficSettings) -> None:
    """Refuse (UNAVAILABLE + retry-after) what the ladder's step sheds for this priority."""
    if priority is Priority.BATCH:
        if rung.step >= Step.SHED_BATCH:
            raise Unavailable(BATCH_SHED.format(model=model_version, backlog=backlog, pool=worker_pool,
                                                threshold=settings.ladder.shed_batch_backlog,
                                                retry_after_ms=rung.retry_after_ms),
                              retry_after_ms=rung.retry_after_ms, reason="BATCH_SHED")
        if batch_backlog >= settings.max_batch_backlog:
            wait = retry_after_ms(batch_backlog, rung.drain_runs_per_s, settings.ladder.max_retry_after_ms)
            raise Unavailable(BATCH_BACKLOG_FULL.format(model=model_version, backlog=batch_backlog,
                                                        pool=worker_pool, limit=settings.max_batch_backlog,
                                                        retry_after_ms=wait),
                              retry_after_ms=wait, reason="BATCH_BACKLOG_FULL")
        return
    if rung.step >= Step.SHED_INTERACTIVE:
        raise Unavailable(POOL_BACKLOG_FULL.format(model=model_version, pool=worker_pool, backlog=backlog,
                                                   limit=settings.ladder.shed_backlog,
                                                   retry_after_ms=rung.retry_after_ms),
                          retry_after_ms=rung.retry_after_ms, reason="POOL_BACKLOG_FULL")


def priority_from_proto(value: int) -> Priority:
    return Priority.BATCH if value == common_pb2.PRIORITY_BATCH else Priority.INTERACTIVE


def priority_to_proto(priority: Priority | str) -> common_pb2.Priority:
    batch = Priority(priority) is Priority.BATCH
    return common_pb2.PRIORITY_BATCH if batch else common_pb2.PRIORITY_INTERACTIVE


class LadderMetrics:
    """Each ladder step, visible: the step a pool is on as last decided here, and each time a step acted.

    sluice_ladder_step{pool}                 0 normal · 1 defer batch · 2 shed batch · 3 fallbacks ·
                                             4 shed interactive (as last decided by this process)
    sluice_ladder_actions_total{pool,step}   defer_batch: a claim pass left batch runs waiting;
                                             shed_batch / fallback / shed_interactive: a submit so treated
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._step = Gauge("sluice_ladder_step", "degradation ladder step of the pool as last decided here",
                           ["pool"], registry=self.registry)
        self._actions = Counter("sluice_ladder_actions_total", "times a degradation ladder step acted",
                                ["pool", "step"], registry=self.registry)

    def decided(self, pool: str, step: Step) -> None:
        self._step.labels(pool).set(int(step))

    def acted(self, pool: str, step: Step, count: int = 1) -> None:
        self._actions.labels(pool, step.label).inc(count)

    def count(self, pool: str, step: Step) -> float:
        """How many times `step` acted on `pool` (tests, benches)."""
        value = self.registry.get_sample_value("sluice_ladder_actions_total",
                                               {"pool": pool, "step": step.label})
        return value or 0.0
