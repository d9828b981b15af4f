"""Admission: the only way work enters Sluice (protos/sluice/v1/admission.proto).

A Submit is two autocommit round trips on the hot path (ledger/admission_sql.py), on one checkout,
and one once this process has read the caller's context (services/submit_contexts.py: the READ is
skipped, the checks below run on the context kept with nothing waiting, and the WRITE checks in its
own snapshot that the key, the tenant's and model's rows, the name's resolution and the backlogs
still allow the same decision; if not, nothing is written and the Submit is decided on a fresh READ):

    API key from metadata (pure)             missing → UNAUTHENTICATED
    READ   key → tenant, alias/version → model + its backlog (ACCEPTED runs), one SELECT
           unknown/revoked/expired key → UNAUTHENTICATED
           not a tenant key, or the tenant suspended → PERMISSION_DENIED
    request shape (pure)                     → INVALID_ARGUMENT
    model                                    unknown → NOT_FOUND; tier not allowed → PERMISSION_DENIED
                                             (an alias with an active canary may resolve to its candidate:
                                             the same SELECT, by the run's sticky split point)
    backlog >= [admission].max_backlog_per_pool → a permitted fallback, else UNAVAILABLE + retry-after
    tokenize (a worker thread for large inputs), prompt + cap <= context → INVALID_ARGUMENT
    deadline >= queue wait + prefill + cap × token time → else (queue-bound) a permitted fallback,
                                             else DEADLINE_EXCEEDED naming what would do
    WRITE  reserve prompt + cap on the budget row and INSERT the run, one statement
           (its RETURNING carries NOTIFY sluice_runs_accepted: delivered at its commit)
    answer: a returned run id always has its reservation committed.

Everything else takes the transactional path, the same checks as one transaction:

    BEGIN
      INSERT run ON CONFLICT (tenant, request_key) DO NOTHING RETURNING id
        ├─ inserted → [tenant limits under a lock on the tenant row] → reserve (one conditional
        │             UPDATE; a new month opens its period); does not fit → ROLLBACK,
        │             RESOURCE_EXHAUSTED naming the cap that fits
        └─ conflict → same payload hash: the existing run (deduplicated=true)
                      another payload:   ALREADY_EXISTS
    COMMIT

It is taken when the tenant has concurrency or tokens-per-minute limits (they need the lock),
when the one-statement write wrote nothing (request key taken, budget does not fit, no period
yet: it decides which and explains), and when a load check refused a retry of an accepted run.

Every run records its routing decision (sluice/traffic/route.py) in the row the write inserts:
the name the caller wrote, why it went to its version (requested, alias, canary, fallback), the
version's pool and tier, and for a fallback the version refused and the condition met. A fallback
(sluice/traffic/fallback.py) is taken only within what the tenant's administrator permits
(tenant_fallbacks) narrowed by the request, among tiers the tenant may use; its context, deadline
and reservation are counted with the fallback's own tokenizer and price card. Without a usable
permitted fallback the original refusal stands (UNAVAILABLE with retry-after, DEADLINE_EXCEEDED).

Refusals write nothing. Shedding and the deadline check come before any write, so an overloaded
pool costs one bounded index count per refused submit; a refused submit whose request_key
already names a run falls through to the idempotent answer instead (a retry of an accepted run
gets that run, not a refusal).

The backlog bound is approximate by design: each submit counts committed runs only, so submits
racing on one model can each see room and together overshoot the bound by at most the number of
Submits in flight at once across all admission instances (their connection pools; a few dozen),
which is fine for shedding (unlike budgets, which never overshoot).

The budget row is locked only for the one write statement (or from the conditional UPDATE to
COMMIT), which is what bounds one tenant's submit rate.

No raw prompt or API key is ever logged; logs carry the run id, tenant and token counts.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import asyncpg
import grpc.aio
from opentelemetry import trace
from sluice.ledger import token_ids
from sluice.ledger.admission_sql import (
    Reserved,
    SubmitContext,
    drained_runs,
    insert_reserving,
    insert_reserving_if_held,
    read_submit_context,
)
from sluice.ledger.channels import RUNS_ACCEPTED_CHANNEL
from sluice.ledger.db import autocommit_engine, dsn_of
from sluice.ledger.fallbacks import read_candidates, read_rules
from sluice.ledger.models import RunStatus
from sluice.ledger.pg import HotPool
from sluice.ledger.pricing import reservation_cost_micros
from sluice.ledger.repositories import (
    BudgetRepository,
    ModelInfo,
    RunRepository,
    TenantInfo,
    TenantRepository,
)
from sluice.ledger.routes import route_columns, route_of
from sluice.services import tokenization
from sluice.services.admission_rules import (
    PoolPace,
    Sampling,
    SubmitIntent,
    check_context,
    check_deadline,
    check_request_shape,
    check_storable,
    deadline_floor,
    largest_cap_that_fits,
    largest_waiting_within,
    limit_advice,
    normalize_float,
    payload_hash,
    rate_window_retry_after,
)
from sluice.services.admitted_here import RecentAdmissions
from sluice.services.auth import Metadata, api_key_from_metadata, check_submitter
from sluice.services.errors import (
    BUDGET_TOO_SMALL_FOR_CAP,
    BUDGET_TOO_SMALL_FOR_PROMPT,
    CONCURRENCY_LIMIT,
    MAX_OUTPUT_TOKENS_THAT_FIT_KEY,
    NO_BUDGET,
    REQUEST_KEY_REUSED,
    RETRY_AFTER_MS_KEY,
    TIER_NOT_ALLOWED,
    TOKENS_PER_MINUTE_LIMIT,
    TOKENS_PER_MINUTE_NEVER_FITS,
    UNKNOWN_API_KEY,
    UNKNOWN_MODEL,
    AlreadyExists,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SluiceError,
    Unauthenticated,
    Unavailable,
    grpc_errors,
)
from sluice.services.gateway_metrics import GatewayMetrics, submit_span_attributes
from sluice.services.routes import route_message
from sluice.services.submit_contexts import SubmitContexts
from sluice.services.telemetry import traceparent, tracer
from sluice.services.traffic import (
    DEFAULT_TRAFFIC,
    LadderMetrics,
    TrafficSettings,
    backlog_bounds,
    check_kv_budget,
    check_ladder,
    check_priority_permitted,
    may_refuse,
    priority_from_proto,
    priority_to_proto,
    rung_for,
)
from sluice.services.trust_scope import scope_of
from sluice.services.validation import FieldLimits, add_checked_service
from sqlalchemy import func
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.traffic.canary import split_point
from sluice.traffic.fallback import Condition, Narrowing, Unusable, describe, permitted, queue_bound, unusable
from sluice.traffic.ladder import Rung, Step, allows_fallback
from sluice.traffic.priority import Priority
from sluice.traffic.route import RouteReason, RouteRecord
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

RATE_WINDOW = dt.timedelta(seconds=60)  # the tokens-per-minute window, sliding


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    default_deadline_ms: int         # used when a request sends deadline_ms = 0
    max_request_key_chars: int
    pace: PoolPace                   # backlog bound and the speeds the deadline floor assumes
    max_deadline_ms: int = 86_400_000   # [admission].max_deadline_ms (interactive)
    traffic: TrafficSettings = DEFAULT_TRAFFIC   # [traffic]: batch bounds and the degradation ladder

    @classmethod
    def from_config(cls, config: Settings) -> AdmissionSettings:
        section = config.admission
        return cls(
            default_deadline_ms=section.default_deadline_ms,
            max_request_key_chars=section.max_request_key_chars,
            max_deadline_ms=section.max_deadline_ms,
            pace=PoolPace(
                max_backlog=section.max_backlog_per_pool,
                drain_runs_per_s=section.pool_drain_runs_per_s,
                ms_per_prompt_token=section.expected_ms_per_prompt_token,
                ms_per_output_token=section.expected_ms_per_output_token,
            ),
            traffic=TrafficSettings.from_config(config),
        )

    def max_deadline_ms_for(self, priority: Priority) -> int:
        return self.traffic.max_batch_deadline_ms if priority is Priority.BATCH else self.max_deadline_ms

    def default_deadline_ms_for(self, priority: Priority) -> int:
        if priority is Priority.BATCH:
            return self.traffic.default_batch_deadline_ms
        return self.default_deadline_ms


@dataclass(frozen=True, slots=True)
class Admitted:
    run_id: uuid.UUID
    status: RunStatus
    model_version: str               # the version the run is pinned to
    input_tokens: int
    max_output_tokens: int
    deduplicated: bool               # an earlier identical submit made this run
    route: RouteRecord | None = None  # where it went and why (None: admitted before 0008)
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A checked, tokenized request, ready for the write transaction."""

    tenant: TenantInfo
    model: ModelInfo
    route: RouteRecord
    intent: SubmitIntent
    prompt_token_ids: bytes = field(repr=False)   # as runs stores them (ledger/token_ids.py)
    input_tokens: int
    payload_hash: str
    deadline_ms: int                 # the request's, or [admission].default_deadline_ms for 0
    reserved_tokens: int
    reserved_cost_micros: int


class AdmissionService:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: AdmissionSettings,
                 metrics: GatewayMetrics | None = None, ladder_metrics: LadderMetrics | None = None,
                 hot: HotPool | None = None, run_ids: Callable[[], uuid.UUID] = uuid.uuid4,
                 recent: RecentAdmissions | None = None, contexts: SubmitContexts | None = None) -> None:
        self._sessionmaker = sessionmaker
        # Contexts read a moment ago, so that a Submit is one round trip (services/submit_contexts.py).
        self._contexts = contexts if contexts is not None else SubmitContexts()
        # New runs admitted here, for the Stream that follows their Submit (services/admitted_here.py).
        self._recent = recent
        # A new run's id: random; in a gateway, drawn to land its events on a partition this process's
        # live tail follows (KafkaEventLog.home_run_ids, eventlog/partitioning.py).
        self._run_ids = run_ids
        self._settings = settings
        self._autocommit = autocommit_engine(sessionmaker)
        # The hot path's two statements run on raw asyncpg connections of the same database
        # (ledger/admission_sql.py): the gateway process's pool when given (its owner closes it),
        # else one of our own, opened on the first Submit and closed by close().
        self._owns_hot = hot is None
        self.hot = hot or HotPool(dsn_of(sessionmaker))
        self.metrics = metrics or GatewayMetrics()
        self.ladder_metrics = ladder_metrics or LadderMetrics(self.metrics.registry)

    async def close(self) -> None:
        if self._owns_hot:
            await self.hot.close()

    async def submit(self, metadata: Metadata, intent: SubmitIntent) -> Admitted:
        """Admit or refuse, timed and counted (GatewayMetrics) under the Submit span, whose
        traceparent the run row keeps for the routing worker's spans (one trace per run)."""
        started = time.perf_counter()
        with tracer().start_as_current_span("admission.submit", kind=trace.SpanKind.SERVER,
                                            record_exception=False, set_status_on_exception=False) as span:
            # Attributes only for a span that records them (tracing off or not sampled: no dicts, no
            # formatted ids; the sampler, by trace id, does not read them).
            recording = span.is_recording()
            if recording:
                span.set_attributes(submit_span_attributes(intent.model, intent.max_output_tokens,
                                                           intent.sampling.as_json()))
            try:
                admitted = await self._admit(metadata, intent, span)
            except SluiceError as error:
                self.metrics.refused(error.code.name, error.reason, time.perf_counter() - started)
                span.set_attributes({"error.type": error.code.name, "sluice.refusal.reason": error.reason})
                span.set_status(trace.StatusCode.ERROR, error.reason)
                raise
            if recording:
                span.set_attributes({"sluice.run_id": str(admitted.run_id),
                                     "gen_ai.usage.input_tokens": admitted.input_tokens,
                                     "sluice.deduplicated": admitted.deduplicated})
        self.metrics.submitted(time.perf_counter() - started)
        return admitted

    async def _admit(self, metadata: Metadata, intent: SubmitIntent, span: trace.Span) -> Admitted:
        # One hot connection for the read and the write (a checkout costs ~50 us of CPU): held
        # through the checks and tokenization between them, which take well under a millisecond
        # for prompts below tokenization.OFF_LOOP_MIN_CHARS.
        async with self.hot.connection() as connection:
            key = api_key_from_metadata(metadata)
            known = self._contexts.get(key, intent.model)
            if known is not None:
                # Decided on the context read a moment ago, the write checking it still holds. Anything
                # but a plain admission (a refusal, a fallback, a context that changed) is decided
                # again on a fresh read: nothing is refused or rerouted on what is only remembered.
                try:
                    return await self._admit_on(connection, key, intent, span, known)
                except _Decided as decided:
                    raise decided.refusal from None
                except (_NotHeld, SluiceError):
                    self._contexts.forget(key, intent.model)
            return await self._admit_on(connection, key, intent, span)

    async def _admit_on(self, connection: asyncpg.Connection, key: str, intent: SubmitIntent,
                        span: trace.Span, known: SubmitContext | None = None) -> Admitted:
        """Admit `key`'s submit on a fresh read, or (`known`) on a cached context: no backlog, and the
        write checks that what the decision used still holds (_NotHeld when it does not)."""
        # Every door reaches here (gRPC and the HTTP edge): what PostgreSQL cannot store or a bound
        # the config sets is refused before the first query reads a field.
        priority = intent.priority
        check_storable(intent, self._settings.max_deadline_ms_for(priority))
        pace, traffic = self._settings.pace, self._settings.traffic
        # Sticky per conversation: every run of one conversation lands on the same side of a split.
        point = split_point(intent.model, intent.conversation_id or intent.request_key)
        context = known or await read_submit_context(connection, key, intent.model, pace.max_backlog, point,
                                                     traffic.max_batch_backlog)
        if known is None:
            self._contexts.put(key, intent.model, context)
        if context.caller is None:
            raise Unauthenticated(UNKNOWN_API_KEY)
        tenant = check_submitter(context.caller)
        if span.is_recording():
            span.set_attributes({"sluice.tenant": str(tenant.id), "sluice.tenant.name": tenant.name})
        text = check_request_shape(intent, self._settings.max_request_key_chars)
        model = _permitted_model(context, tenant, intent.model)
        check_priority_permitted(tenant, priority)
        deadline_ms = intent.deadline_ms or self._settings.default_deadline_ms_for(priority)
        route = RouteRecord(model.version, model.worker_pool, model.quality_tier, context.reason,
                            intent.model, detail=context.canary)
        # The degradation ladder (sluice/traffic/ladder.py): batch is shed first; interactive runs
        # that permit a fallback go there from step 3; interactive is shed at step 4 unless a
        # permitted fallback takes it. Batch never falls back: it waits or is shed.
        # On a cached context the ladder's step is counted once the write has counted the backlog.
        rung = await self._climb_ladder(model, priority, context, counted=known is None)
        fallback: _Prepared | None = None
        try:
            retry = await self._unless_a_retry(tenant, intent, lambda: self._check_ladder(
                model, priority, rung, context))
        except Unavailable as refusal:
            if priority is Priority.BATCH:
                self.ladder_metrics.acted(model.worker_pool, Step.SHED_BATCH)
                raise
            try:
                fallback = await self._fall_back(tenant, intent, text, deadline_ms, model, Condition.BACKLOG,
                                                 f"backlog {context.backlog} >= {pace.max_backlog}", refusal)
            except Unavailable:
                self.ladder_metrics.acted(model.worker_pool, Step.SHED_INTERACTIVE)
                raise
            retry = False
        if fallback is None and not retry and priority is Priority.INTERACTIVE and allows_fallback(rung):
            fallback = await self._fall_back_if_permitted(
                tenant, intent, text, deadline_ms, model, Condition.BACKLOG,
                f"backlog {context.backlog} >= {traffic.ladder.fallback_backlog} (degradation ladder)")
        prepared = fallback or await self._prepare(tenant, model, route, intent, text, deadline_ms)
        check_kv_budget(tenant, prepared.input_tokens, intent.max_output_tokens)
        if fallback is None:
            # A batch run waits behind every interactive run as well as the batch runs before it.
            waiting = context.backlog + (context.batch_backlog if priority is Priority.BATCH else 0)
            try:
                retry = retry or await self._unless_a_retry(tenant, intent, lambda: check_deadline(
                    prepared.deadline_ms, waiting, prepared.input_tokens,
                    intent.max_output_tokens, pace))
            except DeadlineExceeded as refusal:
                floor = deadline_floor(waiting, prepared.input_tokens,
                                       intent.max_output_tokens, pace)
                if priority is Priority.BATCH or \
                        not queue_bound(deadline_ms, floor.queue_ms, floor.prefill_ms + floor.decode_ms):
                    raise
                prepared = await self._fall_back(
                    tenant, intent, text, deadline_ms, model, Condition.DEADLINE,
                    f"queue wait {floor.queue_ms} ms + run {floor.prefill_ms + floor.decode_ms} ms"
                    f" > deadline {deadline_ms} ms", refusal)
        plain = not (retry or tenant.has_rate_limits or prepared.route.reason is RouteReason.FALLBACK)
        if known is not None and not plain:
            raise _NOT_HELD            # more than a plain write: decided again on a fresh read, counted then
        if prepared.route.reason is RouteReason.FALLBACK:
            self.ladder_metrics.acted(model.worker_pool, Step.FALLBACK)
        admitted = None
        if known is not None:
            admitted = await self._insert_reserving_if_held(connection, prepared, known)
        elif not retry and not tenant.has_rate_limits:
            admitted = await self._insert_reserving(connection, prepared)
        if admitted is None:
            try:
                async with self._sessionmaker() as session, session.begin():
                    admitted = await self._insert_or_match(session, prepared)
            except SluiceError as refusal:
                if known is not None:
                    # The write held the context it was decided on: a refusal here (the budget, the
                    # request key) stands, and a fresh read would only make it again.
                    raise _Decided(refusal) from refusal
                raise
        if self._recent is not None and not admitted.deduplicated:
            self._recent.admitted(admitted.run_id, key, traceparent())
        log.info(
            "admitted run %s tenant=%s model=%s route=%s input_tokens=%d cap=%d deduplicated=%s",
            admitted.run_id, tenant.name, admitted.model_version,
            admitted.route.reason.value if admitted.route else "-", admitted.input_tokens,
            admitted.max_output_tokens, admitted.deduplicated,
        )
        return admitted

    async def _fall_back(self, tenant: TenantInfo, intent: SubmitIntent, text: str, deadline_ms: int,
                         refused: ModelInfo, condition: Condition, why: str,
                         refusal: SluiceError) -> _Prepared:
        """The first permitted fallback that can take the run, prepared at its own tokenizer and
        price; raises `refusal` (the requested model's answer) when there is none."""
        pace = self._settings.pace
        async with self._autocommit.connect() as connection:
            rules = await read_rules(connection, tenant.id, (intent.model, refused.version))
            names = permitted(rules, intent.model, refused.version, condition, intent.fallback)
            if not names:
                raise refusal
            candidates = await read_candidates(connection, names, pace.max_backlog)
        detail = describe(condition, refused.version, why)
        for name in names:
            found = candidates[name]
            why_not = unusable(found.candidate, refused.version, tenant.allowed_tiers, pace.max_backlog)
            if why_not is None and found.model is not None:
                route = RouteRecord(found.model.version, found.model.worker_pool, found.model.quality_tier,
                                    RouteReason.FALLBACK, intent.model, fallback_from=refused.version,
                                    detail=detail)
                taken = await self._counted_on(tenant, found.model, found.candidate.backlog, route, intent,
                                               text, deadline_ms)
                if isinstance(taken, _Prepared):
                    return taken
                why_not = taken
            log.info("tenant %s: fallback %s -> %s not taken: %s", tenant.name, refused.version, name,
                     why_not.value if why_not else Unusable.UNKNOWN.value)
        raise refusal

    async def _fall_back_if_permitted(self, tenant: TenantInfo, intent: SubmitIntent, text: str,
                                      deadline_ms: int, requested: ModelInfo, condition: Condition,
                                      why: str) -> _Prepared | None:
        """Ladder step 3: a permitted fallback if one can take the run, else None (the run stays on
        the requested model, which still has room)."""
        try:
            return await self._fall_back(tenant, intent, text, deadline_ms, requested, condition, why,
                                         _NO_FALLBACK)
        except _NoFallback:
            return None

    async def _counted_on(self, tenant: TenantInfo, model: ModelInfo, backlog: int, route: RouteRecord,
                          intent: SubmitIntent, text: str, deadline_ms: int) -> _Prepared | Unusable:
        """The request counted with a fallback's tokenizer: prepared, or why it does not fit there."""
        packed = await tokenization.encode_packed_off_loop(model.tokenizer, text, wrap=not intent.rendered)
        tokens, cap = token_ids.count(packed), intent.max_output_tokens
        if tokens + cap > model.context_limit:
            return Unusable.CONTEXT
        if deadline_ms < deadline_floor(backlog, tokens, cap, self._settings.pace).total_ms:
            return Unusable.DEADLINE
        return _prepared(tenant, model, route, intent, packed, deadline_ms)
    async def _climb_ladder(self, model: ModelInfo, priority: Priority, context: SubmitContext,
                            counted: bool = True) -> Rung:
        """The degradation ladder's step for the model's pool (counted in its metric unless not
        `counted`). The drain rate is measured (one indexed count) only when the ladder could refuse
        this submit: the hot path never pays for it."""
        traffic = self._settings.traffic
        drained = 0
        if may_refuse(priority, context.backlog, context.batch_backlog, traffic):
            async with self._autocommit.connect() as connection:
                drained = await drained_runs(connection, model.version, traffic.drain_window_s)
        rung = rung_for(context.backlog, drained, traffic)
        if counted:
            self.ladder_metrics.decided(model.worker_pool, rung.step)
        return rung

    def _check_ladder(self, model: ModelInfo, priority: Priority, rung: Rung, context: SubmitContext) -> None:
        """What the ladder sheds (counted by the caller, once it is sure: a fallback may still take
        a shed interactive submit)."""
        check_ladder(model.version, model.worker_pool, priority, rung, context.backlog,
                     context.batch_backlog, self._settings.traffic)

    async def _unless_a_retry(self, tenant: TenantInfo, intent: SubmitIntent,
                              check: Callable[[], None]) -> bool:
        """Run a load check (shedding, deadline), letting a retry of an existing run through (True).

        The check is cheap and runs first; only when it refuses is the request key looked up, and if
        it already names a run the submit goes on to the idempotent answer (that run, or
        ALREADY_EXISTS for another payload) instead of refusing a request that was already accepted.
        """
        try:
            check()
        except SluiceError:
            async with self._sessionmaker() as session:
                if await RunRepository(session).by_request_key(tenant.id, intent.request_key) is None:
                    raise
            return True
        return False

    async def _insert_reserving(self, connection: asyncpg.Connection, prepared: _Prepared) -> Admitted | None:
        """The one-statement write; None when it wrote nothing (the transactional path decides why)."""
        reserved = await insert_reserving(connection, self._written_values(prepared), prepared.deadline_ms,
                                          (RUNS_ACCEPTED_CHANNEL, prepared.model.worker_pool))
        if reserved is None:
            return None          # the transactional path tells why (key taken, no fit, no period) and answers
        return self._admitted(prepared, reserved)

    def _admitted(self, prepared: _Prepared, reserved: Reserved) -> Admitted:
        """The answer for a run the one-statement write inserted."""
        self.metrics.budget_left(prepared.tenant.name, reserved.tokens_left, reserved.cost_left_micros)
        return Admitted(run_id=reserved.run_id, status=RunStatus.ACCEPTED,
                        model_version=prepared.model.version,
                        input_tokens=prepared.input_tokens,
                        max_output_tokens=prepared.intent.max_output_tokens, deduplicated=False,
                        route=prepared.route,
                        priority=prepared.intent.priority)

    async def _insert_reserving_if_held(self, connection: asyncpg.Connection, prepared: _Prepared,
                                        known: SubmitContext) -> Admitted | None:
        """_insert_reserving for a submit decided on a cached context (no backlog): written only if
        that context still holds and the backlogs are within the bounds where the decision is the same;
        raises _NotHeld (nothing written) otherwise."""
        intent, settings = prepared.intent, self._settings
        waiting = largest_waiting_within(prepared.deadline_ms, prepared.input_tokens,
                                         intent.max_output_tokens, settings.pace)
        bounds = backlog_bounds(intent.priority, waiting, settings.traffic)
        caller = known.caller
        if bounds is None or caller is None or known.versions is None:
            raise _NOT_HELD
        written = await insert_reserving_if_held(
            connection, self._written_values(prepared), prepared.deadline_ms,
            (RUNS_ACCEPTED_CHANNEL, prepared.model.worker_pool), scope=caller.scope.value,
            versions=known.versions, bounds=bounds)
        if not written.held:
            raise _NOT_HELD
        self.ladder_metrics.decided(prepared.model.worker_pool,
                                    rung_for(written.backlog, 0, settings.traffic).step)
        return None if written.reserved is None else self._admitted(prepared, written.reserved)

    @staticmethod
    async def _prepare(tenant: TenantInfo, model: ModelInfo, route: RouteRecord, intent: SubmitIntent,
                       text: str, deadline_ms: int) -> _Prepared:
        packed = await tokenization.encode_packed_off_loop(model.tokenizer, text, wrap=not intent.rendered)
        check_context(model.version, model.context_limit, token_ids.count(packed), intent.max_output_tokens)
        return _prepared(tenant, model, route, intent, packed, deadline_ms)

    async def _insert_or_match(self, session: AsyncSession, prepared: _Prepared) -> Admitted:
        """Runs inside the caller's write transaction; raising rolls everything back."""
        intent, tenant = prepared.intent, prepared.tenant
        runs = RunRepository(session)
        # The NOTIFY rides on the INSERT (fires only if a row goes in) and is delivered at COMMIT,
        # never for a rollback: a routing worker it wakes finds the run committed.
        run_id = await runs.insert_if_absent(
            self._run_values(prepared), notify=(RUNS_ACCEPTED_CHANNEL, prepared.model.worker_pool))
        if run_id is None:
            existing = await runs.by_request_key(tenant.id, intent.request_key)
            assert existing is not None, "ON CONFLICT fired but the conflicting run is not visible"
            if existing.payload_hash != prepared.payload_hash:
                raise AlreadyExists(REQUEST_KEY_REUSED.format(key=intent.request_key))
            return Admitted(
                run_id=existing.id,
                status=RunStatus(existing.status),
                model_version=existing.model_version,
                input_tokens=existing.input_tokens,
                max_output_tokens=existing.max_output_tokens,
                deduplicated=True,
                route=route_of(existing),
                priority=Priority(existing.priority),
            )
        if tenant.has_rate_limits:
            await _check_rate_limits(session, prepared, run_id)
        await self._reserve(session, prepared)
        state = await BudgetRepository(session).current(tenant.id)
        if state is not None:
            self.metrics.budget_left(tenant.name, state.tokens_left, state.cost_left_micros)
        return Admitted(
            run_id=run_id,
            status=RunStatus.ACCEPTED,
            model_version=prepared.model.version,
            input_tokens=prepared.input_tokens,
            max_output_tokens=intent.max_output_tokens,
            deduplicated=False,
            route=prepared.route,
            priority=intent.priority,
        )

    def _run_values(self, prepared: _Prepared) -> dict[str, Any]:
        return {
            **self._written_values(prepared),
            "prompt_token_ids": list(token_ids.unpack(prepared.prompt_token_ids)),   # the ORM's type packs
            "status": RunStatus.ACCEPTED.value,
            # On the database clock, like created_at, so routing compares like with like.
            "deadline_at": func.now() + dt.timedelta(milliseconds=prepared.deadline_ms),
        }

    def _written_values(self, prepared: _Prepared) -> dict[str, Any]:
        """The runs columns the one-statement write binds (the status, created_at and deadline_at
        are the statement's own, on the database clock)."""
        intent = prepared.intent
        return {
            "id": self._run_ids(),
            "tenant_id": prepared.tenant.id,
            "request_key": intent.request_key,
            "payload_hash": prepared.payload_hash,
            "model_version": prepared.model.version,
            "prompt_token_ids": prepared.prompt_token_ids,
            "input_tokens": prepared.input_tokens,
            "max_output_tokens": intent.max_output_tokens,
            "sampling": intent.sampling.as_json(),
            "conversation_id": intent.conversation_id,
            "cache_scope": scope_of(prepared.tenant.id, prepared.tenant.shared_cache_scope),
            "reserved_tokens": prepared.reserved_tokens,
            "reserved_cost_micros": prepared.reserved_cost_micros,
            "api_key_id": prepared.tenant.api_key_id,
            "price_card_id": prepared.model.price_card_id,   # settled at the price it reserved at
            **route_columns(prepared.route),
            "traceparent": traceparent(),                   # the Submit span's; None when not traced
            "priority": intent.priority.value,
        }

    @staticmethod
    async def _reserve(session: AsyncSession, prepared: _Prepared) -> None:
        budgets = BudgetRepository(session)
        tenant_id = prepared.tenant.id
        tokens, cost = prepared.reserved_tokens, prepared.reserved_cost_micros
        if await budgets.try_reserve(tenant_id, tokens, cost):
            return
        if await budgets.current(tenant_id) is None:
            # A new period: open it, unless a concurrent submit opens it first (our INSERT then waits
            # for its COMMIT and does nothing). Either way the period now exists if the tenant has
            # ever had a budget.
            await budgets.open_current_period(tenant_id)
        # Tried again even when a period was there: another submit may have opened it after the first
        # try (its row invisible then, each statement seeing what was committed when it began); only a
        # reservation that does not fit the period as it is now is refused.
        if await budgets.try_reserve(tenant_id, tokens, cost):
            return
        raise await _budget_refusal(budgets, prepared)


class _NotHeld(Exception):
    """A submit decided on a cached context found it changed (or needing more than a plain write):
    nothing was written; it is decided again on a fresh read."""


_NOT_HELD = _NotHeld()


class _Decided(Exception):
    """A refusal made after a cached context was found to hold: final, not decided again."""

    def __init__(self, refusal: SluiceError) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


class _NoFallback(SluiceError):
    """No permitted fallback took the run (ladder step 3 then keeps it on the requested model)."""


_NO_FALLBACK = _NoFallback("no permitted fallback")


def _prepared(tenant: TenantInfo, model: ModelInfo, route: RouteRecord, intent: SubmitIntent,
              packed: bytes, deadline_ms: int) -> _Prepared:
    """A request counted with `model`'s tokenizer (`packed`: its ids as stored) and priced at its card."""
    tokens = token_ids.count(packed)
    return _Prepared(
        tenant=tenant,
        model=model,
        route=route,
        intent=intent,
        prompt_token_ids=packed,
        input_tokens=tokens,
        payload_hash=payload_hash(intent.model, intent.input, intent.max_output_tokens, intent.sampling,
                                  intent.rendered),
        deadline_ms=deadline_ms,
        reserved_tokens=tokens + intent.max_output_tokens,
        reserved_cost_micros=reservation_cost_micros(model, tokens, intent.max_output_tokens),
    )


def _permitted_model(context: SubmitContext, tenant: TenantInfo, name: str) -> ModelInfo:
    if context.model is None:
        raise NotFound(UNKNOWN_MODEL.format(model=name))
    if context.model.quality_tier not in tenant.allowed_tiers:
        raise PermissionDenied(TIER_NOT_ALLOWED.format(
            model=name, tier=context.model.quality_tier, allowed=", ".join(tenant.allowed_tiers) or "none"))
    return context.model


async def _check_rate_limits(session: AsyncSession, prepared: _Prepared, run_id: uuid.UUID) -> None:
    """Concurrent-run and tokens-per-minute limits, exact across all admission instances.

    The tenant row lock (held to COMMIT) serializes this tenant's checks everywhere, and under it
    each check reads committed state plus this transaction's own new run, so no interleaving of
    instances can admit past a limit. Tenants without limits skip the lock entirely.
    """
    tenant = prepared.tenant
    await TenantRepository(session).lock_for_admission(tenant.id)
    runs = RunRepository(session)
    usage = await runs.limit_usage(tenant.id, RATE_WINDOW, excluding=run_id)
    max_runs = tenant.max_concurrent_runs
    if max_runs is not None and usage.active_runs >= max_runs:
        raise ResourceExhausted(CONCURRENCY_LIMIT.format(active=usage.active_runs, limit=max_runs),
                                reason="CONCURRENT_RUNS")
    limit, needed = tenant.tokens_per_minute, prepared.reserved_tokens
    if limit is None or usage.tokens_in_window + needed <= limit:
        return
    if needed > limit:
        advice = limit_advice(limit, prepared.input_tokens)
        raise ResourceExhausted(
            TOKENS_PER_MINUTE_NEVER_FITS.format(needed=needed, limit=limit, advice=advice),
            reason="TOKENS_PER_MINUTE",
        )
    entries = await runs.admitted_in_window(tenant.id, RATE_WINDOW, excluding=run_id)
    wait = rate_window_retry_after(entries, limit, needed, RATE_WINDOW)
    wait_ms = math.ceil(wait / dt.timedelta(milliseconds=1))
    raise ResourceExhausted(
        TOKENS_PER_MINUTE_LIMIT.format(
            admitted=usage.tokens_in_window, limit=limit, needed=needed, retry_after_ms=wait_ms
        ),
        metadata=[(RETRY_AFTER_MS_KEY, str(wait_ms))], reason="TOKENS_PER_MINUTE",
    )


async def _budget_refusal(budgets: BudgetRepository, prepared: _Prepared) -> ResourceExhausted:
    state = await budgets.current(prepared.tenant.id)
    if state is None:
        return ResourceExhausted(NO_BUDGET, reason="NO_BUDGET")
    prompt = prepared.input_tokens
    fit = largest_cap_that_fits(
        prepared.model, prompt, state.tokens_left, state.cost_left_micros, prepared.model.context_limit
    )
    amounts = {"tokens_left": state.tokens_left, "cost_left_micros": state.cost_left_micros, "prompt": prompt}
    if fit <= 0:
        return ResourceExhausted(
            BUDGET_TOO_SMALL_FOR_PROMPT.format(**amounts), metadata=[(MAX_OUTPUT_TOKENS_THAT_FIT_KEY, "0")],
            reason="BUDGET_EXCEEDED",
        )
    return ResourceExhausted(
        BUDGET_TOO_SMALL_FOR_CAP.format(**amounts, cap=prepared.intent.max_output_tokens, fit=fit),
        metadata=[(MAX_OUTPUT_TOKENS_THAT_FIT_KEY, str(fit))], reason="BUDGET_EXCEEDED",
    )


# --- gRPC edge ------------------------------------------------------------------------------------


def run_status_to_proto(status: RunStatus | str) -> common_pb2.RunStatus:
    return cast("common_pb2.RunStatus", common_pb2.RunStatus.Value(f"RUN_STATUS_{RunStatus(status).value}"))


def intent_from_proto(request: admission_pb2.SubmitRequest) -> SubmitIntent:
    return SubmitIntent(
        model=request.model,
        input=request.input,
        max_output_tokens=request.max_output_tokens,
        request_key=request.request_key,
        deadline_ms=request.deadline_ms,
        sampling=Sampling(
            temperature=normalize_float(request.sampling.temperature),
            top_p=normalize_float(request.sampling.top_p),
            seed=request.sampling.seed,
        ),
        conversation_id=request.conversation_id or None,
        fallback=narrowing_from_proto(request.fallback),
        priority=priority_from_proto(request.priority),
    )


def narrowing_from_proto(request: admission_pb2.FallbackRequest) -> Narrowing:
    return Narrowing(
        refuse=request.refuse,
        models=frozenset(name for name in request.models if name),
        conditions=frozenset(
            Condition(admission_pb2.FallbackCondition.Name(value).removeprefix("FALLBACK_CONDITION_").lower())
            for value in request.conditions if value != admission_pb2.FALLBACK_CONDITION_UNSPECIFIED),
    )



class AdmissionServicer(admission_pb2_grpc.AdmissionServicer):
    def __init__(self, service: AdmissionService) -> None:
        self._service = service

    @grpc_errors
    async def Submit(
        self, request: admission_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.SubmitResponse:
        admitted = await self._service.submit(context.invocation_metadata(), intent_from_proto(request))
        return admission_pb2.SubmitResponse(
            run_id=str(admitted.run_id),
            status=run_status_to_proto(admitted.status),
            model_version=admitted.model_version,
            input_tokens=admitted.input_tokens,
            max_output_tokens=admitted.max_output_tokens,
            deduplicated=admitted.deduplicated,
            route=route_message(admitted.route),
            priority=priority_to_proto(admitted.priority),
        )


def add_admission_servicer(server: grpc.aio.Server, sessionmaker: async_sessionmaker[AsyncSession],
                           config: Settings, metrics: GatewayMetrics | None = None,
                           hot: HotPool | None = None, run_ids: Callable[[], uuid.UUID] = uuid.uuid4,
                           recent: RecentAdmissions | None = None) -> AdmissionService:
    """Register Admission on `server`; returns the service (handy for in-process callers). `hot`: the
    process's pool of raw connections (ledger/pg.py), shared with Runs; None: the service opens its own.
    `run_ids`: how new run ids are drawn (the gateway's: KafkaEventLog.home_run_ids); `recent`: where
    new runs are remembered for the Stream that follows (shared with Runs: services/admitted_here.py)."""
    service = AdmissionService(sessionmaker, AdmissionSettings.from_config(config), metrics, hot=hot,
                               run_ids=run_ids, recent=recent)
    add_checked_service(server, admission_pb2.DESCRIPTOR.services_by_name["Admission"],
                        AdmissionServicer(service), FieldLimits.from_config(config))
    return service
