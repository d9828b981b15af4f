"""The Admin API's traffic policy (issue 14): tenants' permitted fallbacks and alias canaries.

Each function runs inside the transaction `AdminService._admin` opened for an admin-scoped caller,
reads what it changes FOR UPDATE, changes it and writes the audit row; raising rolls it all back.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.ledger import audit
from sluice.ledger.admin import ModelAdmin, TenantRecord
from sluice.ledger.audit import Actor
from sluice.ledger.canaries import CanaryRecord, CanaryRepository
from sluice.ledger.fallbacks import FallbackAdmin
from sluice.ledger.models import CanaryState
from sluice.services.errors import FailedPrecondition, InvalidArgument, NotFound
from sqlalchemy.ext.asyncio import AsyncSession

from sluice.traffic.canary import SHARE_SCALE, Guardrails
from sluice.traffic.fallback import Condition, FallbackRule

FALLBACK_UNNAMED = "fallback rule {index}: name both from_model and to_model"
FALLBACK_TO_ITSELF = "fallback rule {index}: {model!r} cannot fall back to itself"
FALLBACK_UNKNOWN_MODEL = "fallback rule {index}: no model has version or alias {model!r}: see ListModels"
FALLBACK_BAD_CONDITION = "fallback rule {index}: unknown condition {condition!r}: use backlog or deadline"
FALLBACK_DUPLICATE = "fallback rule {index}: {source!r} -> {target!r} is listed twice"
ALIAS_UNHELD = "no model version holds alias {alias!r}: register or MoveAlias first"
CANARY_UNKNOWN_VERSION = "unknown model version {version!r}: ListModels shows the versions"
CANARY_RETIRED = "model version {version!r} is retired: canary a live version"
CANARY_SAME_VERSION = "{version!r} already holds alias {alias!r}: a canary needs another version"
CANARY_ACTIVE = "alias {alias!r} already has an active canary to {candidate!r}: stop or promote it first"
CANARY_NONE = "alias {alias!r} has no active canary: ListCanaries shows them"
SHARE_OUT_OF_RANGE = "share_bp must be within {low}..{high} basis points (got {value})"
STOPPED_BY_ADMIN = "stopped by an admin"
PROMOTED = "promoted: alias {alias!r} moved to {version!r}"
MOVED_BY_HAND = "ended: an admin moved alias {alias!r} to {version!r} (MoveAlias)"


def fallback_rules(rules: Sequence[tuple[str, str, Sequence[str]]]) -> list[FallbackRule]:
    """(from, to, conditions) as rules, checked; no conditions = both."""
    checked: list[FallbackRule] = []
    seen: set[tuple[str, str]] = set()
    for index, (source, target, conditions) in enumerate(rules):
        if not source or not target:
            raise InvalidArgument(FALLBACK_UNNAMED.format(index=index))
        if source == target:
            raise InvalidArgument(FALLBACK_TO_ITSELF.format(index=index, model=source))
        if (source, target) in seen:
            raise InvalidArgument(FALLBACK_DUPLICATE.format(index=index, source=source, target=target))
        seen.add((source, target))
        known = {c.value for c in Condition}
        for condition in conditions:
            if condition not in known:
                raise InvalidArgument(FALLBACK_BAD_CONDITION.format(index=index, condition=condition))
        when = frozenset(Condition(c) for c in conditions) or frozenset(Condition)
        checked.append(FallbackRule(source, target, when))
    return checked


def _rules_json(rules: Sequence[FallbackRule]) -> list[dict[str, object]]:
    return [{"from": rule.from_model, "to": rule.to_model,
             "conditions": sorted(c.value for c in rule.conditions)} for rule in rules]


async def set_fallbacks(session: AsyncSession, actor: Actor, tenant: TenantRecord,
                        rules: Sequence[FallbackRule]) -> list[FallbackRule]:
    fallbacks = FallbackAdmin(session)
    for index, rule in enumerate(rules):
        if not await fallbacks.known_model(rule.to_model):
            raise NotFound(FALLBACK_UNKNOWN_MODEL.format(index=index, model=rule.to_model))
    before = await fallbacks.get(tenant.id)
    await fallbacks.replace(tenant.id, rules)
    after = await fallbacks.get(tenant.id)
    await audit.record(session, actor, "tenant.set_fallbacks", tenant.name,
                       {"rules": _rules_json(before)}, {"rules": _rules_json(after)})
    return after


async def get_fallbacks(session: AsyncSession, tenant: TenantRecord) -> list[FallbackRule]:
    return await FallbackAdmin(session).get(tenant.id)


def _share(value: int, low: int) -> int:
    if not low <= value <= SHARE_SCALE:
        raise InvalidArgument(SHARE_OUT_OF_RANGE.format(low=low, high=SHARE_SCALE, value=value))
    return value


async def start_canary(session: AsyncSession, actor: Actor, alias: str, candidate: str, share_bp: int,
                       limits: Guardrails) -> CanaryRecord:
    _share(share_bp, 1)
    models = ModelAdmin(session)
    holder = await models.holder_of(alias)
    if holder is None:
        raise NotFound(ALIAS_UNHELD.format(alias=alias))
    target = await models.get(candidate)
    if target is None:
        raise NotFound(CANARY_UNKNOWN_VERSION.format(version=candidate))
    if target.retired_at is not None:
        raise FailedPrecondition(CANARY_RETIRED.format(version=candidate))
    if target.version == holder.version:
        raise FailedPrecondition(CANARY_SAME_VERSION.format(version=candidate, alias=alias))
    canaries = CanaryRepository(session)
    before = await canaries.get(alias, lock=True)
    if before is not None and before.state is CanaryState.ACTIVE:
        raise FailedPrecondition(CANARY_ACTIVE.format(alias=alias, candidate=before.candidate_version))
    await canaries.start(alias, holder.version, target.version, share_bp, limits)
    after = await canaries.get(alias)
    assert after is not None
    await audit.record(session, actor, "canary.start", alias, before, after)
    return after


async def _active(canaries: CanaryRepository, alias: str) -> CanaryRecord:
    canary = await canaries.get(alias, lock=True)
    if canary is None or canary.state is not CanaryState.ACTIVE:
        raise FailedPrecondition(CANARY_NONE.format(alias=alias))
    return canary


async def set_canary_share(session: AsyncSession, actor: Actor, alias: str, share_bp: int) -> CanaryRecord:
    _share(share_bp, 0)
    canaries = CanaryRepository(session)
    before = await _active(canaries, alias)
    await canaries.set_share(alias, share_bp)
    after = await canaries.get(alias)
    await audit.record(session, actor, "canary.set_share", alias, before, after)
    assert after is not None
    return after


async def stop_canary(session: AsyncSession, actor: Actor, alias: str, reason: str) -> CanaryRecord:
    canaries = CanaryRepository(session)
    before = await _active(canaries, alias)
    await canaries.end(alias, CanaryState.ROLLED_BACK, reason or STOPPED_BY_ADMIN)
    after = await canaries.get(alias)
    await audit.record(session, actor, "canary.stop", alias, before, after)
    assert after is not None
    return after


async def end_canary_on_move(session: AsyncSession, actor: Actor, alias: str, version: str) -> None:
    """MoveAlias ended the baseline the alias's active canary compares against: the canary ends too,
    PROMOTED when the alias went to its candidate, else rolled back. Nothing when none is active."""
    canaries = CanaryRepository(session)
    before = await canaries.get(alias, lock=True)
    if before is None or before.state is not CanaryState.ACTIVE:
        return
    state = CanaryState.PROMOTED if version == before.candidate_version else CanaryState.ROLLED_BACK
    await canaries.end(alias, state, MOVED_BY_HAND.format(alias=alias, version=version))
    await audit.record(session, actor, "canary.end_on_move", alias, before, await canaries.get(alias))


async def promote_canary(session: AsyncSession, actor: Actor, alias: str) -> CanaryRecord:
    """The alias moves to the candidate (atomic, as MoveAlias) and the canary ends PROMOTED."""
    canaries = CanaryRepository(session)
    before = await _active(canaries, alias)
    models = ModelAdmin(session)
    await models.lock(before.baseline_version, before.candidate_version)
    await models.move_alias(alias, before.candidate_version)
    await canaries.end(alias, CanaryState.PROMOTED,
                       PROMOTED.format(alias=alias, version=before.candidate_version))
    after = await canaries.get(alias)
    await audit.record(session, actor, "canary.promote", alias, before, after)
    assert after is not None
    return after
