"""Permitted fallback: which smaller model a run may take instead of the one it asked for, and when.

A tenant's administrator names, per requested model (alias or version), the models accepted in
its place and the conditions under which they may be taken:

    chat-70b → chat-8b   when [backlog, deadline]

- backlog:  the requested model's pool holds [admission].max_backlog_per_pool waiting runs (the
            submit would be shed with UNAVAILABLE);
- deadline: the predicted queue wait of the requested pool pushes the run past its deadline
            (the run would fit the deadline on an empty queue, but not behind the backlog).

A request may only narrow this: refuse fallback altogether, keep fewer of the models, or fewer of
the conditions; it can never add a model or a condition the tenant did not permit. A candidate is
then taken only if its quality tier is one the tenant may use, it is not itself overloaded, and
the run fits its context and deadline counted with its own tokenizer. Nothing falls back silently:
the run records reason `fallback`, the version it would have gone to, and the condition met.

Pure: admission reads the rules and the candidates' state, tokenizes, and asks these functions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Condition(enum.StrEnum):
    """When a fallback may be taken; stored as TEXT in tenant_fallbacks.conditions."""

    BACKLOG = "backlog"
    DEADLINE = "deadline"


@dataclass(frozen=True, slots=True)
class FallbackRule:
    """One permitted substitution of a tenant (admin-configured, table tenant_fallbacks)."""

    from_model: str                  # the requested name it applies to: an alias or a version
    to_model: str                    # the model accepted instead: an alias or a version
    conditions: frozenset[Condition]


@dataclass(frozen=True, slots=True)
class Narrowing:
    """What one request says about fallback; the defaults leave the tenant's permission whole."""

    refuse: bool = False                                # no fallback for this request
    models: frozenset[str] = frozenset()                # only these of the permitted; empty = all
    conditions: frozenset[Condition] = frozenset()      # only these of the permitted; empty = all


NO_NARROWING = Narrowing()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A fallback model's state as admission read it."""

    name: str                        # as the rule wrote it
    version: str | None              # what it resolves to; None: unknown or retired
    quality_tier: str
    context_limit: int
    backlog: int                     # its pool's waiting runs (counted up to the bound)


class Unusable(enum.StrEnum):
    """Why a permitted candidate was not taken (logged; the caller gets the original refusal)."""

    UNKNOWN = "unknown or retired model"
    SAME_MODEL = "the model that was refused"
    TIER = "quality tier not allowed for the tenant"
    BACKLOG = "its own pool is full"
    CONTEXT = "prompt + output cap exceed its context"
    DEADLINE = "cannot meet the deadline either"


def permitted(rules: Iterable[FallbackRule], requested_name: str, requested_version: str,
              condition: Condition, narrowing: Narrowing = NO_NARROWING) -> tuple[str, ...]:
    """The models this request may fall back to when `condition` holds, in the tenant's order.

    A rule applies when it names the model as the caller wrote it or the version it resolved to
    (a rule on `chat-70b-v3` also covers a request for its alias). Duplicates keep their first place.
    """
    if narrowing.refuse:
        return ()
    if narrowing.conditions and condition not in narrowing.conditions:
        return ()
    chosen: dict[str, None] = {}
    for rule in rules:
        if rule.from_model not in (requested_name, requested_version) or condition not in rule.conditions:
            continue
        if narrowing.models and rule.to_model not in narrowing.models:
            continue
        chosen.setdefault(rule.to_model, None)
    return tuple(chosen)


def unusable(candidate: Candidate, refused_version: str, allowed_tiers: Sequence[str], max_backlog: int,
             ) -> Unusable | None:
    """Why `candidate` cannot take the run before its prompt is even counted; None: it may."""
    if candidate.version is None:
        return Unusable.UNKNOWN
    if candidate.version == refused_version:
        return Unusable.SAME_MODEL
    if candidate.quality_tier not in allowed_tiers:
        return Unusable.TIER
    if candidate.backlog >= max_backlog:
        return Unusable.BACKLOG
    return None


def queue_bound(deadline_ms: int, queue_ms: int, service_ms: int) -> bool:
    """The deadline condition: the run misses `deadline_ms` behind the queue (queue + its own
    prefill and decode), yet would meet it with no queue at all. A run too long for its deadline
    on an idle pool is not helped by another pool of the same pace: that stays DEADLINE_EXCEEDED."""
    return queue_ms + service_ms > deadline_ms >= service_ms


def describe(condition: Condition, requested_version: str, detail: str) -> str:
    """The run's route detail for a fallback: which condition sent it away from which version."""
    return f"{condition.value}: {requested_version} {detail}"
